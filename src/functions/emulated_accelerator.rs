//! An emulated accelerator, for measuring the scheduler on machines without a GPU.
//!
//! [`EmulatedDevice`] is one device: a batch occupies it for a fixed service time during
//! which the calling thread sleeps, so the device is busy without using a CPU core, and two
//! callers queue for it as two streams queue for one GPU. [`EmulatedModel`] is an accelerator
//! function over it: `name(text) -> FixedSizeList(Float32, dims)`, a deterministic vector per
//! row (from the text's length and first bytes, so answers can be compared across runs),
//! computed in batches of `batch_rows` rows that each cost one service time. The device counts
//! its busy time, batches and rows, which benchmarks read as the accelerator's utilisation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, ArrayRef, FixedSizeListArray, Float32Array};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{Signature, Volatility};

use crate::functions::accelerator::{AcceleratorFunction, AcceleratorWorker, WorkerResources};

/// One emulated device: busy for `service_time` per batch, one batch at a time.
#[derive(Debug, Default)]
pub struct EmulatedDevice {
    queue: Mutex<()>,
    busy_ns: AtomicU64,
    batches: AtomicU64,
    rows: AtomicU64,
}

impl EmulatedDevice {
    /// Occupy the device for `service_time` (waiting first while another batch holds it).
    pub fn run_batch(&self, service_time: Duration, rows: usize) {
        let _held = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        if !service_time.is_zero() {
            std::thread::sleep(service_time);
        }
        self.busy_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
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
            signature: Signature::string(1, Volatility::Immutable),
            service_time,
            batch_rows: batch_rows.max(1),
            dims: dims.max(1),
            device,
        }
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
            dims: self.dims,
            device: Arc::clone(&self.device),
        }))
    }
    fn batch_rows(&self, _config: &ConfigOptions) -> Option<usize> {
        Some(self.batch_rows)
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

struct EmulatedWorker {
    service_time: Duration,
    dims: usize,
    device: Arc<EmulatedDevice>,
}

impl AcceleratorWorker for EmulatedWorker {
    fn process(&mut self, args: &[ArrayRef], _return_type: &DataType) -> Result<ArrayRef> {
        let text = cast(&args[0], &DataType::Utf8)?;
        let text = text
            .as_any()
            .downcast_ref::<datafusion::arrow::array::StringArray>()
            .ok_or_else(|| DataFusionError::Internal("cast to Utf8 gave another type".into()))?;
        self.device.run_batch(self.service_time, text.len());
        let mut values = Vec::with_capacity(text.len() * self.dims);
        for row in text.iter() {
            let seed = row.map(row_seed).unwrap_or(0);
            values.extend((0..self.dims).map(|j| unit_value(seed, j)));
        }
        let values = Float32Array::from(values);
        let field = Arc::new(Field::new_list_field(DataType::Float32, true));
        let list = FixedSizeListArray::try_new(
            field,
            self.dims as i32,
            Arc::new(values),
            text.nulls().cloned(),
        )?;
        Ok(Arc::new(list))
    }
}

/// A seed from a text's length and first bytes (cheap: the device does the work).
fn row_seed(text: &str) -> u64 {
    let mut seed = text.len() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for &b in text.as_bytes().iter().take(16) {
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
