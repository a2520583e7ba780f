//! Embedding throughput: flumen's `embed()` against sentence-transformers on the same
//! machine, cores and sentences, in the same run.
//!
//! ```text
//! cargo bench --bench embed -- [--device cpu|cuda] [--sentences 10000] [--threads N]
//!                              [--batch-sizes 0,32,64] [--python PATH]
//!                              [--corpus sentences|docs|both] [--docs 600]
//!                              [--preprocess-on-cpu true|false|both]
//!                              [--peak-tflops P] [--precision fp32|bf16|both]
//!                              [--accelerator-slots N] [--passes-in-flight 1|2|both]
//! ```
//!
//! Two corpora: generated sentences of mixed length, and the demo table's HTML documents
//! (`flumen::demo`, the README's main job), the first `--docs` of them put through
//! `clean_text` once, so both sides embed the same cleaned texts (about 170 tokens each).
//! flumen's batch size 0 is its default: passes cut by tokens, the budget tuned by the worker;
//! the baseline runs at 32 (sentence-transformers' default) where flumen runs at 0.
//! `--preprocess-on-cpu` runs flumen with its tokenizer as a CPU step (`true`, the default
//! here; a session's `auto` does it only for a model on an accelerator), with the worker
//! tokenizing (`false`), or both, and prints their ratio. A roofline line per batch size gives
//! the FLOP/s flumen's rate comes to (mean tokens per text x FLOPs per token x texts/s), and
//! with `--peak-tflops` its share of the device's peak.
//! `--precision` sets `flumen.embed_precision` (`fp32`, the default; `bf16`; or `both`, each
//! in turn); at `bf16` the baseline runs sentence-transformers in half precision
//! (`model.half()`), so each ratio compares half precision with half precision.
//! `--accelerator-slots` runs flumen with that many accelerator workers (default 1; two on
//! one GPU share it, each with its own stream). `--passes-in-flight` sets
//! `flumen.embed_passes_in_flight` (2, the default; 1; or `both`, printing two against one).
//!
//! The baseline is `benches/embed_baseline.py`, run with `--python` (default: `$FLUMEN_BENCH_PYTHON`
//! or `python3`), which needs sentence-transformers installed (e.g. in a venv). The last line
//! is machine-readable: `embed device=cpu batch_size=B flumen_per_s=N baseline_per_s=N
//! ratio=X.XX best_flumen_per_s=N@B best_baseline_per_s=N@B best_ratio=X.XX`: both sides run
//! at every batch size asked for; the headline ratio is at flumen's default batch size (or
//! the first size given), and each side's best is reported beside it. A baseline that fails
//! to run fails the bench.

use std::io::Write;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::StringArray;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use flumen::functions::embedding::model_files;
use flumen::{EmbedPrecision, FlumenConfig};

const WORDS: &[&str] = &[
    "the",
    "model",
    "reads",
    "a",
    "table",
    "of",
    "documents",
    "and",
    "writes",
    "vectors",
    "to",
    "parquet",
    "files",
    "while",
    "streaming",
    "batches",
    "through",
    "an",
    "accelerator",
    "pool",
    "query",
    "engine",
    "schedules",
    "tasks",
    "on",
    "cpu",
    "workers",
    "memory",
    "budget",
    "keeps",
    "blocks",
    "bounded",
    "lineage",
    "recomputes",
    "lost",
    "partitions",
    "quickly",
    "researchers",
    "trained",
    "networks",
    "millions",
    "images",
    "weather",
    "market",
    "fell",
    "sharply",
    "monday",
    "guitar",
    "stage",
    "password",
    "reset",
    "city",
    "river",
    "mountain",
    "coffee",
    "morning",
    "children",
    "played",
    "football",
    "park",
    "scientists",
    "discovered",
    "new",
    "species",
    "ocean",
    "deep",
    "computer",
    "science",
    "students",
    "learn",
    "rust",
    "programming",
    "fast",
    "safe",
    "concurrent",
    "systems",
    "data",
    "lakehouse",
    "delta",
    "iceberg",
    "storage",
    "object",
    "café",
    "naïve",
    "résumé",
    "über",
    "straße",
    "北京",
    "東京",
    "данные",
    "модель",
    "🚀",
    "✨",
    "1234",
    "3.14",
    "e-mail",
    "http://example.org/x?y=1",
    "don't",
    "can't",
    "supercalifragilistic",
];

/// Deterministic sentences of mixed length: most short, some long enough to be truncated.
fn sentences(n: usize) -> Vec<String> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|_| {
            let bucket = next() % 100;
            let words = match bucket {
                0..70 => 5 + next() % 16,
                70..90 => 20 + next() % 41,
                _ => 60 + next() % 241,
            };
            let mut s: Vec<&str> = (0..words)
                .map(|_| WORDS[(next() % WORDS.len() as u64) as usize])
                .collect();
            s[0] = "The";
            s.join(" ") + "."
        })
        .collect()
}

struct Args {
    device: String,
    sentences: usize,
    threads: usize,
    batch_sizes: Vec<usize>,
    python: String,
    /// Run the generated sentences.
    sentences_corpus: bool,
    /// Run the demo documents, and how many.
    docs_corpus: bool,
    docs: usize,
    /// `flumen.preprocess_on_cpu` values to run flumen with.
    preprocess: Vec<bool>,
    /// The device's peak in TFLOP/s (e.g. 989 for an H100/H200's dense bf16 tensor cores,
    /// 67 for its fp32 cores), to print the share of it flumen reaches.
    peak_tflops: Option<f64>,
    /// `flumen.embed_precision` values to run, each against the baseline at the matching
    /// precision (fp32, or half for bf16).
    precisions: Vec<EmbedPrecision>,
    /// `flumen.accelerator_slots` of flumen's side.
    accelerator_slots: usize,
    /// `flumen.embed_passes_in_flight` values to run flumen with.
    passes_in_flight: Vec<usize>,
}

fn parse_args() -> Args {
    let mut args = Args {
        device: "cpu".into(),
        sentences: 10_000,
        threads: flumen::config::available_cores(),
        batch_sizes: vec![],
        python: std::env::var("FLUMEN_BENCH_PYTHON").unwrap_or_else(|_| "python3".into()),
        sentences_corpus: true,
        docs_corpus: true,
        docs: 600,
        preprocess: vec![true],
        peak_tflops: None,
        precisions: vec![EmbedPrecision::Fp32],
        accelerator_slots: 1,
        passes_in_flight: vec![FlumenConfig::default().embed_passes_in_flight],
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--device" => args.device = value(),
            "--sentences" => args.sentences = value().parse().expect("--sentences N"),
            "--threads" => args.threads = value().parse().expect("--threads N"),
            "--batch-sizes" => {
                args.batch_sizes = value()
                    .split(',')
                    .map(|b| b.parse().expect("batch size"))
                    .collect()
            }
            "--python" => args.python = value(),
            "--corpus" => {
                let corpus = value();
                args.sentences_corpus = matches!(corpus.as_str(), "sentences" | "both");
                args.docs_corpus = matches!(corpus.as_str(), "docs" | "both");
                assert!(
                    args.sentences_corpus || args.docs_corpus,
                    "--corpus sentences|docs|both"
                );
            }
            "--docs" => args.docs = value().parse().expect("--docs N"),
            "--peak-tflops" => {
                args.peak_tflops = Some(value().parse().expect("--peak-tflops TFLOPS"))
            }
            "--preprocess-on-cpu" => {
                args.preprocess = match value().as_str() {
                    "true" => vec![true],
                    "false" => vec![false],
                    "both" => vec![true, false],
                    other => panic!("--preprocess-on-cpu true|false|both, got {other}"),
                }
            }
            "--precision" => {
                args.precisions = match value().as_str() {
                    "both" => vec![EmbedPrecision::Fp32, EmbedPrecision::Bf16],
                    one => vec![one.parse().expect("--precision fp32|bf16|both")],
                }
            }
            "--accelerator-slots" => {
                args.accelerator_slots = value().parse().expect("--accelerator-slots N")
            }
            "--passes-in-flight" => {
                args.passes_in_flight = match value().as_str() {
                    "both" => vec![2, 1],
                    one => vec![one.parse().expect("--passes-in-flight 1|2|both")],
                }
            }
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// Sentences per second for `SELECT embed(body) FROM sentences` at one batch size (0: by
/// tokens, tuned), with or without the tokenizer as a CPU step.
async fn flumen_rate(
    args: &Args,
    texts: &[String],
    batch_size: usize,
    preprocess_on_cpu: bool,
    precision: EmbedPrecision,
    passes_in_flight: usize,
) -> Result<f64> {
    let mut config = FlumenConfig::default();
    config.embed_precision = precision;
    config.embed_passes_in_flight = passes_in_flight;
    config.cpu_slots = args.threads;
    config.accelerator_slots = args.accelerator_slots.max(1);
    config.accelerator_min_slots = config.accelerator_slots;
    config.embed_batch_size = batch_size;
    config.preprocess_on_cpu = if preprocess_on_cpu {
        flumen::config::PreprocessOnCpu::Always
    } else {
        flumen::config::PreprocessOnCpu::Never
    };
    config.device = args.device.parse()?;
    let ctx = flumen::session(config);
    let schema = Arc::new(Schema::new(vec![Field::new("body", DataType::Utf8, false)]));
    // One partition per CPU slot, as a Parquet table of as many splits would be read: the
    // CPU step (the tokenizer) runs in every slot, not in one task.
    let partitions = args.threads.max(1);
    let chunk_rows = texts.len().div_ceil(partitions).clamp(1, 2048);
    let mut batches: Vec<Vec<RecordBatch>> = vec![vec![]; partitions];
    for (i, chunk) in texts.chunks(chunk_rows).enumerate() {
        batches[i % partitions].push(RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(StringArray::from_iter_values(chunk.iter()))],
        )?);
    }
    let table = MemTable::try_new(Arc::clone(&schema), batches)?;
    ctx.register_table("sentences", Arc::new(table))?;
    // Warm up: the worker loads the model once and keeps it.
    ctx.sql("SELECT embed(body) FROM sentences LIMIT 64")
        .await?
        .collect()
        .await?;
    let start = Instant::now();
    let out = ctx
        .sql("SELECT embed(body) AS v FROM sentences")
        .await?
        .collect()
        .await?;
    let seconds = start.elapsed().as_secs_f64();
    let rows: usize = out.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, texts.len());
    Ok(rows as f64 / seconds)
}

/// sentence-transformers' sentences per second at `batch_size`; an error says why the
/// baseline could not run (the bench then fails: a ratio needs both sides).
fn baseline_rate(
    args: &Args,
    texts: &[String],
    batch_size: usize,
    precision: EmbedPrecision,
) -> Result<f64> {
    let fail = |why: String| datafusion::error::DataFusionError::Execution(why);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sentences.jsonl");
    let mut file = std::fs::File::create(&path)?;
    for t in texts {
        writeln!(
            file,
            "{}",
            serde_json::to_string(t).map_err(|e| fail(e.to_string()))?
        )?;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/embed_baseline.py");
    let out = Command::new(&args.python)
        .arg(script)
        .arg(&path)
        .arg(model_files::model_dir(""))
        .arg(&args.device)
        .arg(args.threads.to_string())
        .arg(batch_size.to_string())
        .arg(match precision {
            EmbedPrecision::Bf16 => "half",
            _ => "fp32",
        })
        .output()
        .map_err(|e| fail(format!("baseline: cannot run {}: {e}", args.python)))?;
    if !out.status.success() {
        return Err(fail(format!(
            "baseline failed (install sentence-transformers for {}): {}",
            args.python,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{}", text.trim());
    text.split_whitespace()
        .find_map(|kv| kv.strip_prefix("per_s="))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| fail(format!("baseline printed no per_s=: {}", text.trim())))
}

/// The model's work per text: the mean tokens of `texts` as its tokenizer cuts them
/// (truncation and the two special tokens included), and the FLOPs per token of a forward
/// pass at that length (2 per multiply-add: per layer the Q, K, V and output projections,
/// the two feed-forward matrices, and attention's scores and weighted sum over the text's
/// tokens; the embedding lookup and the pooling are not counted).
fn work_per_text(texts: &[String]) -> Result<(f64, f64)> {
    let dir = model_files::model_dir("");
    let tokenizer = flumen::functions::embedding::tokenizer::SentenceTokenizer::load(&dir)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let tokens: usize = tokenizer.encode(&refs)?.iter().map(Vec::len).sum();
    let tokens = tokens as f64 / texts.len().max(1) as f64;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
    let field = |name: &str| config[name].as_f64().unwrap_or(0.0);
    let (hidden, intermediate) = (field("hidden_size"), field("intermediate_size"));
    let per_layer = 4.0 * hidden * hidden + 2.0 * hidden * intermediate + 2.0 * tokens * hidden;
    Ok((tokens, 2.0 * field("num_hidden_layers") * per_layer))
}

/// The roofline line of a corpus: the FLOP/s flumen's rate means, and its share of the
/// device's peak when `--peak-tflops` gives it.
fn print_roofline(args: &Args, corpus: &str, texts: &[String], per_s: f64) -> Result<()> {
    let (tokens, flops) = work_per_text(texts)?;
    let tflops = per_s * tokens * flops / 1e12;
    let share = match args.peak_tflops {
        Some(peak) => format!(
            " = {:.1}% of the {peak} TFLOP/s peak",
            100.0 * tflops / peak
        ),
        None => " (--peak-tflops P: its share of the device's peak)".into(),
    };
    println!(
        "{corpus} roofline: {tokens:.1} tokens/text x {:.1} MFLOP/token x {per_s:.1} texts/s \
         = {tflops:.3} TFLOP/s{share}",
        flops / 1e6
    );
    Ok(())
}

/// The best `(batch size, rate)` of `rates`.
fn best(rates: &[(usize, f64)]) -> (usize, f64) {
    rates
        .iter()
        .copied()
        .fold((0, 0.0), |b, r| if r.1 > b.1 { r } else { b })
}

/// The first `n` demo documents (`flumen::demo`) through `clean_text`, as a model sees them.
async fn cleaned_docs(n: usize) -> Result<Vec<String>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, n)?;
    let ctx = flumen::session(FlumenConfig::default());
    ctx.register_parquet("docs", path.to_string_lossy().as_ref(), Default::default())
        .await?;
    let sql = "SELECT clean_text(body) AS t FROM docs ORDER BY id";
    let batches = ctx.sql(sql).await?.collect().await?;
    Ok(batches
        .iter()
        .flat_map(|b| {
            let column = datafusion::arrow::array::AsArray::as_string::<i32>(b.column(0));
            column
                .iter()
                .map(|t| t.unwrap_or_default().to_string())
                .collect::<Vec<_>>()
        })
        .collect())
}

/// Both sides over one corpus at every batch size (and flumen with each `preprocess`
/// setting); prints a line per run and the corpus's summary line.
async fn run_corpus(args: &Args, corpus: &str, texts: &[String]) -> Result<()> {
    for &precision in &args.precisions {
        run_corpus_in(args, corpus, texts, precision).await?;
    }
    Ok(())
}

/// [`run_corpus`] at one `flumen.embed_precision`.
async fn run_corpus_in(
    args: &Args,
    corpus: &str,
    texts: &[String],
    precision: EmbedPrecision,
) -> Result<()> {
    let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    println!(
        "embed bench: {corpus}: {} texts ({} chars on average), device {}, {} threads, {precision}, \
         {} accelerator workers",
        texts.len(),
        chars / texts.len().max(1),
        args.device,
        args.threads,
        args.accelerator_slots
    );
    let default_batch = FlumenConfig::default().embed_batch_size;
    let sizes = if args.batch_sizes.is_empty() {
        vec![default_batch]
    } else {
        args.batch_sizes.clone()
    };
    // Both sides at every batch size, so each ratio compares like with like; flumen's 0 (by
    // tokens, tuned) against sentence-transformers' default of 32.
    let baseline_size = |size: usize| if size == 0 { 32 } else { size };
    let (mut flumen_rates, mut baseline_rates) = (vec![], vec![]);
    for &size in &sizes {
        let mut rates = vec![];
        for &preprocess in &args.preprocess {
            let mut by_passes = vec![];
            for &passes in &args.passes_in_flight {
                let rate = flumen_rate(args, texts, size, preprocess, precision, passes).await?;
                println!(
                    "{corpus} batch_size={size} preprocess_on_cpu={preprocess} \
                     passes_in_flight={passes} flumen_per_s={rate:.1}"
                );
                by_passes.push((passes, rate));
            }
            if let [(2, two), (1, one)] = by_passes[..] {
                println!(
                    "{corpus} batch_size={size} preprocess_on_cpu={preprocess} \
                     two_passes_in_flight_vs_one={:.2}",
                    two / one
                );
            }
            rates.push((preprocess, by_passes[0].1));
        }
        if let [(true, on), (false, off)] = rates[..] {
            println!(
                "{corpus} batch_size={size} tokenize_on_cpu_vs_in_worker={:.2}",
                on / off
            );
        }
        let flumen = rates[0].1;
        print_roofline(args, corpus, texts, flumen)?;
        let baseline = baseline_rate(args, texts, baseline_size(size), precision)?;
        println!(
            "{corpus} batch_size={size} flumen_per_s={flumen:.1} baseline_per_s={baseline:.1} \
             (at {}) ratio={:.2}",
            baseline_size(size),
            flumen / baseline
        );
        flumen_rates.push((size, flumen));
        baseline_rates.push((baseline_size(size), baseline));
    }
    // The headline is at flumen's default batch size when it ran, else the first size; the
    // best of each side (each at its own best size) is reported beside it.
    let at = sizes.iter().position(|s| *s == default_batch).unwrap_or(0);
    let (size, flumen) = flumen_rates[at];
    let baseline = baseline_rates[at].1;
    let (flumen_best_size, flumen_best) = best(&flumen_rates);
    let (baseline_best_size, baseline_best) = best(&baseline_rates);
    println!(
        "embed corpus={corpus} device={} precision={precision} batch_size={size} flumen_per_s={flumen:.1} \
         baseline_per_s={baseline:.1} ratio={:.2} best_flumen_per_s={flumen_best:.1}@{flumen_best_size} \
         best_baseline_per_s={baseline_best:.1}@{baseline_best_size} best_ratio={:.2}",
        args.device,
        flumen / baseline,
        flumen_best / baseline_best
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args();
    if args.sentences_corpus {
        run_corpus(&args, "sentences", &sentences(args.sentences)).await?;
    }
    if args.docs_corpus {
        run_corpus(&args, "docs", &cleaned_docs(args.docs).await?).await?;
    }
    Ok(())
}
