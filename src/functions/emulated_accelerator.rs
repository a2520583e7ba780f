//! An emulated accelerator, for measuring the scheduler on machines without a GPU.
//!
//! [`EmulatedDevice`] is one device with a queue, as a GPU has a stream: batches queued on it
//! run back to back, each for its service time, from when the device is free (or when
//! queued, if later), however late the threads that queued them wake. A caller queues
//! batches, makes their outputs on its own thread meanwhile, and sleeps (with no timer
//! slack, so that the sleep ends on time) until the last one ends, so the device is busy
//! without using a CPU core, and two callers share it as two streams share one GPU.
//! [`EmulatedModel`] is an accelerator function over it: `name(x) -> FixedSizeList(Float32,
//! dims)` over text or vectors of floats, a deterministic vector per row (from the input's
//! length and first bytes, so answers can be compared across runs), computed in batches of
//! `batch_rows` rows that each cost one service time plus, optionally, a time per KiB of
//! input (a model whose cost grows with document length). Its worker takes a whole piece per
//! call and queues the piece's batches on the device at once; with
//! [`AcceleratorWorker::start`] it returns before they end, so the model's operator can
//! queue the next piece while the device runs this one. The device counts its busy time,
//! batches and rows, and keeps when each batch ran, which benchmarks read as the
//! accelerator's utilisation and its idle gaps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, ArrayRef, AsArray, FixedSizeListArray, Float32Array};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Float32Type};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{Signature, Volatility};

use crate::functions::accelerator::{
    AcceleratorFunction, AcceleratorWorker, PendingOutput, WorkerResources,
};

/// One emulated device: busy for `service_time` per batch, one batch at a time.
#[derive(Debug)]
pub struct EmulatedDevice {
    /// The device's queue.
    queue: Mutex<DeviceQueue>,
    created: Instant,
    busy_ns: AtomicU64,
    batches: AtomicU64,
    rows: AtomicU64,
}

/// What is queued on an [`EmulatedDevice`].
#[derive(Debug)]
struct DeviceQueue {
    /// When the last batch queued so far ends: the next one starts then, or when queued if
    /// later.
    free_at: Instant,
    /// When each batch ran (or will run), as (start, end) since the device was made.
    ran: Vec<(Duration, Duration)>,
}

impl Default for EmulatedDevice {
    fn default() -> Self {
        let created = Instant::now();
        Self {
            queue: Mutex::new(DeviceQueue {
                free_at: created,
                ran: vec![],
            }),
            created,
            busy_ns: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            rows: AtomicU64::new(0),
        }
    }
}

impl EmulatedDevice {
    /// Queue batches, each `(service time, rows)`, behind whatever is queued already, as
    /// a stream queues kernels: they run back to back from when the device is free (or
    /// now), however late the threads that queued them wake. Returns when the last ends.
    pub fn queue_batches(&self, batches: &[(Duration, usize)]) -> Instant {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let mut at = queue.free_at.max(Instant::now());
        for (service, _) in batches {
            queue
                .ran
                .push((at - self.created, at + *service - self.created));
            at += *service;
        }
        queue.free_at = at;
        let total: Duration = batches.iter().map(|(service, _)| *service).sum();
        self.busy_ns
            .fetch_add(total.as_nanos() as u64, Ordering::Relaxed);
        self.batches
            .fetch_add(batches.len() as u64, Ordering::Relaxed);
        let rows: usize = batches.iter().map(|(_, rows)| rows).sum();
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        at
    }

    /// Queue batches ([`Self::queue_batches`]) and wait for them: `output` makes their
    /// outputs meanwhile, as a device computes what it returns during its service time.
    pub fn run_batches<R>(&self, batches: &[(Duration, usize)], output: impl FnOnce() -> R) -> R {
        let ends = self.queue_batches(batches);
        let result = output();
        wait_until(ends);
        result
    }

    /// When each batch so far occupied the device, as (start, end) since the device was made,
    /// in the order they ran.
    pub fn busy_intervals(&self) -> Vec<(Duration, Duration)> {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ran
            .clone()
    }

    /// When the device was made (what [`Self::busy_intervals`] count from).
    pub fn created(&self) -> Instant {
        self.created
    }

    /// Nanoseconds the device has been busy.
    pub fn busy_ns(&self) -> u64 {
        self.busy_ns.load(Ordering::Relaxed)
    }

    /// Batches run.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Rows processed.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }
}

/// A model on an [`EmulatedDevice`] (see the module docs).
#[derive(Debug)]
pub struct EmulatedModel {
    name: String,
    signature: Signature,
    /// Time one batch occupies the device.
    pub service_time: Duration,
    /// Further time a batch occupies the device per KiB of its input (text bytes, or the
    /// vectors' floats).
    pub service_per_kib: Duration,
    /// Rows per batch.
    pub batch_rows: usize,
    /// Length of each output vector.
    pub dims: usize,
    /// The device it runs on.
    pub device: Arc<EmulatedDevice>,
}

impl EmulatedModel {
    /// A model called `name` on `device`.
    pub fn new(
        name: &str,
        service_time: Duration,
        batch_rows: usize,
        dims: usize,
        device: Arc<EmulatedDevice>,
    ) -> Self {
        Self {
            name: name.to_string(),
            signature: Signature::any(1, Volatility::Immutable),
            service_time,
            service_per_kib: Duration::ZERO,
            batch_rows: batch_rows.max(1),
            dims: dims.max(1),
            device,
        }
    }

    /// The same model, with each batch costing `per_kib` more per KiB of input.
    pub fn with_service_per_kib(mut self, per_kib: Duration) -> Self {
        self.service_per_kib = per_kib;
        self
    }
}

impl EmulatedModel {
    /// A model on its own device from `NAME:SERVICE_MS:BATCH_ROWS:DIMS` (how `flumen worker
    /// --emulated-model` and benchmarks name one), e.g. `m:40:1024:8`.
    pub fn from_spec(spec: &str) -> Result<Self> {
        let bad = || {
            datafusion::error::DataFusionError::Configuration(format!(
                "an emulated model is NAME:SERVICE_MS:BATCH_ROWS:DIMS (e.g. m:40:1024:8), got \
                 '{spec}'"
            ))
        };
        let parts: Vec<&str> = spec.split(':').collect();
        let [name, ms, rows, dims] = parts[..] else {
            return Err(bad());
        };
        let number = |text: &str| text.trim().parse::<u64>().map_err(|_| bad());
        if name.trim().is_empty() {
            return Err(bad());
        }
        Ok(Self::new(
            name.trim(),
            Duration::from_millis(number(ms)?),
            number(rows)? as usize,
            number(dims)? as usize,
            Arc::new(EmulatedDevice::default()),
        ))
    }
}

impl AcceleratorFunction for EmulatedModel {
    fn name(&self) -> &str {
        &self.name
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(vector_type(self.dims))
    }
    fn load(&self, _config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        Ok(Box::new(EmulatedWorker {
            service_time: self.service_time,
            service_per_kib: self.service_per_kib,
            batch_rows: self.batch_rows,
            dims: self.dims,
            device: Arc::clone(&self.device),
        }))
    }
    fn resources(&self, _config: &ConfigOptions) -> WorkerResources {
        WorkerResources {
            accelerators: 1,
            cpu_threads: 0,
        }
    }
}

fn vector_type(dims: usize) -> DataType {
    DataType::FixedSizeList(
        Arc::new(Field::new_list_field(DataType::Float32, true)),
        dims as i32,
    )
}

/// A worker of an [`EmulatedModel`]: takes whole pieces and cuts them into device batches
/// itself, as the embedding model does, so a piece's batches are queued on the device at
/// once and its output is one array (no concatenation after the last batch).
struct EmulatedWorker {
    service_time: Duration,
    service_per_kib: Duration,
    batch_rows: usize,
    dims: usize,
    device: Arc<EmulatedDevice>,
}

impl AcceleratorWorker for EmulatedWorker {
    fn process(&mut self, args: &[ArrayRef], return_type: &DataType) -> Result<ArrayRef> {
        self.start(args, return_type)?.wait()
    }

    fn start(&mut self, args: &[ArrayRef], _return_type: &DataType) -> Result<PendingOutput> {
        let (seeds, row_bytes) = row_seeds(&args[0])?;
        let batches: Vec<(Duration, usize)> = row_bytes
            .chunks(self.batch_rows)
            .map(|chunk| {
                let kib = chunk.iter().sum::<usize>() as f64 / 1024.0;
                (
                    self.service_time + self.service_per_kib.mul_f64(kib),
                    chunk.len(),
                )
            })
            .collect();
        let ends = self.device.queue_batches(&batches);
        let mut values = Vec::with_capacity(seeds.len() * self.dims);
        for seed in &seeds {
            let seed = seed.unwrap_or(0);
            values.extend((0..self.dims).map(|j| unit_value(seed, j)));
        }
        let field = Arc::new(Field::new_list_field(DataType::Float32, true));
        let list: ArrayRef = Arc::new(FixedSizeListArray::try_new(
            field,
            self.dims as i32,
            Arc::new(Float32Array::from(values)),
            args[0].logical_nulls(),
        )?);
        Ok(PendingOutput::new(move || {
            wait_until(ends);
            Ok(list)
        }))
    }
}

/// Sleep this thread until `at` (with no timer slack).
fn wait_until(at: Instant) {
    let now = Instant::now();
    if now < at {
        precise_sleeps();
        std::thread::sleep(at - now);
    }
}

/// Make this thread's sleeps end when asked: Linux lets a sleep run late by the thread's
/// timer slack (50 µs by default, and more on a loaded machine), which would add to every
/// batch's service time. Once per thread.
fn precise_sleeps() {
    #[cfg(target_os = "linux")]
    {
        thread_local!(static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        if !SET.get() {
            // SAFETY: PR_SET_TIMERSLACK takes an integer and changes only this thread's slack.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
            SET.set(true);
        }
    }
}

/// Each row's seed (`None` for a null row) and size in bytes: text, or vectors (fixed-size
/// or variable lists) of floats.
fn row_seeds(input: &ArrayRef) -> Result<(Vec<Option<u64>>, Vec<usize>)> {
    match input.data_type() {
        DataType::FixedSizeList(..) | DataType::List(_) | DataType::LargeList(_) => {
            let mut seeds = Vec::with_capacity(input.len());
            let mut bytes = Vec::with_capacity(input.len());
            for row in 0..input.len() {
                if input.is_null(row) {
                    seeds.push(None);
                    bytes.push(0);
                    continue;
                }
                let vector = cast(&list_value(input, row)?, &DataType::Float32)?;
                let floats = vector.as_primitive::<Float32Type>().values();
                bytes.push(floats.len() * 4);
                let first: Vec<u8> = floats
                    .iter()
                    .take(4)
                    .flat_map(|f| f.to_le_bytes())
                    .collect();
                seeds.push(Some(bytes_seed(floats.len(), &first)));
            }
            Ok((seeds, bytes))
        }
        _ => {
            let text = cast(input, &DataType::Utf8).map_err(|e| {
                DataFusionError::Plan(format!(
                    "an emulated model takes text or vectors of floats, not {}: {e}",
                    input.data_type()
                ))
            })?;
            let text = text.as_string::<i32>();
            // The rows' own bytes (a slice shares its whole batch's value buffer).
            let bytes = text
                .value_offsets()
                .windows(2)
                .map(|w| (w[1] - w[0]) as usize)
                .collect();
            Ok((text.iter().map(|row| row.map(row_seed)).collect(), bytes))
        }
    }
}

/// Row `row` of a list array of any list type.
fn list_value(list: &ArrayRef, row: usize) -> Result<ArrayRef> {
    Ok(match list.data_type() {
        DataType::FixedSizeList(..) => list.as_fixed_size_list().value(row),
        DataType::List(_) => list.as_list::<i32>().value(row),
        _ => list.as_list::<i64>().value(row),
    })
}

/// A seed from a text's length and first bytes (cheap: the device does the work).
fn row_seed(text: &str) -> u64 {
    bytes_seed(text.len(), text.as_bytes())
}

/// A seed from an input's length and (up to 16 of) its first bytes.
fn bytes_seed(len: usize, first: &[u8]) -> u64 {
    let mut seed = len as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for &b in first.iter().take(16) {
        seed = (seed ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    seed
}

/// The `j`-th value of a row's vector, in [-1, 1).
fn unit_value(seed: u64, j: usize) -> f32 {
    let x =
        (seed ^ (j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::StringArray;

    #[test]
    fn batches_occupy_the_device_one_at_a_time() {
        let device = Arc::new(EmulatedDevice::default());
        let model = EmulatedModel::new("m", Duration::from_millis(20), 4, 3, Arc::clone(&device));
        let started = Instant::now();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let mut worker = model.load(&ConfigOptions::new()).unwrap();
                std::thread::spawn(move || {
                    let input: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None]));
                    worker.process(&[input], &vector_type(3)).unwrap()
                })
            })
            .collect();
        let outputs: Vec<ArrayRef> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        // Two batches on one device take two service times, not one.
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(device.batches(), 2);
        assert_eq!(device.rows(), 4);
        assert!(device.busy_ns() >= 40_000_000);
        assert_eq!(outputs[0].len(), 2);
        assert!(outputs[0].is_null(1) && !outputs[0].is_null(0));
        assert_eq!(outputs[0].to_data(), outputs[1].to_data(), "deterministic");
    }

    #[test]
    fn a_batch_output_is_made_while_the_device_is_busy() {
        let device = EmulatedDevice::default();
        let service = Duration::from_millis(200);
        let made_at = device.run_batches(&[(service, 1)], || device.created.elapsed());
        let (start, end) = device.busy_intervals()[0];
        // Made at the batch's start, not after the service time.
        assert!(
            start <= made_at && made_at < start + service,
            "{made_at:?} not early in {start:?}..{end:?}"
        );
        assert!(end - start >= service);
    }

    #[test]
    fn queued_batches_run_back_to_back_however_late_their_thread_waits() {
        let device = Arc::new(EmulatedDevice::default());
        let service = Duration::from_millis(20);
        let model = EmulatedModel::new("m", service, 4, 3, Arc::clone(&device));
        let mut worker = model.load(&ConfigOptions::new()).unwrap();
        let input: ArrayRef = Arc::new(StringArray::from(vec!["a", "b"]));
        let started = Instant::now();
        let first = worker
            .start(&[Arc::clone(&input)], &vector_type(3))
            .unwrap();
        let second = worker.start(&[input], &vector_type(3)).unwrap();
        // Queuing does not wait for the device.
        assert!(started.elapsed() < service, "{:?}", started.elapsed());
        // The thread comes back long after the first batch ended: the second ran anyway.
        std::thread::sleep(Duration::from_millis(60));
        let (first, second) = (first.wait().unwrap(), second.wait().unwrap());
        assert_eq!(first.to_data(), second.to_data());
        let ran = device.busy_intervals();
        assert_eq!(ran.len(), 2);
        assert_eq!(ran[0].1, ran[1].0, "the second starts when the first ends");
        assert_eq!(ran[1].1 - ran[0].0, 2 * service);
        assert_eq!(device.busy_ns(), 2 * service.as_nanos() as u64);
        // Waiting for a result waits for its batch: a third, queued now, ends a service
        // time after it was queued.
        let queued = Instant::now();
        worker
            .process(
                &[Arc::new(StringArray::from(vec!["c"])) as ArrayRef],
                &vector_type(3),
            )
            .unwrap();
        assert!(queued.elapsed() >= service);
    }

    #[test]
    fn a_piece_is_cut_into_batches_queued_back_to_back() {
        let device = Arc::new(EmulatedDevice::default());
        let service = Duration::from_millis(10);
        let model = EmulatedModel::new("m", service, 4, 3, Arc::clone(&device));
        let mut worker = model.load(&ConfigOptions::new()).unwrap();
        let texts: Vec<Option<String>> = (0..10).map(|i| Some(format!("row {i}"))).collect();
        let input: ArrayRef = Arc::new(StringArray::from(texts));
        let out = worker
            .process(&[Arc::clone(&input)], &vector_type(3))
            .unwrap();
        // Batches of 4, 4 and 2 rows, each one service time, with no gap between them.
        assert_eq!((device.batches(), device.rows()), (3, 10));
        let intervals = device.busy_intervals();
        assert_eq!(intervals.len(), 3);
        for (start, end) in &intervals {
            assert!(*end - *start >= service, "{intervals:?}");
        }
        for pair in intervals.windows(2) {
            assert_eq!(pair[1].0, pair[0].1, "{intervals:?}");
        }
        // The same vectors as one row at a time: a row's vector does not depend on its batch.
        let one_by_one: Vec<ArrayRef> = (0..10)
            .map(|row| {
                worker
                    .process(&[input.slice(row, 1)], &vector_type(3))
                    .unwrap()
            })
            .collect();
        let one_by_one: Vec<&dyn Array> = one_by_one.iter().map(|a| a.as_ref()).collect();
        let expected = datafusion::arrow::compute::concat(&one_by_one).unwrap();
        assert_eq!(out.to_data(), expected.to_data());
        // An empty piece occupies the device not at all.
        worker
            .process(&[input.slice(0, 0)], &vector_type(3))
            .unwrap();
        assert_eq!(device.batches(), 13);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_batch_sleeps_with_no_timer_slack() {
        let slack = std::thread::spawn(|| {
            EmulatedDevice::default().run_batches(&[(Duration::from_millis(1), 1)], || ());
            // SAFETY: PR_GET_TIMERSLACK reads this thread's slack; it takes no pointers.
            unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) }
        })
        .join()
        .unwrap();
        assert_eq!(slack, 1);
    }

    /// A worker of a model that costs 10 ms per KiB of input (nothing per batch), and its
    /// device.
    fn per_kib_worker(batch_rows: usize) -> (Arc<EmulatedDevice>, Box<dyn AcceleratorWorker>) {
        let device = Arc::new(EmulatedDevice::default());
        let model = EmulatedModel::new("m", Duration::ZERO, batch_rows, 4, Arc::clone(&device))
            .with_service_per_kib(Duration::from_millis(10));
        (device, model.load(&ConfigOptions::new()).unwrap())
    }

    #[test]
    fn a_model_over_vectors_pays_for_its_input_size_and_the_device_keeps_its_batches() {
        let (device, mut worker) = per_kib_worker(8);
        // Two vectors of 256 floats: 2 KiB of input, 20 ms on the device.
        let vectors = FixedSizeListArray::try_new(
            Arc::new(Field::new_list_field(DataType::Float32, true)),
            256,
            Arc::new(Float32Array::from_iter_values((0..512).map(|i| i as f32))),
            None,
        )
        .unwrap();
        let input: ArrayRef = Arc::new(vectors);
        let out = worker
            .process(&[Arc::clone(&input)], &vector_type(4))
            .unwrap();
        assert_eq!(out.len(), 2);
        let again = worker.process(&[input], &vector_type(4)).unwrap();
        assert_eq!(out.to_data(), again.to_data(), "deterministic");
        let intervals = device.busy_intervals();
        assert_eq!(intervals.len(), 2);
        for (start, end) in &intervals {
            assert!(*end - *start >= Duration::from_millis(20), "{intervals:?}");
        }
        assert!(intervals[1].0 >= intervals[0].1, "one batch at a time");
        let e = worker
            .process(
                &[Arc::new(
                    datafusion::arrow::array::StructArray::new_empty_fields(1, None),
                )],
                &vector_type(4),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("text or vectors of floats"), "{e}");
    }

    #[test]
    fn a_slice_of_text_pays_for_its_own_bytes() {
        let (device, mut worker) = per_kib_worker(2);
        // 64 texts of 512 bytes; a slice of two is 1 KiB (10 ms), not the batch's 32 KiB.
        let texts: ArrayRef = Arc::new(StringArray::from(vec!["x".repeat(512); 64]));
        worker
            .process(&[texts.slice(10, 2)], &vector_type(4))
            .unwrap();
        let (start, end) = device.busy_intervals()[0];
        assert!(end - start >= Duration::from_millis(10));
        assert!(
            end - start < Duration::from_millis(100),
            "{:?}",
            end - start
        );
    }

    #[test]
    fn an_emulated_model_spec_parses_and_a_bad_one_says_its_form() {
        let model = EmulatedModel::from_spec("m:40:1024:8").unwrap();
        assert_eq!(model.name(), "m");
        assert_eq!(model.service_time, Duration::from_millis(40));
        assert_eq!((model.batch_rows, model.dims), (1024, 8));
        for bad in ["m:40:1024", ":40:1024:8", "m:x:1024:8", "m:40:1024:8:9"] {
            let e = EmulatedModel::from_spec(bad).unwrap_err().to_string();
            assert!(e.contains("NAME:SERVICE_MS:BATCH_ROWS:DIMS"), "{bad}: {e}");
        }
    }
}
