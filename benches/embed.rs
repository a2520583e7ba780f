//! Embedding throughput: flumen's `embed()` against sentence-transformers on the same
//! machine, cores and sentences, in the same run.
//!
//! ```text
//! cargo bench --bench embed -- [--device cpu|cuda] [--sentences 10000] [--threads N]
//!                              [--batch-sizes 32,64,128] [--python PATH]
//! ```
//!
//! The baseline is `benches/embed_baseline.py`, run with `--python` (default: `$FLUMEN_BENCH_PYTHON`
//! or `python3`), which needs sentence-transformers installed (e.g. in a venv). The last line
//! is machine-readable: `embed device=cpu flumen_per_s=N baseline_per_s=N ratio=X.XX`.

use std::io::Write;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::StringArray;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use flumen::FlumenConfig;
use flumen::embedding::model_files;

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
}

fn parse_args() -> Args {
    let mut args = Args {
        device: "cpu".into(),
        sentences: 10_000,
        threads: flumen::config::available_cores(),
        batch_sizes: vec![],
        python: std::env::var("FLUMEN_BENCH_PYTHON").unwrap_or_else(|_| "python3".into()),
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
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// Sentences per second for `SELECT embed(body) FROM sentences` at one batch size.
async fn flumen_rate(args: &Args, texts: &[String], batch_size: usize) -> Result<f64> {
    let mut config = FlumenConfig::default();
    config.cpu_slots = args.threads;
    config.accelerator_slots = 1;
    config.embed_batch_size = batch_size;
    config.device = args.device.parse()?;
    let ctx = flumen::session(config);
    let schema = Arc::new(Schema::new(vec![Field::new("body", DataType::Utf8, false)]));
    let batches: Vec<RecordBatch> = texts
        .chunks(2048)
        .map(|chunk| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(StringArray::from_iter_values(chunk.iter()))],
            )
        })
        .collect::<std::result::Result<_, _>>()?;
    let table = MemTable::try_new(Arc::clone(&schema), vec![batches])?;
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

fn baseline_rate(args: &Args, texts: &[String]) -> Option<f64> {
    let dir = tempfile::tempdir().ok()?;
    let path = dir.path().join("sentences.jsonl");
    let mut file = std::fs::File::create(&path).ok()?;
    for t in texts {
        writeln!(file, "{}", serde_json::to_string(t).ok()?).ok()?;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/embed_baseline.py");
    let output = Command::new(&args.python)
        .arg(script)
        .arg(&path)
        .arg(model_files::model_dir(""))
        .arg(&args.device)
        .arg(args.threads.to_string())
        .output();
    match output {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            println!("{}", text.trim());
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix("per_s="))
                .and_then(|v| v.parse().ok())
        }
        Ok(out) => {
            eprintln!(
                "baseline failed (install sentence-transformers for {}): {}",
                args.python,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            None
        }
        Err(e) => {
            eprintln!("baseline: cannot run {}: {e}", args.python);
            None
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args();
    let texts = sentences(args.sentences);
    let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    println!(
        "embed bench: {} sentences ({} chars on average), device {}, {} threads",
        texts.len(),
        chars / texts.len().max(1),
        args.device,
        args.threads
    );
    let default_batch = FlumenConfig::default().embed_batch_size;
    let sizes = if args.batch_sizes.is_empty() {
        vec![default_batch]
    } else {
        args.batch_sizes.clone()
    };
    let mut rates = vec![];
    for &size in &sizes {
        let rate = flumen_rate(&args, &texts, size).await?;
        println!("flumen embed_batch_size={size} sentences_per_s={rate:.1}");
        rates.push((size, rate));
    }
    // The figure reported is the default batch size's when it was run, else the best.
    let best = rates
        .iter()
        .find(|(size, _)| *size == default_batch)
        .map(|(_, rate)| *rate)
        .unwrap_or_else(|| rates.iter().map(|(_, r)| *r).fold(0.0, f64::max));
    let baseline = baseline_rate(&args, &texts);
    let (baseline_text, ratio) = match baseline {
        Some(b) => (format!("{b:.1}"), format!("{:.2}", best / b)),
        None => ("nan".into(), "nan".into()),
    };
    println!(
        "embed device={} flumen_per_s={best:.1} baseline_per_s={baseline_text} ratio={ratio}",
        args.device
    );
    Ok(())
}
