//! Accelerator UDFs: model-backed scalar functions that the planner puts in an operator of
//! their own, run on the accelerator pool by workers that load their model once.
//!
//! A function becomes an accelerator UDF by implementing [`AcceleratorFunction`] and being
//! wrapped with [`accelerator_udf`]. The function says how to [`load`](AcceleratorFunction::load)
//! its per-worker state (an [`AcceleratorWorker`], e.g. a model on a device), how many rows it
//! wants per call and what resources a worker holds. Each worker thread loads the state once
//! and keeps it for every later block, query and session setting that maps to the same
//! [`load_key`](AcceleratorFunction::load_key) — an actor, as in Ray Data's ActorPoolStrategy.
//! The planner recognises the wrapper type ([`AcceleratorUdf`]) inside a `ProjectionExec` and
//! cuts the projection out as an accelerator operator.

use std::any::Any;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::array::{ArrayRef, new_empty_array};
use datafusion::arrow::compute::concat;
use datafusion::arrow::datatypes::DataType;
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
};
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_plan::PhysicalExpr;

/// What one worker of an accelerator function occupies while it runs a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerResources {
    /// Accelerator devices (GPUs) the worker computes on: 0 when it runs on the CPU.
    pub accelerators: usize,
    /// CPU threads the worker computes with.
    pub cpu_threads: usize,
}

impl Default for WorkerResources {
    fn default() -> Self {
        Self {
            accelerators: 1,
            cpu_threads: 1,
        }
    }
}

/// A model-backed (or otherwise expensive) scalar function that runs on the accelerator pool.
/// (`Any` lets a carrier of shipped functions find its own among them.)
pub trait AcceleratorFunction: Any + Debug + Send + Sync {
    /// SQL name of the function.
    fn name(&self) -> &str;
    /// Accepted argument types.
    fn signature(&self) -> &Signature;
    /// Result type for the given argument types.
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType>;
    /// Load the per-worker state under these session settings (read the model, move it to the
    /// device). Called once per worker thread and [`load_key`](Self::load_key).
    fn load(&self, config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>>;
    /// The settings `load` depends on, as a key: a worker reloads when it changes.
    fn load_key(&self, _config: &ConfigOptions) -> String {
        String::new()
    }
    /// Rows per call of [`AcceleratorWorker::process`]; `None` hands the worker whole blocks
    /// (up to `flumen.target_block_rows`) to batch itself.
    fn batch_rows(&self, _config: &ConfigOptions) -> Option<usize> {
        None
    }
    /// What a worker occupies (shown by `EXPLAIN`).
    fn resources(&self, _config: &ConfigOptions) -> WorkerResources {
        WorkerResources::default()
    }
    /// A CPU step to run before the model (tokenization, decoding, resizing): a plain scalar
    /// function over this function's arguments whose one result this function then gets in
    /// their place, in [`AcceleratorWorker::process`]. With `flumen.preprocess_on_cpu` (by
    /// default when [`resources`](Self::resources) names an accelerator) the planner rewrites
    /// `f(x)` as `f(step(x))` and runs the step in the CPU operator feeding the model, so an
    /// accelerator worker only runs the model. Register
    /// the step with the session too (`ctx.register_udf`): worker processes look functions
    /// up by name. `None` (the default): no step; the worker gets the arguments.
    fn cpu_step(&self) -> Option<Arc<ScalarUDF>> {
        None
    }
    /// For a deterministic function: what identifies its outputs besides its arguments (its
    /// name, a hash of its weight files, every setting that changes its outputs), so that
    /// `flumen.model_cache` may keep them ([`crate::functions::model_cache`]). `None` (the
    /// default): its outputs are never cached.
    fn cache_identity(&self, _config: &ConfigOptions) -> Result<Option<String>> {
        Ok(None)
    }
}

/// The state a worker loaded (a model on a device); processes one batch at a time.
pub trait AcceleratorWorker: Send {
    /// Compute the function over one batch: `args` are arrays of equal length; the result has
    /// that length and type `return_type`.
    fn process(&mut self, args: &[ArrayRef], return_type: &DataType) -> Result<ArrayRef>;
    /// Queue a batch on the device and return without waiting for it, as a GPU stream
    /// queues kernels: the model's operator queues its next piece before it waits for the
    /// current one, so the device runs the next piece while this thread hands the last
    /// one on. Batches queued by one worker finish in the order queued. The default
    /// computes the batch now ([`Self::process`]) and returns it ready.
    fn start(&mut self, args: &[ArrayRef], return_type: &DataType) -> Result<PendingOutput> {
        self.process(args, return_type).map(PendingOutput::ready)
    }
    /// Figures about how the worker runs, by name (e.g. the batch size it chose), shown with
    /// its operator in `EXPLAIN ANALYZE` (workers on this process's accelerator pool).
    fn metrics(&self) -> Vec<(String, u64)> {
        vec![]
    }
}

/// A batch queued on a device by [`AcceleratorWorker::start`]: [`wait`](Self::wait) blocks
/// until the device is done with it and returns the result.
pub struct PendingOutput(Pending);

enum Pending {
    Ready(ArrayRef),
    Queued(Box<dyn FnOnce() -> Result<ArrayRef> + Send>),
}

impl PendingOutput {
    /// A result already computed.
    pub fn ready(output: ArrayRef) -> Self {
        Self(Pending::Ready(output))
    }

    /// A result that `finish` waits for (blocking its thread) and returns.
    pub fn new(finish: impl FnOnce() -> Result<ArrayRef> + Send + 'static) -> Self {
        Self(Pending::Queued(Box::new(finish)))
    }

    /// Whether the result was computed when queued ([`Self::ready`]).
    pub fn is_ready(&self) -> bool {
        matches!(self.0, Pending::Ready(_))
    }

    /// Wait for the device and take the result.
    pub fn wait(self) -> Result<ArrayRef> {
        match self.0 {
            Pending::Ready(output) => Ok(output),
            Pending::Queued(finish) => finish(),
        }
    }
}

impl Debug for PendingOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingOutput")
            .field("ready", &self.is_ready())
            .finish()
    }
}

/// One call of an accelerator UDF over a batch of rows, queued on this thread's worker
/// ([`AcceleratorUdf::start`]): its parts (one per `batch_rows` rows), in order.
#[derive(Debug)]
pub struct PendingCall {
    function: String,
    parts: Vec<(usize, PendingOutput)>,
}

impl PendingCall {
    /// Whether every part was computed when queued (the worker does not queue).
    pub fn is_ready(&self) -> bool {
        self.parts.iter().all(|(_, part)| part.is_ready())
    }

    /// Wait for every part and return the call's result, one row per input row.
    pub fn wait(self) -> Result<ArrayRef> {
        let mut outputs = Vec::with_capacity(self.parts.len());
        for (len, part) in self.parts {
            let out = part.wait()?;
            if out.len() != len {
                return Err(DataFusionError::Execution(format!(
                    "{} returned {} rows for a batch of {len}",
                    self.function,
                    out.len()
                )));
            }
            outputs.push(out);
        }
        match outputs.len() {
            1 => Ok(outputs.pop().expect("one part")),
            _ => Ok(concat(
                &outputs.iter().map(|p| p.as_ref()).collect::<Vec<_>>(),
            )?),
        }
    }
}

thread_local! {
    /// Workers loaded on this thread, by (function id, load key).
    static LOADED: RefCell<HashMap<(u64, String), Box<dyn AcceleratorWorker>>> =
        RefCell::new(HashMap::new());
}

/// Drop every worker (model) loaded on this thread, now: an accelerator worker thread does
/// it before it exits, so a device's context and memory are released while the process
/// still runs, not by thread-local destructors racing the CUDA libraries' exit handlers.
pub fn unload_workers() {
    let loaded = LOADED.with(|loaded| std::mem::take(&mut *loaded.borrow_mut()));
    drop(loaded);
}

static NEXT_FUNCTION_ID: AtomicU64 = AtomicU64::new(0);

/// Accelerator workers (models) this process has loaded.
static WORKERS_LOADED: AtomicU64 = AtomicU64::new(0);

/// How many accelerator workers (models) this process has loaded so far: a worker process
/// reports it, so tests can see a model is loaded once and kept.
pub fn workers_loaded() -> u64 {
    WORKERS_LOADED.load(Ordering::Relaxed)
}

thread_local! {
    /// The (function id, load key) of the workers this thread ran since
    /// [`used_worker_metrics`] last read them.
    static USED: RefCell<HashSet<(u64, String)>> = RefCell::new(HashSet::new());
}

/// The [`metrics`](AcceleratorWorker::metrics) of the workers this thread ran since the last
/// call (an accelerator worker thread reads them after each task): only those, so a worker
/// loaded under other settings by an earlier query does not speak for this one.
pub fn used_worker_metrics() -> Vec<(String, u64)> {
    let used = USED.with(|used| std::mem::take(&mut *used.borrow_mut()));
    let metrics: Vec<(String, u64)> = LOADED.with(|loaded| {
        let loaded = loaded.borrow();
        used.iter()
            .filter_map(|key| loaded.get(key))
            .flat_map(|worker| worker.metrics())
            .collect()
    });
    metrics
}

/// The `ScalarUDFImpl` wrapper that marks a function as an accelerator UDF.
#[derive(Debug)]
pub struct AcceleratorUdf {
    func: Arc<dyn AcceleratorFunction>,
    id: u64,
    /// Workers (models) this function has loaded in this process, on all threads.
    loads: Arc<AtomicU64>,
}

impl AcceleratorUdf {
    /// The wrapped function.
    pub fn function(&self) -> &Arc<dyn AcceleratorFunction> {
        &self.func
    }

    /// How many workers (models) this function has loaded in this process so far, on all
    /// threads: unlike [`workers_loaded`], other sessions' functions do not count.
    pub fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// Queue the function over `rows` rows of `arrays` on this thread's worker (loading it
    /// first if needed), in batches of the function's `batch_rows`, without waiting for
    /// the device: [`PendingCall::wait`] takes the result.
    pub fn start(
        &self,
        arrays: &[ArrayRef],
        rows: usize,
        return_type: &DataType,
        config: &ConfigOptions,
    ) -> Result<PendingCall> {
        if rows == 0 {
            // Nothing to compute (every row of a block came from the model-output cache):
            // no model is loaded for it.
            return Ok(PendingCall {
                function: self.func.name().to_string(),
                parts: vec![(0, PendingOutput::ready(new_empty_array(return_type)))],
            });
        }
        let batch = self.func.batch_rows(config).unwrap_or(rows).max(1);
        self.with_worker(config, |worker, key| {
            USED.with(|used| used.borrow_mut().insert(key.clone()));
            let mut parts = Vec::with_capacity(rows.div_ceil(batch));
            for start in (0..rows).step_by(batch) {
                let len = batch.min(rows - start);
                let slice: Vec<ArrayRef> = arrays.iter().map(|a| a.slice(start, len)).collect();
                parts.push((len, worker.start(&slice, return_type)?));
            }
            Ok(PendingCall {
                function: self.func.name().to_string(),
                parts,
            })
        })
    }

    /// Run `f` on this thread's worker for `config` (and its key), loading it first if this
    /// thread has none under the same load key.
    fn with_worker<R>(
        &self,
        config: &ConfigOptions,
        f: impl FnOnce(&mut dyn AcceleratorWorker, &(u64, String)) -> Result<R>,
    ) -> Result<R> {
        let key = (self.id, self.func.load_key(config));
        LOADED.with(|loaded| {
            let mut loaded = loaded.borrow_mut();
            if !loaded.contains_key(&key) {
                let worker = self.func.load(config)?;
                WORKERS_LOADED.fetch_add(1, Ordering::Relaxed);
                self.loads.fetch_add(1, Ordering::Relaxed);
                loaded.insert(key.clone(), worker);
            }
            let worker = loaded.get_mut(&key).expect("worker just loaded");
            f(worker.as_mut(), &key)
        })
    }
}

/// Load `udf`'s worker on this thread under `config` now, unless it is loaded already, so
/// the thread's first batch does not wait for it. Does nothing for other UDFs.
pub fn preload(udf: &ScalarUDF, config: &ConfigOptions) -> Result<()> {
    match as_accelerator_udf(udf) {
        Some(accelerator) => accelerator.with_worker(config, |_, _| Ok(())),
        None => Ok(()),
    }
}

impl PartialEq for AcceleratorUdf {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for AcceleratorUdf {}
impl Hash for AcceleratorUdf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl ScalarUDFImpl for AcceleratorUdf {
    fn name(&self) -> &str {
        self.func.name()
    }
    fn signature(&self) -> &Signature {
        self.func.signature()
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.func.return_type(arg_types)
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let call = self.start(
            &arrays,
            args.number_rows,
            args.return_field.data_type(),
            &args.config_options,
        )?;
        Ok(ColumnarValue::Array(call.wait()?))
    }
}

/// Wrap an accelerator function as a `ScalarUDF` to register with `ctx.register_udf`.
pub fn accelerator_udf(func: impl AcceleratorFunction) -> ScalarUDF {
    ScalarUDF::new_from_impl(AcceleratorUdf {
        func: Arc::new(func),
        id: NEXT_FUNCTION_ID.fetch_add(1, Ordering::Relaxed),
        loads: Arc::new(AtomicU64::new(0)),
    })
}

/// The accelerator UDF wrapper behind `udf`, if it is one (to [`AcceleratorUdf::start`] it).
pub fn as_accelerator_udf(udf: &ScalarUDF) -> Option<&AcceleratorUdf> {
    (udf.inner().as_ref() as &dyn Any).downcast_ref::<AcceleratorUdf>()
}

/// The accelerator function behind `udf`, if it is one.
pub fn accelerator_function(udf: &ScalarUDF) -> Option<&Arc<dyn AcceleratorFunction>> {
    as_accelerator_udf(udf).map(|u| u.function())
}

/// True when `udf` is an accelerator UDF.
pub fn is_accelerator_udf(udf: &ScalarUDF) -> bool {
    accelerator_function(udf).is_some()
}

/// The accelerator functions a physical expression calls, outermost first.
pub fn accelerator_functions_in(expr: &Arc<dyn PhysicalExpr>) -> Vec<Arc<dyn AcceleratorFunction>> {
    accelerator_udfs_in(expr)
        .iter()
        .filter_map(|udf| accelerator_function(udf).cloned())
        .collect()
}

/// The accelerator UDFs a physical expression calls, outermost first.
pub fn accelerator_udfs_in(expr: &Arc<dyn PhysicalExpr>) -> Vec<ScalarUDF> {
    let mut found = vec![];
    if let Some(call) = (expr.as_ref() as &dyn Any).downcast_ref::<ScalarFunctionExpr>()
        && is_accelerator_udf(call.fun())
    {
        found.push(call.fun().clone());
    }
    for child in expr.children() {
        found.extend(accelerator_udfs_in(child));
    }
    found
}

/// The accelerator function `expr` itself calls (not one inside its arguments), if any.
pub fn called_accelerator_function(
    expr: &Arc<dyn PhysicalExpr>,
) -> Option<&Arc<dyn AcceleratorFunction>> {
    called_accelerator_udf(expr).map(|(_, udf)| udf.function())
}

/// `expr` as a call of an accelerator UDF (not one inside its arguments): the call and the
/// UDF's wrapper.
pub fn called_accelerator_udf(
    expr: &Arc<dyn PhysicalExpr>,
) -> Option<(&ScalarFunctionExpr, &AcceleratorUdf)> {
    let call = (expr.as_ref() as &dyn Any).downcast_ref::<ScalarFunctionExpr>()?;
    Some((call, as_accelerator_udf(call.fun())?))
}

/// True when the physical expression calls an accelerator UDF anywhere inside it.
pub fn calls_accelerator_udf(expr: &Arc<dyn PhysicalExpr>) -> bool {
    !accelerator_functions_in(expr).is_empty()
}
