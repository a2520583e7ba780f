//! Python functions shipped to worker processes: the carrier that packs a session's Python
//! models and functions into the task plans that call them, and unpacks them in a worker
//! started as `python -m flumen worker` ([`flumen::cluster::shipped_functions`]).
//!
//! What travels is what `flumen._shipping.pack` made when the function was registered: the
//! driver's `sys.path` and, pickled by cloudpickle, the class or function and how it was
//! registered (result type, batch rows, device). A worker unpacks it once and keeps it, so a
//! model class is instantiated once per worker, on its model thread.

use std::any::Any;
use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::ScalarUDF;
use flumen::cluster::shipped_functions::{FunctionCarrier, register_carrier};
use flumen::functions::accelerator::AcceleratorUdf;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::model::{PythonModel, import_type, model_udf};
use crate::udf::PythonUdf;

/// The carrier of Python functions, for this interpreter's version.
struct PythonCarrier {
    runtime: String,
}

impl FunctionCarrier for PythonCarrier {
    fn runtime(&self) -> String {
        self.runtime.clone()
    }

    fn pack(&self, udf: &ScalarUDF) -> Option<Vec<u8>> {
        let inner: &dyn Any = udf.inner().as_ref();
        if let Some(accelerator) = inner.downcast_ref::<AcceleratorUdf>() {
            let function: &dyn Any = accelerator.function().as_ref();
            return function.downcast_ref::<PythonModel>()?.packed().cloned();
        }
        inner.downcast_ref::<PythonUdf>()?.packed().cloned()
    }

    fn unpack(&self, name: &str, packed: &[u8]) -> Result<ScalarUDF> {
        Python::attach(|py| unpack(py, name, packed)).map_err(|e| {
            DataFusionError::Execution(format!(
                "Python function {name} could not be unpacked in this worker: {e}"
            ))
        })
    }
}

/// The function `packed` (from `flumen._shipping.pack`) holds, as SQL function `name`.
fn unpack(py: Python<'_>, name: &str, packed: &[u8]) -> PyResult<ScalarUDF> {
    let shipping = py.import("flumen._shipping")?;
    let spec = shipping.call_method1("unpack", (PyBytes::new(py, packed),))?;
    let spec = spec.cast::<PyDict>()?;
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        spec.get_item(key)?.ok_or_else(|| {
            pyo3::exceptions::PyKeyError::new_err(format!("a packed function without {key}"))
        })
    };
    let object: Py<PyAny> = item("object")?.unbind();
    let returns = import_type(&item("returns")?)?;
    let packed = Some(packed.to_vec());
    match item("kind")?.extract::<String>()?.as_str() {
        "model" => {
            let batch_rows: Option<usize> = item("batch_rows")?.extract()?;
            let device: String = item("device")?.extract()?;
            model_udf(py, name, object, returns, batch_rows, &device, packed)
        }
        "udf" => Ok(ScalarUDF::new_from_impl(PythonUdf::new(
            py, name, object, returns, packed,
        ))),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "a packed function of unknown kind {other:?}"
        ))),
    }
}

/// Let this process ship and unpack Python functions (at the module's import).
pub fn register(py: Python<'_>) -> PyResult<()> {
    let version = py.version_info();
    register_carrier(Arc::new(PythonCarrier {
        runtime: format!("python{}.{}", version.major, version.minor),
    }));
    Ok(())
}
