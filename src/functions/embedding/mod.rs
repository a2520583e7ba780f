//! `embed(text)`: sentence embeddings from all-MiniLM-L6-v2 (sentence-transformers), computed
//! by flumen's own BERT forward on the CPU or on CUDA, as an accelerator UDF.
//!
//! Each accelerator worker loads the weights once (see [`crate::functions::accelerator`]) and
//! keeps them for the session. Texts are tokenized by `embed`'s CPU step, `embed_tokens`
//! ([`tokenize_step`]), in the CPU tasks feeding the model (or by the worker itself with
//! `flumen.preprocess_on_cpu = false`); a block's token sequences are ordered by length and
//! run in forward passes packed back to back (no padding), each of at most a token budget
//! that the worker tunes from measured throughput ([`batch_tuner`]; or fixed with
//! `flumen.embed_batch_tokens`, or `flumen.embed_batch_size` sentences a pass); results come
//! back in the block's row order. On a GPU the passes of a piece, and of the piece the
//! model's operator queues next, are kept queued on the device ([`pass_queue`]).

pub mod batch_tuner;
pub mod bert;
pub mod cpu;
pub mod cuda;
pub mod cuda_compile;
pub mod cuda_driver;
pub mod cuda_passes;
pub mod model_files;
pub mod pass_queue;
pub mod tokenize_step;
pub mod tokenizer;

/// The integration tests' skip rules (a missing tool fails under CI), shared with the
/// CUDA files' unit tests.
#[cfg(test)]
#[path = "../../../tests/common/skip.rs"]
mod test_skip;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Once};
use std::time::Instant;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, FixedSizeListArray, Float32Array};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::datatypes::UInt32Type;
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{ScalarUDF, Signature, Volatility};

use crate::config::{Device, EmbedPrecision, FlumenConfig};
use crate::functions::accelerator::{
    AcceleratorFunction, AcceleratorWorker, PendingOutput, WorkerResources,
};
use crate::functions::accelerator_devices;
use batch_tuner::BatchTuner;
use bert::{BertWeights, SentenceEncoder};
use pass_queue::{PassQueue, PieceTokens};
use tokenizer::SentenceTokenizer;

/// Width of all-MiniLM-L6-v2's embeddings.
pub const EMBEDDING_DIM: i32 = 384;

/// The type `embed` returns: `FixedSizeList(Float32, 384)`.
pub fn embedding_type() -> DataType {
    DataType::FixedSizeList(
        Arc::new(Field::new_list_field(DataType::Float32, true)),
        EMBEDDING_DIM,
    )
}

/// The `embed(text)` function.
#[derive(Debug)]
pub struct EmbedFunction {
    signature: Signature,
}

impl Default for EmbedFunction {
    fn default() -> Self {
        Self {
            // Text only: numbers are not silently cast to strings.
            signature: Signature::string(1, Volatility::Immutable),
        }
    }
}

/// The settings an embed worker is loaded under.
#[derive(Debug, Clone, PartialEq)]
struct EmbedSettings {
    model_dir: PathBuf,
    device: Device,
    threads: usize,
    batch_size: usize,
    batch_tokens: usize,
    precision: EmbedPrecision,
    /// Most passes started and unfinished (`flumen.embed_passes_in_flight`, 1 or 2).
    passes_in_flight: usize,
}

impl EmbedSettings {
    fn from(config: &ConfigOptions) -> Self {
        let flumen = config
            .extensions
            .get::<FlumenConfig>()
            .cloned()
            .unwrap_or_default();
        Self {
            model_dir: model_files::model_dir(&flumen.model_dir),
            device: flumen.device,
            // The CPU backend shares the machine's CPU slots among the accelerator workers.
            threads: (flumen.cpu_slots / accelerator_devices::accelerator_workers(&flumen)).max(1),
            batch_size: flumen.embed_batch_size,
            batch_tokens: flumen.embed_batch_tokens,
            precision: flumen.embed_precision,
            passes_in_flight: flumen.embed_passes_in_flight,
        }
    }
}

impl AcceleratorFunction for EmbedFunction {
    fn name(&self) -> &str {
        "embed"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(embedding_type())
    }

    fn load(&self, config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        let settings = EmbedSettings::from(config);
        Ok(Box::new(EmbedWorker::load(&settings)?))
    }

    fn load_key(&self, config: &ConfigOptions) -> String {
        format!("{:?}", EmbedSettings::from(config))
    }

    fn cpu_step(&self) -> Option<Arc<ScalarUDF>> {
        Some(tokenize_step::embed_tokens_udf())
    }

    /// The model's files, where it computes (a GPU's and the CPU's kernels round
    /// differently) and in what precision; not the batching or thread count, which change
    /// no output.
    fn cache_identity(&self, config: &ConfigOptions) -> Result<Option<String>> {
        let settings = EmbedSettings::from(config);
        let on = match (self.resources(config).accelerators, settings.precision) {
            (0, EmbedPrecision::Bf16) => "cpu bf16",
            (0, _) => "cpu",
            (_, EmbedPrecision::Fp32) => "cuda",
            (_, requested) => {
                let head_dim = bert::BertConfig::load(&settings.model_dir)?.head_dim();
                match cuda::device_precision(requested, head_dim)? {
                    EmbedPrecision::Bf16 => "cuda bf16",
                    _ => "cuda",
                }
            }
        };
        Ok(Some(format!(
            "embed {} files {} on {on}",
            model_files::MODEL_NAME,
            model_files::files_hash(&settings.model_dir)?
        )))
    }

    fn resources(&self, config: &ConfigOptions) -> WorkerResources {
        let settings = EmbedSettings::from(config);
        match settings.device {
            Device::Cpu => WorkerResources {
                accelerators: 0,
                cpu_threads: settings.threads,
            },
            Device::Cuda => WorkerResources {
                accelerators: 1,
                cpu_threads: 1,
            },
            Device::Auto if cuda_driver::cuda_available() => WorkerResources {
                accelerators: 1,
                cpu_threads: 1,
            },
            Device::Auto => WorkerResources {
                accelerators: 0,
                cpu_threads: settings.threads,
            },
        }
    }
}

/// The CPU encoder for `settings`: fp32, or bf16's numerics emulated where
/// `flumen.embed_precision = 'bf16'` (`auto` is fp32 on the CPU, which has no bf16 units).
fn cpu_encoder(
    weights: Arc<BertWeights>,
    settings: &EmbedSettings,
) -> Result<Box<dyn SentenceEncoder>> {
    Ok(Box::new(match settings.precision {
        EmbedPrecision::Bf16 => cpu::CpuEncoder::emulating_bf16(&weights, settings.threads)?,
        EmbedPrecision::Fp32 | EmbedPrecision::Auto => {
            cpu::CpuEncoder::new(weights, settings.threads)?
        }
    }))
}

/// How a worker cuts a block's sequences (shortest first) into forward passes.
#[derive(Debug, Clone)]
enum Batching {
    /// This many sentences a pass (`flumen.embed_batch_size`).
    Sentences(usize),
    /// At most this many tokens a pass (`flumen.embed_batch_tokens`).
    Tokens(usize),
    /// A token budget chosen from measured throughput.
    Adaptive(BatchTuner),
}

impl Batching {
    /// How a worker whose encoder is on an accelerator (or not) cuts its passes.
    fn from(settings: &EmbedSettings, on_accelerator: bool) -> Self {
        match (settings.batch_size, settings.batch_tokens) {
            (0, 0) if on_accelerator => Self::Adaptive(BatchTuner::for_accelerator()),
            (0, 0) => Self::Adaptive(BatchTuner::for_cpu()),
            (0, tokens) => Self::Tokens(tokens),
            (sentences, _) => Self::Sentences(sentences),
        }
    }

    /// The token budget of the next pass (which takes its place in the tuner's schedule);
    /// `None` when passes are cut by sentences.
    fn token_budget(&mut self) -> Option<usize> {
        match self {
            Self::Sentences(_) => None,
            Self::Tokens(budget) => Some(*budget),
            Self::Adaptive(tuner) => Some(tuner.next_budget()),
        }
    }
}

/// A loaded model: tokenizer plus a backend holding the weights.
pub struct EmbedWorker {
    tokenizer: Arc<SentenceTokenizer>,
    /// The encoder and the pieces' passes queued on it (shared with the pieces this worker
    /// queued, [`AcceleratorWorker::start`]).
    queue: Arc<Mutex<PassQueue>>,
    /// Milliseconds its load took (files, tokenizer, device, weights, kernels).
    load_ms: u64,
    /// Milliseconds of it reading the tokenizer and the weights.
    files_ms: u64,
}

static CPU_FALLBACK_NOTICE: Once = Once::new();

impl EmbedWorker {
    /// Load the model under a session's settings (`flumen.model_dir`, `flumen.device`,
    /// `flumen.embed_batch_size`, the CPU slots): for model-backed functions of your own
    /// built on the same encoder, inside [`AcceleratorFunction::load`].
    pub fn from_config(config: &ConfigOptions) -> Result<Self> {
        Self::load(&EmbedSettings::from(config))
    }

    fn load(settings: &EmbedSettings) -> Result<Self> {
        let started = Instant::now();
        if !(1..=2).contains(&settings.passes_in_flight) {
            return Err(DataFusionError::Configuration(format!(
                "flumen.embed_passes_in_flight must be 1 or 2, got {}",
                settings.passes_in_flight
            )));
        }
        model_files::check_model_dir(&settings.model_dir)?;
        // A GPU's context, kernels and cuBLAS come up on a thread of their own while this
        // one reads the tokenizer and the weights (0.3-0.4 s each on an H200, where one after
        // the other they made a 0.7-0.8 s load). `Err`: no GPU to open (why, for `auto`).
        let probe = match settings.device {
            Device::Cpu => Err("flumen.device = 'cpu'".to_string()),
            Device::Cuda => Ok(()),
            Device::Auto => cuda_driver::probe_device_count().map(|_| ()),
        };
        // The worker's device is chosen on its own thread (it keeps it), then opened beside.
        let ordinal = match &probe {
            Ok(()) => Some(crate::functions::accelerator_devices::worker_device()),
            Err(_) => None,
        };
        let (files, device) = std::thread::scope(|scope| {
            let device =
                ordinal.map(|ordinal| scope.spawn(move || cuda::CudaDevice::open_on(ordinal?)));
            let read = Instant::now();
            let files = SentenceTokenizer::shared(&settings.model_dir).and_then(|tokenizer| {
                Ok((tokenizer, Arc::new(BertWeights::load(&settings.model_dir)?)))
            });
            let files_ms = read.elapsed().as_millis() as u64;
            let device = device.map(|opening| {
                opening.join().unwrap_or_else(|_| {
                    Err(DataFusionError::Execution(
                        "embed() on CUDA: opening the device panicked".into(),
                    ))
                })
            });
            (files.map(|(t, w)| (t, w, files_ms)), device)
        });
        let (tokenizer, weights, files_ms) = files?;
        let encoder: Box<dyn SentenceEncoder> = match (settings.device, device) {
            (Device::Cuda, Some(device)) => {
                Box::new(cuda::CudaEncoder::on(device?, weights, settings.precision)?)
            }
            (Device::Auto, Some(device)) => {
                let on_device =
                    |d| cuda::CudaEncoder::on(d, Arc::clone(&weights), settings.precision);
                match device.and_then(on_device) {
                    Ok(encoder) => Box::new(encoder),
                    Err(e) => {
                        Self::cpu_fallback(e.strip_backtrace().to_string(), weights, settings)?
                    }
                }
            }
            (Device::Auto, None) => {
                Self::cpu_fallback(probe.err().unwrap_or_default(), weights, settings)?
            }
            _ => cpu_encoder(weights, settings)?,
        };
        let batching = Batching::from(settings, encoder.on_accelerator());
        // Most passes it keeps started and unfinished: the setting, within what the encoder
        // queues.
        let in_flight = settings.passes_in_flight.min(encoder.passes_in_flight());
        let queue = PassQueue::new(encoder, batching, in_flight, EMBEDDING_DIM as usize);
        Ok(Self {
            tokenizer,
            queue: Arc::new(Mutex::new(queue)),
            load_ms: started.elapsed().as_millis() as u64,
            files_ms,
        })
    }

    /// The CPU encoder `flumen.device = 'auto'` falls back to where CUDA is not usable
    /// (`why`, said once per process).
    fn cpu_fallback(
        why: String,
        weights: Arc<BertWeights>,
        settings: &EmbedSettings,
    ) -> Result<Box<dyn SentenceEncoder>> {
        CPU_FALLBACK_NOTICE.call_once(|| {
            eprintln!("flumen: embed() runs on the CPU ({why})");
        });
        cpu_encoder(weights, settings)
    }

    /// The backend this worker computes on, e.g. `cpu (2 threads)`.
    pub fn device(&self) -> String {
        self.lock_queue().encoder().device()
    }

    /// The pass queue. A thread that panicked holding it left nothing a later piece reads
    /// half done: a failed pass clears the queue.
    fn lock_queue(&self) -> std::sync::MutexGuard<'_, PassQueue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Embeddings of `texts` (None → None), `[rows, 384]` row-major with zeros for nulls.
    pub fn embed(&mut self, texts: &[Option<&str>]) -> Result<Vec<f32>> {
        let tokens = self.tokens_of_texts(texts)?;
        self.embed_now(tokens)
    }

    /// Embeddings of token sequences as `embed_tokens` gives them (None → None), `[rows,
    /// 384]` row-major with zeros for nulls.
    pub fn embed_token_ids(&mut self, sequences: &[Option<&[u32]>]) -> Result<Vec<f32>> {
        self.embed_now(tokens_of_sequences(sequences))
    }

    /// Embeddings of a column of texts (Utf8, LargeUtf8, Utf8View) or of token ids as
    /// `embed_tokens` gives them (`List(UInt32)`): `[rows, 384]` row-major with zeros for
    /// nulls, and which rows were not null. What a model function of your own that declares
    /// `embed_tokens` as its [`cpu_step`](AcceleratorFunction::cpu_step) calls in `process`.
    pub fn embed_column(&mut self, column: &ArrayRef) -> Result<(Vec<f32>, Vec<bool>)> {
        let tokens = self.tokens_of_column(column)?;
        let present = present_rows(&tokens);
        Ok((self.embed_now(tokens)?, present))
    }

    /// The token sequences of a column of texts or of token ids (see
    /// [`embed_column`](Self::embed_column)).
    fn tokens_of_column(&self, column: &ArrayRef) -> Result<PieceTokens> {
        match column.data_type() {
            DataType::List(item) if item.data_type() == &DataType::UInt32 => {
                let lists = column.as_list::<i32>();
                let ids = lists.values().as_primitive::<UInt32Type>().values();
                let offsets = lists.value_offsets();
                let sequences: Vec<Option<&[u32]>> = (0..lists.len())
                    .map(|i| {
                        let range = offsets[i] as usize..offsets[i + 1] as usize;
                        lists.is_valid(i).then(|| &ids[range])
                    })
                    .collect();
                Ok(tokens_of_sequences(&sequences))
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                let texts: Vec<Option<&str>> = match column.data_type() {
                    DataType::Utf8 => column.as_string::<i32>().iter().collect(),
                    DataType::LargeUtf8 => column.as_string::<i64>().iter().collect(),
                    _ => column.as_string_view().iter().collect(),
                };
                self.tokens_of_texts(&texts)
            }
            other => Err(DataFusionError::Execution(format!(
                "embed() takes text (Utf8, LargeUtf8 or Utf8View), got {other}"
            ))),
        }
    }

    /// `texts` tokenized (None: a null row).
    fn tokens_of_texts(&self, texts: &[Option<&str>]) -> Result<PieceTokens> {
        let present: Vec<usize> = (0..texts.len()).filter(|&i| texts[i].is_some()).collect();
        let strings: Vec<&str> = present
            .iter()
            .map(|&i| texts[i].unwrap_or_default())
            .collect();
        Ok(PieceTokens {
            rows: texts.len(),
            ids: self.tokenizer.encode(&strings)?,
            present,
        })
    }

    /// A piece's vectors, computed now: queued behind any piece already queued, then
    /// collected.
    fn embed_now(&mut self, tokens: PieceTokens) -> Result<Vec<f32>> {
        let mut queue = self.lock_queue();
        let id = queue.start(tokens)?;
        queue.collect(id)
    }
}

/// Token sequences (None: a null row) as a piece.
fn tokens_of_sequences(sequences: &[Option<&[u32]>]) -> PieceTokens {
    let present: Vec<usize> = (0..sequences.len())
        .filter(|&i| sequences[i].is_some())
        .collect();
    PieceTokens {
        rows: sequences.len(),
        ids: present
            .iter()
            .map(|&i| sequences[i].unwrap_or_default().to_vec())
            .collect(),
        present,
    }
}

/// Which rows of a piece have a sequence (the others are nulls).
fn present_rows(tokens: &PieceTokens) -> Vec<bool> {
    let mut present = vec![false; tokens.rows];
    for &row in &tokens.present {
        present[row] = true;
    }
    present
}

/// The `FixedSizeList(Float32, 384)` array of a piece's vectors: null where `column` is
/// null or the row had no sequence.
fn embedding_array(column: &ArrayRef, values: Vec<f32>, present: &[bool]) -> Result<ArrayRef> {
    let nulls = column.logical_nulls().or_else(|| {
        present
            .iter()
            .any(|p| !p)
            .then(|| NullBuffer::from_iter(present.iter().copied()))
    });
    let field = Arc::new(Field::new_list_field(DataType::Float32, true));
    let array = FixedSizeListArray::try_new(
        field,
        EMBEDDING_DIM,
        Arc::new(Float32Array::from(values)),
        nulls,
    )?;
    Ok(Arc::new(array))
}

/// A piece queued by [`EmbedWorker`]'s `start`: collected once, or abandoned when dropped
/// uncollected (its caller went away), so its passes do not hold the queue.
struct QueuedPiece {
    queue: Arc<Mutex<PassQueue>>,
    id: u64,
    collected: bool,
}

impl QueuedPiece {
    fn collect(mut self) -> Result<Vec<f32>> {
        self.collected = true;
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.collect(self.id)
    }
}

impl Drop for QueuedPiece {
    fn drop(&mut self) {
        if !self.collected {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.abandon(self.id);
        }
    }
}

impl AcceleratorWorker for EmbedWorker {
    fn metrics(&self) -> Vec<(String, u64)> {
        let queue = self.lock_queue();
        let mut metrics = match queue.batching() {
            Batching::Sentences(n) => vec![("embed_batch_size".into(), *n as u64)],
            Batching::Tokens(budget) => vec![("embed_batch_tokens".into(), *budget as u64)],
            Batching::Adaptive(tuner) => {
                let (trials, moves) = tuner.trials();
                vec![
                    ("embed_batch_tokens".into(), tuner.chosen() as u64),
                    ("embed_batch_trials".into(), trials),
                    ("embed_batch_moves".into(), moves),
                ]
            }
        };
        metrics.push(("embed_load_ms".into(), self.load_ms));
        metrics.push(("embed_files_ms".into(), self.files_ms));
        metrics.push(("embed_bf16".into(), queue.encoder().bf16() as u64));
        metrics.push((
            "embed_passes_in_flight".into(),
            queue.in_flight_limit() as u64,
        ));
        metrics.extend(queue.encoder().load_metrics());
        metrics
    }

    fn process(&mut self, args: &[ArrayRef], _return_type: &DataType) -> Result<ArrayRef> {
        let column = &args[0];
        let (values, present) = self.embed_column(column)?;
        embedding_array(column, values, &present)
    }

    /// Where passes queue on a device (more than one in flight), the piece's passes are
    /// queued behind those of pieces queued before it and the result is collected later,
    /// so the device works on this piece while the operator hands the last one on; else
    /// the piece is computed now.
    fn start(&mut self, args: &[ArrayRef], return_type: &DataType) -> Result<PendingOutput> {
        if self.lock_queue().in_flight_limit() < 2 {
            return self.process(args, return_type).map(PendingOutput::ready);
        }
        let column = Arc::clone(&args[0]);
        let tokens = self.tokens_of_column(&column)?;
        let present = present_rows(&tokens);
        let id = self.lock_queue().start(tokens)?;
        let piece = QueuedPiece {
            queue: Arc::clone(&self.queue),
            id,
            collected: false,
        };
        Ok(PendingOutput::new(move || {
            let values = piece.collect()?;
            embedding_array(&column, values, &present)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_model_names_the_file_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let settings = EmbedSettings {
            model_dir: dir.path().to_path_buf(),
            device: Device::Cpu,
            threads: 1,
            batch_size: 8,
            batch_tokens: 0,
            precision: EmbedPrecision::Fp32,
            passes_in_flight: 2,
        };
        let err = EmbedWorker::load(&settings)
            .err()
            .expect("no model there")
            .to_string();
        assert!(
            err.contains("tokenizer.json") || err.contains("config.json"),
            "{err}"
        );
        assert!(err.contains("install-model"), "{err}");
    }
}
