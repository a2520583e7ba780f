//! Python model classes as accelerator functions: `Session.register_model(name, cls)`.
//!
//! A class decorated with `@flumen.model(returns=..., batch_rows=..., device=...)` becomes
//! an [`AcceleratorFunction`]: the planner puts its calls in an accelerator operator of their
//! own, its CPU arguments below it, like `embed`. Each accelerator worker thread makes one
//! instance (`cls()`: the model is loaded once per worker and kept for every later block)
//! and calls it on blocks of up to `batch_rows` rows: `instance(batch)` with a
//! `pyarrow.RecordBatch` whose columns are the call's arguments (`arg0`, `arg1`, ...),
//! returning one value per row as anything with `__arrow_c_array__` (a `pyarrow.Array`).
//! Calls hold the GIL only while Python runs; the arguments and result cross through the
//! Arrow C data interface without copies.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions, make_array};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::ffi::{FFI_ArrowArray, FFI_ArrowSchema, from_ffi};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{ScalarUDF, Signature, Volatility};
use flumen::functions::accelerator::{
    AcceleratorFunction, AcceleratorWorker, WorkerResources, accelerator_udf,
};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

use crate::ExportedBatch;

/// A Python model class registered as a SQL function.
#[derive(Debug)]
pub struct PythonModel {
    name: String,
    class: Py<PyAny>,
    class_name: String,
    returns: DataType,
    batch_rows: Option<usize>,
    on_gpu: bool,
    signature: Signature,
    /// The class and its registration as `flumen._shipping.pack` made them, for worker
    /// processes (`None`: it cannot leave this process).
    packed: Option<Vec<u8>>,
}

impl PythonModel {
    /// What ships to worker processes, when it can.
    pub fn packed(&self) -> Option<&Vec<u8>> {
        self.packed.as_ref()
    }
}

/// `class` as SQL function `name` in the accelerator pool, returning `returns`, called on
/// up to `batch_rows` rows at a time (`None`: whole blocks); `device`: `"cpu"` or
/// `"cuda"` (its worker holds a GPU); `packed`: what ships to worker processes.
pub fn model_udf(
    py: Python<'_>,
    name: &str,
    class: Py<PyAny>,
    returns: DataType,
    batch_rows: Option<usize>,
    device: &str,
    packed: Option<Vec<u8>>,
) -> PyResult<ScalarUDF> {
    let on_gpu = match device {
        "cpu" => false,
        "cuda" => true,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "device must be 'cpu' or 'cuda', got {other:?}"
            )));
        }
    };
    if batch_rows == Some(0) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "batch_rows must be at least 1",
        ));
    }
    let class_name = qualified_name(py, &class, name);
    Ok(accelerator_udf(PythonModel {
        name: name.to_string(),
        class,
        class_name,
        returns,
        batch_rows,
        on_gpu,
        signature: Signature::variadic_any(Volatility::Volatile),
        packed,
    }))
}

/// Make CUDA device `device` torch's current one on this thread, where torch is installed
/// and sees it (a model on another library picks its device itself).
fn make_current_torch_device(py: Python<'_>, device: usize) -> PyResult<()> {
    let Ok(torch) = py.import("torch") else {
        return Ok(());
    };
    let cuda = torch.getattr("cuda")?;
    let count: usize = cuda.call_method0("device_count")?.extract()?;
    if device < count {
        cuda.call_method1("set_device", (device,))?;
    }
    Ok(())
}

/// `object`'s `__qualname__` (for error messages), or `fallback`.
pub fn qualified_name(py: Python<'_>, object: &Py<PyAny>, fallback: &str) -> String {
    (object.bind(py).getattr("__qualname__"))
        .and_then(|n| n.extract::<String>())
        .unwrap_or_else(|_| fallback.to_string())
}

/// A Python exception as the error of a model call, naming the class.
fn model_error(class: &str, what: &str, e: PyErr) -> DataFusionError {
    DataFusionError::Execution(format!("Python model {class}: {what}: {e}"))
}

impl AcceleratorFunction for PythonModel {
    fn name(&self) -> &str {
        &self.name
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _: &[DataType]) -> Result<DataType> {
        Ok(self.returns.clone())
    }
    fn load(&self, _: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        // A GPU model's worker computes on its own GPU (one per worker on a host with
        // several, `flumen::functions::accelerator_devices`): made torch's current device on
        // this thread, where `__init__` and every call run, so `"cuda"` means that GPU.
        let device = match self.on_gpu {
            true => Some(flumen::functions::accelerator_devices::worker_device()?),
            false => None,
        };
        Python::attach(|py| {
            if let Some(device) = device {
                make_current_torch_device(py, device)
                    .map_err(|e| model_error(&self.class_name, "choosing its GPU", e))?;
            }
            let instance = (self.class.bind(py).call0())
                .map_err(|e| model_error(&self.class_name, "__init__ failed", e))?;
            Ok(Box::new(PythonModelWorker {
                instance: instance.unbind(),
                class_name: self.class_name.clone(),
            }) as Box<dyn AcceleratorWorker>)
        })
    }
    fn batch_rows(&self, _: &ConfigOptions) -> Option<usize> {
        self.batch_rows
    }
    fn resources(&self, _: &ConfigOptions) -> WorkerResources {
        WorkerResources {
            accelerators: usize::from(self.on_gpu),
            cpu_threads: 1,
        }
    }
}

/// One worker's instance of a model class.
struct PythonModelWorker {
    instance: Py<PyAny>,
    class_name: String,
}

impl AcceleratorWorker for PythonModelWorker {
    fn process(&mut self, args: &[ArrayRef], return_type: &DataType) -> Result<ArrayRef> {
        let rows = args.first().map_or(0, |a| a.len());
        let what = format!("Python model {}", self.class_name);
        call_python(&self.instance, &what, args, rows, return_type)
    }
}

/// Call `callable` (a model instance or a function; `what` names it in errors) on `rows`
/// rows of `args`, handed over as a `pyarrow.RecordBatch` (`arg0`, `arg1`, ...), and
/// import its result: `rows` values of type `return_type`. Holds the GIL while Python runs.
pub fn call_python(
    callable: &Py<PyAny>,
    what: &str,
    args: &[ArrayRef],
    rows: usize,
    return_type: &DataType,
) -> Result<ArrayRef> {
    let fields: Vec<Field> = (args.iter().enumerate())
        .map(|(k, a)| Field::new(format!("arg{k}"), a.data_type().clone(), true))
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    let batch =
        RecordBatch::try_new_with_options(Arc::new(Schema::new(fields)), args.to_vec(), &options)?;
    let failed = |step: &str, e: PyErr| DataFusionError::Execution(format!("{what}: {step}: {e}"));
    let output = Python::attach(|py| -> Result<ArrayRef> {
        let pyarrow = (py.import("pyarrow")).map_err(|e| failed("pyarrow is not importable", e))?;
        let exported =
            Py::new(py, ExportedBatch { batch }).map_err(|e| failed("exporting the batch", e))?;
        let batch = (pyarrow.call_method1("record_batch", (exported,)))
            .map_err(|e| failed("exporting the batch", e))?;
        let result =
            (callable.bind(py).call1((batch,))).map_err(|e| failed("__call__ failed", e))?;
        import_array(&result).map_err(|e| failed("its result", e))
    })?;
    if output.len() != rows {
        return Err(DataFusionError::Execution(format!(
            "{what} returned {} values for {rows} rows",
            output.len()
        )));
    }
    if output.data_type() != return_type {
        return Err(DataFusionError::Execution(format!(
            "{what} returned {}, registered as returning {return_type}",
            output.data_type()
        )));
    }
    Ok(output)
}

/// The array of a Python object with `__arrow_c_array__`, imported without copying.
fn import_array(obj: &Bound<'_, PyAny>) -> PyResult<ArrayRef> {
    if !obj.hasattr("__arrow_c_array__")? {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "expected an Arrow array (__arrow_c_array__), got {}",
            obj.get_type().name()?
        )));
    }
    let pair = obj.call_method0("__arrow_c_array__")?;
    let pair = pair.cast::<PyTuple>()?;
    let schema = pair.get_item(0)?;
    let schema = schema.cast::<PyCapsule>()?;
    let array = pair.get_item(1)?;
    let array = array.cast::<PyCapsule>()?;
    let schema = schema.pointer_checked(Some(c"arrow_schema"))?.as_ptr() as *const FFI_ArrowSchema;
    let array = array.pointer_checked(Some(c"arrow_array"))?.as_ptr() as *mut FFI_ArrowArray;
    // SAFETY: the capsules hold an ArrowSchema and an ArrowArray (the protocol's promise);
    // the array is moved out (its capsule's copy marked released), the schema borrowed
    // while its capsule lives.
    let data = unsafe {
        let array = FFI_ArrowArray::from_raw(array);
        from_ffi(array, &*schema)
    }
    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(make_array(data))
}

/// The Arrow type a Python object with `__arrow_c_schema__` (a `pyarrow.DataType` or
/// `Field`) describes.
pub fn import_type(obj: &Bound<'_, PyAny>) -> PyResult<DataType> {
    let capsule = obj.call_method0("__arrow_c_schema__")?;
    let capsule = capsule.cast::<PyCapsule>()?;
    let schema = capsule.pointer_checked(Some(c"arrow_schema"))?.as_ptr() as *const FFI_ArrowSchema;
    // SAFETY: the capsule holds an ArrowSchema and lives while it is read.
    let schema = unsafe { &*schema };
    DataType::try_from(schema).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}
