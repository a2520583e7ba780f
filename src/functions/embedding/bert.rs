//! A BERT encoder's configuration and weights, read from `config.json` and
//! `model.safetensors`, in the layout both backends use: linear weights transposed to
//! `[in, out]` row-major, and the query/key/value projections fused into one `[h, 3h]`.

use std::path::Path;

use datafusion::error::{DataFusionError, Result};
use safetensors::{Dtype, SafeTensors};

use super::model_files::{check_model_dir, model_error};

/// The shape of a BERT encoder (`config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Width of every token's hidden state.
    pub hidden: usize,
    /// Attention heads per layer (`hidden / heads` wide each).
    pub heads: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Width of the feed-forward layer.
    pub intermediate: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f32,
    /// Longest sequence the position embeddings cover.
    pub max_positions: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl BertConfig {
    /// Parse `config.json`; only BERT with erf GELU is supported.
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| model_error(format!("cannot read {}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| model_error(format!("{} is not valid JSON: {e}", path.display())))?;
        let field = |name: &str| {
            json.get(name)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| {
                    model_error(format!("{} has no integer field '{name}'", path.display()))
                })
        };
        let activation = json
            .get("hidden_act")
            .and_then(|v| v.as_str())
            .unwrap_or("gelu");
        if activation != "gelu" {
            return Err(model_error(format!(
                "{}: hidden_act '{activation}' is not supported (only 'gelu')",
                path.display()
            )));
        }
        let config = Self {
            hidden: field("hidden_size")?,
            heads: field("num_attention_heads")?,
            layers: field("num_hidden_layers")?,
            intermediate: field("intermediate_size")?,
            layer_norm_eps: json
                .get("layer_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-12) as f32,
            max_positions: field("max_position_embeddings")?,
            vocab: field("vocab_size")?,
        };
        // Bounds far above any sentence encoder's, so a damaged or hostile config.json is an
        // error naming its field, not an allocation of its size.
        for (name, value, most) in [
            ("hidden_size", config.hidden, 1 << 16),
            ("num_attention_heads", config.heads, 1 << 10),
            ("num_hidden_layers", config.layers, 1 << 10),
            ("intermediate_size", config.intermediate, 1 << 18),
            ("max_position_embeddings", config.max_positions, 1 << 20),
            ("vocab_size", config.vocab, 1 << 22),
        ] {
            if value == 0 || value > most {
                return Err(model_error(format!(
                    "{}: {name} = {value} is outside 1..={most}",
                    path.display()
                )));
            }
        }
        if config.heads == 0 || !config.hidden.is_multiple_of(config.heads) {
            return Err(model_error(format!(
                "{}: hidden_size {} is not a multiple of num_attention_heads {}",
                path.display(),
                config.hidden,
                config.heads
            )));
        }
        Ok(config)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// A layer norm's scale and shift.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// Scale (`weight`), `[hidden]`.
    pub gamma: Vec<f32>,
    /// Shift (`bias`), `[hidden]`.
    pub beta: Vec<f32>,
}

/// A linear layer, `y = x · weight + bias`, with `weight` as `[in, out]` row-major.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[in, out]` row-major.
    pub weight: Vec<f32>,
    /// `[out]`.
    pub bias: Vec<f32>,
    /// Input width.
    pub inputs: usize,
    /// Output width.
    pub outputs: usize,
}

/// One encoder layer.
#[derive(Debug, Clone)]
pub struct EncoderLayer {
    /// Query, key and value projections fused: outputs `[q | k | v]`.
    pub qkv: Linear,
    /// Projection of the attention output.
    pub attention_out: Linear,
    /// Norm after attention (with residual).
    pub attention_norm: LayerNorm,
    /// Feed-forward up projection (followed by GELU).
    pub intermediate: Linear,
    /// Feed-forward down projection.
    pub output: Linear,
    /// Norm after the feed-forward block (with residual).
    pub output_norm: LayerNorm,
}

/// Every weight of a BERT encoder, on the host.
#[derive(Debug, Clone)]
pub struct BertWeights {
    /// The encoder's shape.
    pub config: BertConfig,
    /// `[vocab, hidden]`.
    pub word_embeddings: Vec<f32>,
    /// `[max_positions, hidden]`.
    pub position_embeddings: Vec<f32>,
    /// Token type 0's embedding, `[hidden]` (sentence embedding uses a single segment).
    pub token_type_embedding: Vec<f32>,
    /// Norm over the summed embeddings.
    pub embedding_norm: LayerNorm,
    /// The encoder layers, first to last.
    pub layers: Vec<EncoderLayer>,
}

impl BertWeights {
    /// Read `config.json` and `model.safetensors` from a model directory.
    pub fn load(model_dir: &Path) -> Result<Self> {
        check_model_dir(model_dir)?;
        let config = BertConfig::load(model_dir)?;
        let path = model_dir.join("model.safetensors");
        let bytes = std::fs::read(&path)
            .map_err(|e| model_error(format!("cannot read {}: {e}", path.display())))?;
        let tensors = SafeTensors::deserialize(&bytes).map_err(|e| {
            model_error(format!(
                "{} is not a valid safetensors file: {e}",
                path.display()
            ))
        })?;
        let reader = TensorReader {
            tensors: &tensors,
            path: &path,
        };
        let h = config.hidden;
        let norm = |prefix: &str| -> Result<LayerNorm> {
            Ok(LayerNorm {
                gamma: reader.get(&format!("{prefix}.weight"), &[h])?,
                beta: reader.get(&format!("{prefix}.bias"), &[h])?,
            })
        };
        let linear = |prefix: &str, inputs: usize, outputs: usize| -> Result<Linear> {
            let weight = reader.get(&format!("{prefix}.weight"), &[outputs, inputs])?;
            Ok(Linear {
                weight: flumen_row_kernels::transpose(&weight, outputs, inputs),
                bias: reader.get(&format!("{prefix}.bias"), &[outputs])?,
                inputs,
                outputs,
            })
        };
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("encoder.layer.{i}");
            let q = linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = linear(&format!("{p}.attention.self.value"), h, h)?;
            layers.push(EncoderLayer {
                qkv: fuse_columns(&[q, k, v]),
                attention_out: linear(&format!("{p}.attention.output.dense"), h, h)?,
                attention_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                intermediate: linear(&format!("{p}.intermediate.dense"), h, config.intermediate)?,
                output: linear(&format!("{p}.output.dense"), config.intermediate, h)?,
                output_norm: norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        let token_types = reader.get_rows("embeddings.token_type_embeddings.weight", h)?;
        Ok(Self {
            word_embeddings: reader.get("embeddings.word_embeddings.weight", &[config.vocab, h])?,
            position_embeddings: reader.get(
                "embeddings.position_embeddings.weight",
                &[config.max_positions, h],
            )?,
            token_type_embedding: token_types[..h].to_vec(),
            embedding_norm: norm("embeddings.LayerNorm")?,
            layers,
            config,
        })
    }
}

struct TensorReader<'a> {
    tensors: &'a SafeTensors<'a>,
    path: &'a Path,
}

impl TensorReader<'_> {
    /// The named F32 tensor (also found under a `bert.` prefix), checked against `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (data, actual) = self.read(name)?;
        if actual != shape {
            return Err(model_error(format!(
                "{}: tensor {name} has shape {actual:?}, expected {shape:?}",
                self.path.display()
            )));
        }
        Ok(data)
    }

    /// The named F32 matrix with rows of `width`, at least one row.
    fn get_rows(&self, name: &str, width: usize) -> Result<Vec<f32>> {
        let (data, shape) = self.read(name)?;
        if shape.len() != 2 || shape[1] != width || shape[0] == 0 {
            return Err(model_error(format!(
                "{}: tensor {name} has shape {shape:?}, expected [_, {width}]",
                self.path.display()
            )));
        }
        Ok(data)
    }

    fn read(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let view = self
            .tensors
            .tensor(name)
            .or_else(|_| self.tensors.tensor(&format!("bert.{name}")))
            .map_err(|_| {
                model_error(format!("{}: tensor {name} is missing", self.path.display()))
            })?;
        if view.dtype() != Dtype::F32 {
            return Err(model_error(format!(
                "{}: tensor {name} is {:?}, expected F32",
                self.path.display(),
                view.dtype()
            )));
        }
        let data = flumen_row_kernels::f32s_from_le_bytes(view.data());
        Ok((data, view.shape().to_vec()))
    }
}

/// Linear layers over the same input, side by side: outputs concatenated.
fn fuse_columns(parts: &[Linear]) -> Linear {
    let inputs = parts[0].inputs;
    let outputs: usize = parts.iter().map(|p| p.outputs).sum();
    let mut weight = Vec::with_capacity(inputs * outputs);
    for row in 0..inputs {
        for part in parts {
            weight.extend_from_slice(&part.weight[row * part.outputs..(row + 1) * part.outputs]);
        }
    }
    Linear {
        weight,
        bias: parts.iter().flat_map(|p| p.bias.iter().copied()).collect(),
        inputs,
        outputs,
    }
}

/// Token ids of several sequences packed back to back (no padding).
#[derive(Debug, Clone, Default)]
pub struct PackedBatch {
    /// Every sequence's ids, concatenated.
    pub ids: Vec<u32>,
    /// Each sequence's length; they sum to `ids.len()`.
    pub lengths: Vec<usize>,
}

impl PackedBatch {
    /// Pack sequences.
    pub fn new<'a>(sequences: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let mut batch = Self::default();
        for seq in sequences {
            batch.ids.extend_from_slice(seq);
            batch.lengths.push(seq.len());
        }
        batch
    }

    /// Start offset of every sequence.
    pub fn offsets(&self) -> Vec<usize> {
        let mut offset = 0;
        self.lengths
            .iter()
            .map(|len| {
                let start = offset;
                offset += len;
                start
            })
            .collect()
    }
}

/// A forward pass [`SentenceEncoder::start`] began.
#[derive(Debug)]
pub enum StartedPass {
    /// Computed when it was started: its vectors.
    Done(Vec<f32>),
    /// Queued on a device: the backend's slot for it and the pass's number there.
    OnDevice {
        /// Which of the backend's slots holds it.
        slot: usize,
        /// The how-manyth pass the backend started (a slot's next pass has another).
        number: u64,
    },
}

/// A backend that turns packed token ids into sentence embeddings.
pub trait SentenceEncoder: Send {
    /// Mean-pooled, L2-normalised embeddings, `[sequences, hidden]` row-major.
    fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>>;
    /// Begin a pass whose vectors [`finish`](Self::finish) gives. A backend on a device
    /// queues it and returns, so the caller can pack and start the next pass while this
    /// one computes (up to [`passes_in_flight`](Self::passes_in_flight) unfinished,
    /// finished in the order they began); the default computes it now.
    fn start(&mut self, batch: &PackedBatch) -> Result<StartedPass> {
        Ok(StartedPass::Done(self.encode(batch)?))
    }
    /// The vectors of a pass [`start`](Self::start) began, once they are there.
    fn finish(&mut self, pass: StartedPass) -> Result<Vec<f32>> {
        match pass {
            StartedPass::Done(vectors) => Ok(vectors),
            StartedPass::OnDevice { .. } => Err(DataFusionError::Internal(
                "embed(): a pass queued on a device came back to a backend without one".into(),
            )),
        }
    }
    /// Most passes it keeps started and unfinished (1: each is done when it starts).
    fn passes_in_flight(&self) -> usize {
        1
    }
    /// The backend's name as shown to users (`cpu`, `cuda:0`).
    fn device(&self) -> String;
    /// Whether it computes on an accelerator (which wants larger passes than a CPU).
    fn on_accelerator(&self) -> bool {
        false
    }
    /// Figures of how it was loaded, for `EXPLAIN ANALYZE` (e.g. kernel compile time).
    fn load_metrics(&self) -> Vec<(String, u64)> {
        vec![]
    }
    /// Whether it computes in bfloat16 (`flumen.embed_precision`), on tensor cores or
    /// emulated.
    fn bf16(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_columns_keep_each_part_in_place() {
        let a = Linear {
            weight: vec![1.0, 2.0],
            bias: vec![0.5],
            inputs: 2,
            outputs: 1,
        };
        let b = Linear {
            weight: vec![3.0, 4.0, 5.0, 6.0],
            bias: vec![1.0, 2.0],
            inputs: 2,
            outputs: 2,
        };
        let fused = fuse_columns(&[a, b]);
        assert_eq!(fused.weight, vec![1.0, 3.0, 4.0, 2.0, 5.0, 6.0]);
        assert_eq!(fused.bias, vec![0.5, 1.0, 2.0]);
    }
}
