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
//! back in the block's row order.

pub mod batch_tuner;
pub mod bert;
pub mod cpu;
pub mod cuda;
pub mod cuda_compile;
pub mod cuda_passes;
pub mod model_files;
pub mod row_kernels;
pub mod tokenize_step;
pub mod tokenizer;

use std::path::PathBuf;
use std::sync::{Arc, Once};
use std::time::Instant;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, FixedSizeListArray, Float32Array};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::datatypes::UInt32Type;
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{ScalarUDF, Signature, Volatility};

use crate::config::{Device, EmbedPrecision, FlumenConfig};
use crate::functions::accelerator::{AcceleratorFunction, AcceleratorWorker, WorkerResources};
use batch_tuner::BatchTuner;
use bert::{BertWeights, PackedBatch, SentenceEncoder};
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
            threads: (flumen.cpu_slots / flumen.accelerator_workers()).max(1),
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
            Device::Auto if cuda::cuda_available() => WorkerResources {
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
    encoder: Box<dyn SentenceEncoder>,
    batching: Batching,
    /// Most passes it keeps started and unfinished: the setting, within what the encoder
    /// queues.
    passes_in_flight: usize,
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
            Device::Auto => cuda::probe_device_count().map(|_| ()),
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
        let passes_in_flight = settings.passes_in_flight.min(encoder.passes_in_flight());
        Ok(Self {
            tokenizer,
            encoder,
            batching,
            passes_in_flight,
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
        self.encoder.device()
    }

    /// Embeddings of `texts` (None → None), `[rows, 384]` row-major with zeros for nulls.
    pub fn embed(&mut self, texts: &[Option<&str>]) -> Result<Vec<f32>> {
        let present: Vec<usize> = (0..texts.len()).filter(|&i| texts[i].is_some()).collect();
        let strings: Vec<&str> = present
            .iter()
            .map(|&i| texts[i].unwrap_or_default())
            .collect();
        let ids = self.tokenizer.encode(&strings)?;
        let ids: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        self.embed_present(texts.len(), &present, &ids)
    }

    /// Embeddings of token sequences as `embed_tokens` gives them (None → None), `[rows,
    /// 384]` row-major with zeros for nulls.
    pub fn embed_token_ids(&mut self, sequences: &[Option<&[u32]>]) -> Result<Vec<f32>> {
        let present: Vec<usize> = (0..sequences.len())
            .filter(|&i| sequences[i].is_some())
            .collect();
        let ids: Vec<&[u32]> = present
            .iter()
            .map(|&i| sequences[i].unwrap_or_default())
            .collect();
        self.embed_present(sequences.len(), &present, &ids)
    }

    /// Embeddings of a column of texts (Utf8, LargeUtf8, Utf8View) or of token ids as
    /// `embed_tokens` gives them (`List(UInt32)`): `[rows, 384]` row-major with zeros for
    /// nulls, and which rows were not null. What a model function of your own that declares
    /// `embed_tokens` as its [`cpu_step`](AcceleratorFunction::cpu_step) calls in `process`.
    pub fn embed_column(&mut self, column: &ArrayRef) -> Result<(Vec<f32>, Vec<bool>)> {
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
                let present = sequences.iter().map(Option::is_some).collect();
                Ok((self.embed_token_ids(&sequences)?, present))
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                let texts: Vec<Option<&str>> = match column.data_type() {
                    DataType::Utf8 => column.as_string::<i32>().iter().collect(),
                    DataType::LargeUtf8 => column.as_string::<i64>().iter().collect(),
                    _ => column.as_string_view().iter().collect(),
                };
                let present = texts.iter().map(Option::is_some).collect();
                Ok((self.embed(&texts)?, present))
            }
            other => Err(DataFusionError::Execution(format!(
                "embed() takes text (Utf8, LargeUtf8 or Utf8View), got {other}"
            ))),
        }
    }

    /// Embeddings of `rows` rows, of which rows `present[j]` have tokens `ids[j]`.
    fn embed_present(
        &mut self,
        rows: usize,
        present: &[usize],
        ids: &[&[u32]],
    ) -> Result<Vec<f32>> {
        let mut out = vec![0f32; rows * EMBEDDING_DIM as usize];
        let passes = Passes {
            encoder: self.encoder.as_mut(),
            batching: &mut self.batching,
            in_flight: self.passes_in_flight,
        };
        passes.run(present, ids, &mut out)?;
        Ok(out)
    }
}

/// How a worker runs a block's sequences through its encoder: in passes cut by `batching`,
/// shortest sequences first, up to `in_flight` of them started before the oldest is
/// finished (so an accelerator computes one while the next is packed and queued).
struct Passes<'a> {
    encoder: &'a mut dyn SentenceEncoder,
    batching: &'a mut Batching,
    in_flight: usize,
}

impl Passes<'_> {
    /// The vectors of sequences `ids` into rows `present` of `out` (`[rows, width]`
    /// row-major, `width` the encoder's).
    fn run(self, present: &[usize], ids: &[&[u32]], out: &mut [f32]) -> Result<()> {
        // Similar lengths together: attention work per batch stays even.
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&j| ids[j].len());
        let mut in_flight = std::collections::VecDeque::new();
        let mut start = 0;
        // When the last finished pass's vectors came back: the device moved on from there.
        let mut last_back = Instant::now();
        while start < order.len() || !in_flight.is_empty() {
            if start < order.len() && in_flight.len() < self.in_flight.max(1) {
                let budget = self.batching.token_budget();
                let (end, tokens) = match (&*self.batching, budget) {
                    (Batching::Sentences(n), _) => {
                        let end = (start + n).min(order.len());
                        (end, order[start..end].iter().map(|&j| ids[j].len()).sum())
                    }
                    (_, budget) => pass_end(&order, ids, start, budget.unwrap_or(usize::MAX)),
                };
                let batch = PackedBatch::new(order[start..end].iter().map(|&j| ids[j]));
                let began = Instant::now();
                let started = self.encoder.start(&batch)?;
                in_flight.push_back((started, start..end, tokens, budget, began));
                start = end;
                continue;
            }
            let (started, chunk, tokens, budget, began) =
                in_flight.pop_front().expect("a pass is in flight");
            let vectors = self.encoder.finish(started)?;
            let back = Instant::now();
            // The device ran this pass from its start or from the previous pass's end,
            // whichever came later.
            let ran = back - began.max(last_back);
            last_back = back;
            if let (Batching::Adaptive(tuner), Some(budget)) = (&mut *self.batching, budget) {
                tuner.record(budget, tokens, ran);
            }
            let width = vectors.len() / chunk.len();
            for (k, &j) in order[chunk].iter().enumerate() {
                let row = present[j];
                out[row * width..(row + 1) * width]
                    .copy_from_slice(&vectors[k * width..(k + 1) * width]);
            }
        }
        Ok(())
    }
}

/// Where the pass starting at `order[start]` ends so it holds at most `budget` tokens (at
/// least one sequence), and the tokens it holds.
fn pass_end(order: &[usize], ids: &[&[u32]], start: usize, budget: usize) -> (usize, usize) {
    let mut end = start;
    let mut tokens = 0;
    while end < order.len() {
        let len = ids[order[end]].len();
        if end > start && tokens + len > budget {
            break;
        }
        tokens += len;
        end += 1;
    }
    (end, tokens)
}

impl AcceleratorWorker for EmbedWorker {
    fn metrics(&self) -> Vec<(String, u64)> {
        let mut metrics = match &self.batching {
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
        metrics.push(("embed_bf16".into(), self.encoder.bf16() as u64));
        metrics.push((
            "embed_passes_in_flight".into(),
            self.passes_in_flight as u64,
        ));
        metrics.extend(self.encoder.load_metrics());
        metrics
    }

    fn process(&mut self, args: &[ArrayRef], _return_type: &DataType) -> Result<ArrayRef> {
        let column = &args[0];
        let (values, present) = self.embed_column(column)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use bert::StartedPass;

    /// An encoder that, like a GPU's, computes a pass only when it is finished: each
    /// sequence's vector is `[its length, its first id]`. It checks passes finish in the
    /// order they started and counts how many were ever unfinished at once.
    #[derive(Default)]
    struct Deferred {
        queued: std::collections::VecDeque<(u64, PackedBatch)>,
        started: u64,
        most_unfinished: usize,
    }

    impl SentenceEncoder for Deferred {
        fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
            let pass = self.start(batch)?;
            self.finish(pass)
        }
        fn start(&mut self, batch: &PackedBatch) -> Result<StartedPass> {
            self.queued.push_back((self.started, batch.clone()));
            self.most_unfinished = self.most_unfinished.max(self.queued.len());
            self.started += 1;
            Ok(StartedPass::OnDevice {
                slot: 0,
                number: self.started - 1,
            })
        }
        fn finish(&mut self, pass: StartedPass) -> Result<Vec<f32>> {
            let StartedPass::OnDevice { number, .. } = pass else {
                panic!("not queued");
            };
            let (queued, batch) = self.queued.pop_front().unwrap();
            assert_eq!(queued, number, "finished out of order");
            let offsets = batch.offsets();
            Ok(batch
                .lengths
                .iter()
                .zip(offsets)
                .flat_map(|(&len, at)| [len as f32, batch.ids[at] as f32])
                .collect())
        }
        fn device(&self) -> String {
            "deferred".into()
        }
        fn passes_in_flight(&self) -> usize {
            2
        }
    }

    /// With two passes in flight every row still gets its own sequence's vector, rows
    /// without one stay zero, and no more than two passes are ever unfinished.
    #[test]
    fn passes_in_flight_put_each_vector_in_its_row() {
        let sequences: Vec<Vec<u32>> = (0..40u32)
            .map(|i| (0..(1 + (i * 7) % 13)).map(|t| 1000 + i + t).collect())
            .collect();
        let ids: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
        // Row 2k holds sequence k; odd rows are nulls.
        let present: Vec<usize> = (0..ids.len()).map(|k| 2 * k).collect();
        for (in_flight, mut batching) in [
            (2, Batching::Tokens(20)),
            (2, Batching::Sentences(3)),
            (1, Batching::Tokens(20)),
        ] {
            let mut encoder = Deferred::default();
            let mut out = vec![-1f32; 2 * ids.len() * 2];
            Passes {
                encoder: &mut encoder,
                batching: &mut batching,
                in_flight,
            }
            .run(&present, &ids, &mut out)
            .unwrap();
            for (k, seq) in sequences.iter().enumerate() {
                assert_eq!(
                    out[4 * k..4 * k + 2],
                    [seq.len() as f32, seq[0] as f32],
                    "row {}",
                    2 * k
                );
                assert_eq!(out[4 * k + 2..4 * k + 4], [-1.0, -1.0], "null row");
            }
            assert!(encoder.queued.is_empty());
            assert_eq!(encoder.most_unfinished, in_flight, "{batching:?}");
            assert!(
                encoder.started > 3,
                "{batching:?}: {} passes",
                encoder.started
            );
        }
    }

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
