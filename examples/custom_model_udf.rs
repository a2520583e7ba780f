//! A second model-backed SQL function of your own: `topic(text)`, a zero-shot classifier that
//! embeds the text with all-MiniLM-L6-v2 and returns the closest of a few labels.
//!
//! It implements [`flumen::AcceleratorFunction`]: `load` runs once per accelerator worker (it
//! loads the model and embeds the labels), `process` handles one batch, `batch_rows` and
//! `resources` tell flumen how to feed and place it, and `cpu_step` names the tokenizer
//! (`embed_tokens`) as its CPU step, so texts are tokenized on the CPU pool and `process` gets
//! token ids (when the model runs on CUDA, or with `SET flumen.preprocess_on_cpu = true` as
//! here: `EXPLAIN` shows `embed_tokens(t)` below the accelerator operator). The planner
//! gives it an operator of its own on the accelerator pool, exactly like `embed`.
//!
//! Run: `cargo run --release --example custom_model_udf` (after `flumen install-model`).

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, StringArray};
use datafusion::arrow::datatypes::DataType;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::{ScalarUDF, Signature, Volatility};
use flumen::functions::embedding::tokenize_step::embed_tokens_udf;
use flumen::functions::embedding::{EMBEDDING_DIM, EmbedFunction, EmbedWorker};
use flumen::{
    AcceleratorFunction, AcceleratorWorker, FlumenConfig, WorkerResources, accelerator_udf,
};

/// `topic(text)`: the label whose embedding is closest to the text's.
#[derive(Debug)]
struct TopicFunction {
    labels: Vec<String>,
    signature: Signature,
}

/// One worker's state: the loaded encoder and the labels' embeddings.
struct TopicWorker {
    encoder: EmbedWorker,
    labels: Vec<String>,
    label_vectors: Vec<f32>,
}

impl AcceleratorFunction for TopicFunction {
    fn name(&self) -> &str {
        "topic"
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _: &[DataType]) -> Result<DataType> {
        Ok(DataType::Utf8)
    }
    fn load(&self, config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        let mut encoder = EmbedWorker::from_config(config)?;
        let labels: Vec<Option<&str>> = self.labels.iter().map(|l| Some(l.as_str())).collect();
        let label_vectors = encoder.embed(&labels)?;
        println!("topic(): worker loaded the model on {}", encoder.device());
        Ok(Box::new(TopicWorker {
            encoder,
            labels: self.labels.clone(),
            label_vectors,
        }))
    }
    fn batch_rows(&self, _: &ConfigOptions) -> Option<usize> {
        Some(512)
    }
    fn resources(&self, config: &ConfigOptions) -> WorkerResources {
        // Whatever embed() would occupy under these settings (GPU or CPU threads).
        EmbedFunction::default().resources(config)
    }
    fn cpu_step(&self) -> Option<Arc<ScalarUDF>> {
        // Tokenize on the CPU pool; `process` then gets token ids instead of texts.
        Some(embed_tokens_udf())
    }
}

impl AcceleratorWorker for TopicWorker {
    fn process(&mut self, args: &[ArrayRef], _: &DataType) -> Result<ArrayRef> {
        // Token ids from the CPU step (or texts, with flumen.preprocess_on_cpu = false).
        let (vectors, present) = self.encoder.embed_column(&args[0])?;
        let dim = EMBEDDING_DIM as usize;
        let best = present.iter().enumerate().map(|(row, present)| {
            present.then(|| {
                let v = &vectors[row * dim..(row + 1) * dim];
                let score = |l: usize| -> f32 {
                    let label = &self.label_vectors[l * dim..(l + 1) * dim];
                    v.iter().zip(label).map(|(a, b)| a * b).sum()
                };
                let top = (0..self.labels.len()).max_by(|&a, &b| score(a).total_cmp(&score(b)));
                self.labels[top.unwrap_or(0)].clone()
            })
        });
        Ok(Arc::new(best.collect::<StringArray>()))
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let ctx = flumen::session(FlumenConfig::default());
    // flumen::session registers embed_tokens already; a session of your own would
    // `ctx.register_udf(embed_tokens_udf().as_ref().clone())` so worker processes find it.
    ctx.register_udf(accelerator_udf(TopicFunction {
        labels: ["sports", "finance", "cooking", "computers", "weather"]
            .map(String::from)
            .to_vec(),
        signature: Signature::string(1, Volatility::Immutable),
    }));
    let sql = "SELECT t, topic(t) AS topic FROM (VALUES \
                 ('The striker scored twice in the final minutes.'), \
                 ('Shares dropped after the quarterly earnings call.'), \
                 ('Whisk the eggs and fold in the flour.'), \
                 ('The new GPU doubles matrix multiply throughput.'), \
                 ('Heavy rain and strong winds are expected tomorrow.'), \
                 (NULL)) AS v(t)";
    ctx.sql("SET flumen.preprocess_on_cpu = true").await?;
    ctx.sql(&format!("EXPLAIN {sql}")).await?.show().await?;
    ctx.sql(sql).await?.show().await?;
    Ok(())
}
