//! `flumen._flumen`: flumen's Python module. A [`Session`] holds a flumen `SessionContext`;
//! `sql` plans a query into a lazy [`DataFrame`] whose results leave as Arrow through the
//! C data interface (PyCapsules: `__arrow_c_stream__`, `__arrow_c_array__`,
//! `__arrow_c_schema__`), so pyarrow, polars and DuckDB read them without copies.
//!
//! One Tokio runtime serves every session. Every wait releases the GIL and checks for
//! Ctrl-C twice a second ([`wait`]): a `KeyboardInterrupt` drops the query's stream, which
//! cancels its tasks. The Python wrapper (`python/flumen/__init__.py`) builds the user's API
//! on these classes.

use std::ffi::CString;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use datafusion::arrow::array::{Array, RecordBatch, RecordBatchReader, StructArray};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use datafusion::arrow::ffi_stream::{ArrowArrayStreamReader, FFI_ArrowArrayStream};
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionContext};
use futures::StreamExt;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

mod model;
mod shipping;
mod udf;

pyo3::create_exception!(_flumen, FlumenError, pyo3::exceptions::PyException);

/// The process's one Tokio runtime.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("flumen-python")
            .build()
            .expect("a Tokio runtime")
    })
}

/// Run `future` to its end without the GIL, checking for Ctrl-C (and other signals Python
/// handles) every half second: a signal's exception drops the future and is raised.
fn wait<F>(py: Python<'_>, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut future = Box::pin(future);
    loop {
        let step = py.detach(|| {
            runtime().block_on(async {
                tokio::time::timeout(Duration::from_millis(500), &mut future).await
            })
        });
        match step {
            Ok(output) => return Ok(output),
            Err(_) => py.check_signals()?,
        }
    }
}

/// A DataFusion error as a Python exception, its message intact.
fn error(e: DataFusionError) -> PyErr {
    FlumenError::new_err(e.to_string())
}

/// `batch` as the two capsules of the Arrow C data interface: its schema and its rows (as
/// one struct array), sharing its buffers.
fn batch_capsules<'py>(py: Python<'py>, batch: &RecordBatch) -> PyResult<Bound<'py, PyTuple>> {
    let array = StructArray::from(batch.clone());
    let schema = FFI_ArrowSchema::try_from(array.data_type())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let array = FFI_ArrowArray::new(&array.to_data());
    let schema = PyCapsule::new(py, schema, Some(CString::new("arrow_schema").unwrap()))?;
    let array = PyCapsule::new(py, array, Some(CString::new("arrow_array").unwrap()))?;
    PyTuple::new(py, [schema.into_any(), array.into_any()])
}

/// `schema` as an `arrow_schema` capsule.
fn schema_capsule<'py>(py: Python<'py>, schema: &SchemaRef) -> PyResult<Bound<'py, PyCapsule>> {
    let schema = FFI_ArrowSchema::try_from(schema.as_ref())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    PyCapsule::new(py, schema, Some(CString::new("arrow_schema").unwrap()))
}

/// A stream of batches as an `arrow_array_stream` capsule.
fn stream_capsule<'py>(
    py: Python<'py>,
    reader: Box<dyn RecordBatchReader + Send>,
) -> PyResult<Bound<'py, PyCapsule>> {
    let stream = FFI_ArrowArrayStream::new(reader);
    PyCapsule::new(
        py,
        stream,
        Some(CString::new("arrow_array_stream").unwrap()),
    )
}

/// The batches an object with `__arrow_c_stream__` (a pyarrow table or reader, a polars
/// frame, another flumen result...) holds, imported without copying their buffers.
fn import_stream(obj: &Bound<'_, PyAny>) -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
    if !obj.hasattr("__arrow_c_stream__")? {
        return Err(PyTypeError::new_err(format!(
            "from_arrow takes an object with __arrow_c_stream__ (pyarrow, polars, ...), got {}",
            obj.get_type().name()?
        )));
    }
    let capsule = obj.call_method0("__arrow_c_stream__")?;
    let capsule = capsule.cast::<PyCapsule>()?;
    let pointer = capsule
        .pointer_checked(Some(c"arrow_array_stream"))?
        .as_ptr() as *mut FFI_ArrowArrayStream;
    // SAFETY: the capsule holds an ArrowArrayStream (the protocol's promise); `from_raw`
    // moves it out and marks the capsule's copy released, so the producer's release runs
    // once, from the reader.
    let stream = unsafe { FFI_ArrowArrayStream::from_raw(pointer) };
    let reader = ArrowArrayStreamReader::try_new(stream)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let schema = reader.schema();
    let batches = reader
        .collect::<Result<Vec<_>, ArrowError>>()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((schema, batches))
}

/// A flumen session: a DataFusion `SessionContext` with flumen's planner, scheduler,
/// functions (`embed`, ...) and settings.
#[pyclass(module = "flumen._flumen", frozen)]
struct Session {
    ctx: SessionContext,
}

#[pymethods]
impl Session {
    /// A session; `settings`: (name, value) pairs applied as `SET name = 'value'`;
    /// `python`: the interpreter its worker processes run (`python -m flumen worker`), so
    /// they can run the session's Python functions.
    #[new]
    #[pyo3(signature = (settings = None, python = None))]
    fn new(
        py: Python<'_>,
        settings: Option<Vec<(String, String)>>,
        python: Option<String>,
    ) -> PyResult<Self> {
        let mut config = flumen::FlumenConfig::default();
        if let Some(python) = python {
            config.worker_binary = python.into();
            config.worker_module = "flumen".into();
        }
        // A quoted path or URL reads as a table (`FROM 'data/t.parquet'`), as in the shell.
        let ctx = flumen::session(config).enable_url_table();
        for (name, value) in settings.unwrap_or_default() {
            let value = value.replace('\'', "''");
            let sql = format!("SET {name} = '{value}'");
            wait(py, async { ctx.sql(&sql).await?.collect().await })?.map_err(error)?;
        }
        Ok(Self { ctx })
    }

    /// Plan `query`: a lazy result. Statements that change the session (`SET`, `CREATE`,
    /// `DROP`) take effect now, as in DataFusion.
    fn sql(&self, py: Python<'_>, query: &str) -> PyResult<DataFrame> {
        let df = wait(py, flumen::user_statement(&self.ctx, query))?.map_err(error)?;
        Ok(DataFrame { df })
    }

    /// Register Parquet files (a file, a directory or a URL) as table `name`.
    fn register_parquet(&self, py: Python<'_>, name: &str, path: &str) -> PyResult<()> {
        let options = ParquetReadOptions::default();
        wait(py, self.ctx.register_parquet(name, path, options))?.map_err(error)
    }

    /// Register CSV files (with a header row) as table `name`.
    fn register_csv(&self, py: Python<'_>, name: &str, path: &str) -> PyResult<()> {
        let options = CsvReadOptions::new();
        wait(py, self.ctx.register_csv(name, path, options))?.map_err(error)
    }

    /// Register the rows of any object with `__arrow_c_stream__` as table `name`, without
    /// copying them.
    fn register_arrow(&self, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let (schema, batches) = import_stream(obj)?;
        let table = MemTable::try_new(schema, vec![batches]).map_err(error)?;
        self.ctx
            .register_table(name, Arc::new(table))
            .map_err(error)?;
        Ok(())
    }

    /// Register `class` (a Python model class: `cls()` loads it, `instance(batch)` computes a
    /// `pyarrow.Array` of type `returns` for a `pyarrow.RecordBatch` of the call's
    /// arguments) as SQL function `name`, run in the accelerator pool on blocks of up to
    /// `batch_rows` rows; `device`: `"cpu"` or `"cuda"` (the worker holds a GPU);
    /// `packed`: the class as it ships to worker processes (`flumen._shipping.pack`).
    #[pyo3(signature = (name, class, returns, batch_rows = None, device = "cpu", packed = None))]
    #[allow(clippy::too_many_arguments)]
    fn register_model(
        &self,
        py: Python<'_>,
        name: &str,
        class: Py<PyAny>,
        returns: &Bound<'_, PyAny>,
        batch_rows: Option<usize>,
        device: &str,
        packed: Option<Vec<u8>>,
    ) -> PyResult<()> {
        let returns = model::import_type(returns)?;
        let udf = model::model_udf(py, name, class, returns, batch_rows, device, packed)?;
        self.ctx.register_udf(udf);
        Ok(())
    }

    /// Register `function` (a Python function: `function(batch)` computes a `pyarrow.Array`
    /// of type `returns` for a `pyarrow.RecordBatch` of the call's arguments) as SQL
    /// function `name`, run in the CPU tasks that evaluate it; `packed`: the function as
    /// it ships to worker processes.
    #[pyo3(signature = (name, function, returns, packed = None))]
    fn register_udf(
        &self,
        py: Python<'_>,
        name: &str,
        function: Py<PyAny>,
        returns: &Bound<'_, PyAny>,
        packed: Option<Vec<u8>>,
    ) -> PyResult<()> {
        let returns = model::import_type(returns)?;
        let udf = udf::PythonUdf::new(py, name, function, returns, packed);
        self.ctx
            .register_udf(datafusion::logical_expr::ScalarUDF::new_from_impl(udf));
        Ok(())
    }

    /// Drop table `name` (true when there was one).
    fn deregister_table(&self, name: &str) -> PyResult<bool> {
        Ok(self.ctx.deregister_table(name).map_err(error)?.is_some())
    }
}

/// A planned query: runs when its rows are asked for.
#[pyclass(module = "flumen._flumen", frozen)]
struct DataFrame {
    df: datafusion::dataframe::DataFrame,
}

#[pymethods]
impl DataFrame {
    /// The result's schema, as an `arrow_schema` capsule.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let schema: SchemaRef = Arc::new(self.df.schema().as_arrow().clone());
        schema_capsule(py, &schema)
    }

    /// Run the query and hand its rows on as they come (the Arrow PyCapsule stream
    /// interface): the consumer's pace holds the query back, not the memory. The reader
    /// waits for each batch holding the GIL; `batches()` waits without it.
    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema;
        let stream = wait(py, self.df.clone().execute_stream())?.map_err(error)?;
        stream_capsule(py, Box::new(BlockingReader { stream }))
    }

    /// Run the query: an iterator of its batches, each waited for without the GIL.
    fn batches(&self, py: Python<'_>) -> PyResult<BatchStream> {
        let stream = wait(py, self.df.clone().execute_stream())?.map_err(error)?;
        Ok(BatchStream {
            stream: std::sync::Mutex::new(Some(stream)),
        })
    }

    /// The same rows in a random order: `ORDER BY random()`, which flumen runs as a seeded
    /// shuffle (an exchange, not a sort), under `flumen.shuffle_seed = seed`: the same seed
    /// gives the same order.
    fn shuffled(&self, seed: u64) -> PyResult<DataFrame> {
        let (state, plan) = self.df.clone().into_parts();
        let mut config = state.config().clone();
        config
            .options_mut()
            .set("flumen.shuffle_seed", &seed.to_string())
            .map_err(error)?;
        let state = datafusion::execution::SessionStateBuilder::new_from_existing(state)
            .with_config(config)
            .build();
        let random = datafusion::functions::math::expr_fn::random();
        let df = datafusion::dataframe::DataFrame::new(state, plan)
            .sort(vec![random.sort(true, false)])
            .map_err(error)?;
        Ok(DataFrame { df })
    }

    /// This rank's share of the rows, for data-parallel training: the rows whose
    /// `row_hash(0, every column) % world_size` is `rank`. The shares of ranks `0..world_size`
    /// are disjoint and together hold every row, in every process that runs the same query
    /// over the same data (identical rows share a rank).
    fn sharded(&self, rank: u64, world_size: u64) -> PyResult<DataFrame> {
        use datafusion::prelude::{Expr, lit};
        if world_size == 0 || rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank must be below world_size, got rank {rank} of {world_size}"
            )));
        }
        let row_hash = (self
            .df
            .task_ctx()
            .scalar_functions()
            .get("row_hash")
            .cloned())
        .ok_or_else(|| PyRuntimeError::new_err("the session has no row_hash function"))?;
        let mut args = vec![lit(0u64)];
        args.extend(self.df.schema().columns().into_iter().map(Expr::Column));
        let share = (row_hash.call(args) % lit(world_size)).eq(lit(rank));
        let df = self.df.clone().filter(share).map_err(error)?;
        Ok(DataFrame { df })
    }

    /// The plan, as `EXPLAIN [ANALYZE]` shows it (`analyze` runs the query).
    #[pyo3(signature = (analyze = false))]
    fn explain(&self, py: Python<'_>, analyze: bool) -> PyResult<String> {
        let df = self.df.clone().explain(false, analyze).map_err(error)?;
        let batches = wait(py, df.collect())?.map_err(error)?;
        let mut text = String::new();
        for batch in &batches {
            let kinds = batch.column(0);
            let plans = batch.column(1);
            let kinds = datafusion::arrow::array::AsArray::as_string::<i32>(kinds);
            let plans = datafusion::arrow::array::AsArray::as_string::<i32>(plans);
            for row in 0..batch.num_rows() {
                text.push_str(&format!("{}:\n{}\n", kinds.value(row), plans.value(row)));
            }
        }
        Ok(text)
    }
}

/// A query's batches for a consumer that pulls them through the C stream interface.
struct BlockingReader {
    stream: SendableRecordBatchStream,
}

impl Iterator for BlockingReader {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        runtime()
            .block_on(self.stream.next())
            .map(|batch| batch.map_err(|e| ArrowError::ExternalError(Box::new(e))))
    }
}

impl RecordBatchReader for BlockingReader {
    fn schema(&self) -> SchemaRef {
        self.stream.schema()
    }
}

/// A running query's batches, for Python's iteration: each `__next__` waits for the next
/// batch without the GIL (Ctrl-C checked) and returns it as an [`ExportedBatch`].
#[pyclass(module = "flumen._flumen", frozen)]
struct BatchStream {
    stream: std::sync::Mutex<Option<SendableRecordBatchStream>>,
}

#[pymethods]
impl BatchStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<ExportedBatch>> {
        let Some(mut stream) = self.stream.lock().unwrap().take() else {
            return Ok(None);
        };
        // Interrupted (Ctrl-C): the stream is dropped with the future, cancelling the query.
        let (stream, next) = wait(py, async {
            let next = stream.next().await;
            (stream, next)
        })?;
        match next {
            Some(Ok(batch)) => {
                *self.stream.lock().unwrap() = Some(stream);
                Ok(Some(ExportedBatch { batch }))
            }
            Some(Err(e)) => Err(error(e)),
            None => Ok(None),
        }
    }

    /// The batches' schema, as an `arrow_schema` capsule (`None` once the stream ended).
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let guard = self.stream.lock().unwrap();
        let stream = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the stream has ended"))?;
        schema_capsule(py, &stream.schema())
    }
}

/// One batch of a result, for `pyarrow.record_batch(...)` (`__arrow_c_array__`).
#[pyclass(module = "flumen._flumen", frozen)]
struct ExportedBatch {
    pub(crate) batch: RecordBatch,
}

#[pymethods]
impl ExportedBatch {
    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_array__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let _ = requested_schema;
        batch_capsules(py, &self.batch)
    }

    fn __len__(&self) -> usize {
        self.batch.num_rows()
    }

    /// The addresses of each column's buffers (validity bitmaps aside), as flumen holds
    /// them: what a reader of `__arrow_c_array__` must find again if nothing was copied.
    fn buffer_addresses(&self) -> Vec<Vec<usize>> {
        (self.batch.columns().iter())
            .map(|column| {
                let data = column.to_data();
                let mut addresses: Vec<usize> =
                    data.buffers().iter().map(|b| b.as_ptr() as usize).collect();
                for child in data.child_data() {
                    addresses.extend(child.buffers().iter().map(|b| b.as_ptr() as usize));
                }
                addresses
            })
            .collect()
    }
}

/// `python -m flumen worker ARGS` (`argv`: `["flumen worker", ARGS...]`): serve as a
/// worker process for a flumen driver, running the Python functions it ships as well as
/// flumen's own, until the driver goes away, the lease runs out or a signal (Ctrl-C)
/// arrives. Returns the exit status.
#[pyfunction]
fn worker_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    let command = match flumen::cluster::worker_command::WorkerCommand::parse_args(&argv) {
        Ok(command) => command,
        Err(e) => {
            let _ = e.print();
            return Ok(e.exit_code());
        }
    };
    flumen::cluster::worker_command::init_logging();
    let (done, ended) = std::sync::mpsc::channel();
    let ended = std::sync::Mutex::new(ended);
    // The worker runs on threads of its own; this one (Python's main thread) waits without
    // the GIL, which the worker's Python functions take, and wakes for signals.
    std::thread::spawn(move || {
        let _ = done.send(flumen::cluster::worker_command::run(&command.args));
    });
    loop {
        let step = py.detach(|| {
            let ended = ended.lock().unwrap();
            ended.recv_timeout(Duration::from_millis(200))
        });
        match step {
            Ok(Ok(())) => return Ok(0),
            Ok(Err(e)) => {
                eprintln!("flumen worker: {e}");
                return Ok(1);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(1),
        }
    }
}

/// The module.
#[pymodule]
fn _flumen(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Session>()?;
    m.add_class::<DataFrame>()?;
    m.add_class::<BatchStream>()?;
    m.add_class::<ExportedBatch>()?;
    m.add("FlumenError", m.py().get_type::<FlumenError>())?;
    m.add_function(wrap_pyfunction!(worker_main, m)?)?;
    shipping::register(m.py())
}
