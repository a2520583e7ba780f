//! `embed(text)`: sentence embeddings from all-MiniLM-L6-v2 (sentence-transformers), computed
//! by flumen's own BERT forward on the CPU or on CUDA, as an accelerator UDF.
//!
//! Each accelerator worker loads the tokenizer and weights once (see
//! [`crate::functions::accelerator`]) and keeps them for the session. A block's texts are tokenized,
//! ordered by token count, and run in batches of `flumen.embed_batch_size` sentences packed
//! back to back (no padding); results come back in the block's row order.

pub mod bert;
pub mod cpu;
pub mod cuda;
pub mod model_files;
pub mod tokenizer;

use std::path::PathBuf;
use std::sync::{Arc, Once};

use datafusion::arrow::array::{Array, ArrayRef, AsArray, FixedSizeListArray, Float32Array};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{Signature, Volatility};

use crate::config::{Device, FlumenConfig};
use crate::functions::accelerator::{AcceleratorFunction, AcceleratorWorker, WorkerResources};
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
            threads: (flumen.cpu_slots / flumen.accelerator_slots.max(1)).max(1),
            batch_size: flumen.embed_batch_size.max(1),
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

/// A loaded model: tokenizer plus a backend holding the weights.
pub struct EmbedWorker {
    tokenizer: SentenceTokenizer,
    encoder: Box<dyn SentenceEncoder>,
    batch_size: usize,
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
        model_files::check_model_dir(&settings.model_dir)?;
        let tokenizer = SentenceTokenizer::load(&settings.model_dir)?;
        let weights = Arc::new(BertWeights::load(&settings.model_dir)?);
        let encoder: Box<dyn SentenceEncoder> = match settings.device {
            Device::Cpu => Box::new(cpu::CpuEncoder::new(weights, settings.threads)?),
            Device::Cuda => Box::new(cuda::CudaEncoder::new(weights)?),
            Device::Auto => {
                let cuda = cuda::probe_device_count()
                    .map_err(|why| why.to_string())
                    .and_then(|_| {
                        cuda::CudaEncoder::new(Arc::clone(&weights))
                            .map_err(|e| e.strip_backtrace().to_string())
                    });
                match cuda {
                    Ok(encoder) => Box::new(encoder),
                    Err(why) => {
                        CPU_FALLBACK_NOTICE.call_once(|| {
                            eprintln!("flumen: embed() runs on the CPU ({why})");
                        });
                        Box::new(cpu::CpuEncoder::new(weights, settings.threads)?)
                    }
                }
            }
        };
        Ok(Self {
            tokenizer,
            encoder,
            batch_size: settings.batch_size,
        })
    }

    /// The backend this worker computes on, e.g. `cpu (2 threads)`.
    pub fn device(&self) -> String {
        self.encoder.device()
    }

    /// Embeddings of `texts` (None → None), `[rows, 384]` row-major with zeros for nulls.
    pub fn embed(&mut self, texts: &[Option<&str>]) -> Result<Vec<f32>> {
        let dim = EMBEDDING_DIM as usize;
        let present: Vec<usize> = (0..texts.len()).filter(|&i| texts[i].is_some()).collect();
        let strings: Vec<&str> = present
            .iter()
            .map(|&i| texts[i].unwrap_or_default())
            .collect();
        let ids = self.tokenizer.encode(&strings)?;
        // Similar lengths together: attention work per batch stays even.
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&j| ids[j].len());
        let mut out = vec![0f32; texts.len() * dim];
        for chunk in order.chunks(self.batch_size) {
            let batch = PackedBatch::new(chunk.iter().map(|&j| ids[j].as_slice()));
            let vectors = self.encoder.encode(&batch)?;
            for (k, &j) in chunk.iter().enumerate() {
                let row = present[j];
                out[row * dim..(row + 1) * dim].copy_from_slice(&vectors[k * dim..(k + 1) * dim]);
            }
        }
        Ok(out)
    }
}

impl AcceleratorWorker for EmbedWorker {
    fn process(&mut self, args: &[ArrayRef], _return_type: &DataType) -> Result<ArrayRef> {
        let column = &args[0];
        let texts: Vec<Option<&str>> = match column.data_type() {
            DataType::Utf8 => column.as_string::<i32>().iter().collect(),
            DataType::LargeUtf8 => column.as_string::<i64>().iter().collect(),
            DataType::Utf8View => column.as_string_view().iter().collect(),
            other => {
                return Err(DataFusionError::Execution(format!(
                    "embed() takes text (Utf8, LargeUtf8 or Utf8View), got {other}"
                )));
            }
        };
        let values = self.embed(&texts)?;
        let nulls = column.logical_nulls().or_else(|| {
            texts
                .iter()
                .any(Option::is_none)
                .then(|| NullBuffer::from_iter(texts.iter().map(Option::is_some)))
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

    #[test]
    fn missing_model_names_the_file_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let settings = EmbedSettings {
            model_dir: dir.path().to_path_buf(),
            device: Device::Cpu,
            threads: 1,
            batch_size: 8,
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
