//! The heterogeneous batch-inference pipeline: Parquet → CPU preprocessing → accelerator
//! model(s) → Parquet, in four execution modes, several interleaved runs each (the question of
//! the Ray Data paper, arXiv 2501.12407, asked of flumen).
//!
//! ```text
//! cargo bench --bench pipeline -- [--full] [--rows N] [--runs N] [--pipelines two|three|both]
//!     [--accelerator auto|emulated|cuda|cpu] [--service-us N] [--batch-rows N] [--mem-scale N]
//!     [--skip-memory] [--skip-sweep] [--modes vanilla,batch,static] [--warm]
//!     [--first-block-rows N] [--block-rows N] [--piece-rows N]
//!     [--split-bytes N] [--timeline PATH] [--alone-rows N]
//!     [--three-rows N] [--post-layers N] [--long-factor N]
//!     [--a-batch-us N] [--a-per-kib-us N] [--b-service-us N] [--precision fp32|bf16]
//! ```
//!
//! Two pipelines over flumen's demo documents (HTML pages; `clean_text` is flumen's real text
//! preprocessing: markup, entities, NFKC, whitespace):
//! - **two stages**: `SELECT id, model(clean_text(body)) FROM docs` (`--rows`, default
//!   100,000; `--full`: 1,000,000). `model` is one emulated device busy for `--service-us`
//!   per batch of `--batch-rows` rows without using a CPU core
//!   (`flumen::emulated_accelerator`), or flumen's real `embed` on CUDA (`--accelerator
//!   cpu`: on the CPU, to try the real-model path without a GPU), in
//!   `flumen.embed_precision` `--precision` (`fp32`; `bf16` on tensor cores), the plain
//!   loop of the bound in the same precision.
//! - **three stages**: `SELECT id, model_b(post(model_a(clean_text(body)))) FROM docs`
//!   (`--three-rows`, default 60,000), two emulated models on devices of their own with a CPU
//!   stage between them: `model_a` costs `--a-batch-us` per batch plus `--a-per-kib-us` per
//!   KiB of cleaned text (its cost follows document length), `post` is `--post-layers` dense
//!   384x384 layers on the CPU (a projection head: fixed cost per row), `model_b` costs
//!   `--b-service-us` per batch. The documents' length shifts half-way (the second half are
//!   pages `--long-factor` times longer), so the CPU work moves from `post` to `clean_text`
//!   during the run: the best split of the CPU slots is not even, and changes.
//!
//! Modes, each in a child process of this binary (so peak RSS is its own): vanilla DataFusion
//! with the same functions inline (its `target_partitions` swept first, its best used), flumen
//! `batch` (stage by stage), `static` (each pool's slots split evenly over its operators) and
//! `streaming` (`--modes` picks some; streaming always runs). The query's output is written
//! to Parquet as it arrives, as a training job's loader would consume it.
//!
//! The bound is measured outside flumen, so no scheduler overhead counts as necessary work:
//! the CPU work per row is the least of one thread running every function in a plain loop
//! (Parquet decode, the functions, the models' host work, the Parquet writer) and vanilla
//! DataFusion with zero-time devices (with the real embedding model, the plain loop alone:
//! it runs the model's tokenizer, which a zero-time device would skip); each emulated
//! device's time is its batches' cost with every batch full, the real model's the time of
//! its calls when a plain loop calls it directly on flumen's blocks of the same inputs
//! (`common/model_alone.rs`, whose vectors every mode's output is checked against at cosine
//! ≥ 0.9999); the writer is a serial stage. Time can be no less than the largest of CPU
//! work over the cores, each device's time and the writer's; and the writer's close, which
//! writes out the last row group (the rows that arrive last), follows the last device batch
//! and the last CPU work: the bound adds it to each device's time and to the CPU time
//! (run alone, on one core, after the rest). The table also gives the share of the busiest
//! resource's time alone.
//!
//! Results: a table per pipeline with the median and spread of the runs, the devices' idle
//! gaps between batches, the goals met or not, `target/pipeline-bench/pipeline-*.svg` (rows
//! done and utilisation over time, last run of each mode) and a last machine-readable line
//! per pipeline.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::{DataType, Float32Type, Int64Type};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::ScalarUDF;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use flumen::functions::emulated_accelerator::{EmulatedDevice, EmulatedModel};
use flumen::{AcceleratorFunction, AcceleratorWorker, ExecMode, FlumenConfig, WorkerResources};
use futures::StreamExt;
use serde_json::{Value, json};

#[path = "common/model_alone.rs"]
mod model_alone;
#[path = "common/pipeline_stages.rs"]
mod pipeline_stages;
/// Only `peak_bytes`: a child's own peak RSS. `getrusage`'s `ru_maxrss` kept the parent's
/// peak across fork and exec (children spawned after the parent generated the input reported
/// the parent's 494 MiB in every mode).
#[path = "common/rss.rs"]
#[allow(dead_code)]
mod rss;
#[path = "common/verdict.rs"]
mod verdict;
use pipeline_stages::{LoopStage, Post, gap_stats};

const TWO_STAGE_SQL: &str = "SELECT id, model(clean_text(body)) AS v FROM docs";
const THREE_STAGE_SQL: &str = "SELECT id, model_b(post(model_a(clean_text(body)))) AS v FROM docs";
const MODES: [&str; 4] = ["vanilla", "batch", "static", "streaming"];
const SWEEP: [usize; 4] = [1, 2, 4, 8];
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Which pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pipeline {
    Two,
    Three,
}

impl Pipeline {
    fn name(self) -> &'static str {
        match self {
            Self::Two => "two",
            Self::Three => "three",
        }
    }
    fn sql(self) -> &'static str {
        match self {
            Self::Two => TWO_STAGE_SQL,
            Self::Three => THREE_STAGE_SQL,
        }
    }
    fn parse(text: &str) -> Self {
        match text {
            "two" | "2" => Self::Two,
            "three" | "3" => Self::Three,
            other => panic!("--pipeline two|three, got {other}"),
        }
    }
}

/// Command-line settings.
#[derive(Debug, Clone)]
struct Args {
    rows: usize,
    three_rows: usize,
    runs: usize,
    pipelines: Vec<Pipeline>,
    accelerator: String,
    service_us: u64,
    batch_rows: usize,
    dims: usize,
    mem_scale: usize,
    skip_memory: bool,
    skip_sweep: bool,
    /// `--modes`: the modes measured, in `MODES` order; `streaming` always (the goals are
    /// its figures). Fewer modes make a run on a lent GPU fit its time; a ratio against a
    /// mode left out prints as `NaN`.
    modes: Vec<&'static str>,
    /// `--warm`: each child first runs the query over a few rows (loading the model; a
    /// session's later query finds it loaded), and the measured run starts after that.
    warm: bool,
    /// `flumen.first_block_rows` for flumen's modes (`None`: flumen's default).
    first_block_rows: Option<usize>,
    /// `flumen.timeline_file` for flumen's modes: each run writes its task timeline there
    /// (`PATH` gets `-<pipeline>-<mode>.json` appended; the last run of each mode stays).
    timeline: Option<PathBuf>,
    /// `flumen.target_block_rows` for flumen's modes (`None`: flumen's default).
    block_rows: Option<usize>,
    /// `flumen.model_piece_rows` (`--piece-rows`).
    piece_rows: Option<usize>,
    /// `flumen.model_split_bytes` (`--split-bytes`, bytes).
    split_bytes: Option<u64>,
    post_layers: usize,
    long_factor: usize,
    a_batch_us: u64,
    a_per_kib_us: u64,
    b_service_us: u64,
    out: PathBuf,
    /// Internal: run one mode of `pipeline` over `input` and print its result.
    child: Option<String>,
    pipeline: Pipeline,
    input: Option<PathBuf>,
    target_partitions: Option<usize>,
    zero_device: bool,
    /// `--alone-rows N`: the plain loop that measures each stage alone reads only the first
    /// rows, at least N ([`sample_rows`]), and its costs are scaled to all rows (two-stage
    /// pipeline only). For long runs whose CPU work is far from the bottleneck: on a GPU's
    /// host the loop tokenizes every document on one thread, ~7.5 minutes at 1M rows.
    alone_rows: Option<usize>,
    /// `--precision`: `flumen.embed_precision` of the real model, in every mode and in the
    /// bound's plain loop.
    precision: flumen::EmbedPrecision,
}

/// `--modes a,b,...`: the named modes, in `MODES` order, with `streaming` added.
fn parse_modes(list: &str) -> Vec<&'static str> {
    let named: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(unknown) = named.iter().find(|m| !MODES.contains(m)) {
        panic!(
            "--modes: unknown mode {unknown} (modes: {})",
            MODES.join(",")
        );
    }
    MODES
        .into_iter()
        .filter(|m| *m == "streaming" || named.contains(m))
        .collect()
}

fn parse_args() -> Args {
    let mut args = Args {
        rows: 100_000,
        three_rows: 60_000,
        runs: 3,
        pipelines: vec![Pipeline::Two, Pipeline::Three],
        accelerator: "auto".into(),
        service_us: 5_000,
        batch_rows: 256,
        dims: 384,
        mem_scale: 10,
        skip_memory: false,
        skip_sweep: false,
        modes: MODES.to_vec(),
        warm: false,
        precision: flumen::EmbedPrecision::Fp32,
        first_block_rows: None,
        timeline: None,
        block_rows: None,
        piece_rows: None,
        split_bytes: None,
        post_layers: 2,
        long_factor: 10,
        a_batch_us: 1_000,
        a_per_kib_us: 10,
        b_service_us: 3_000,
        out: PathBuf::from("target/pipeline-bench"),
        child: None,
        pipeline: Pipeline::Two,
        input: None,
        target_partitions: None,
        zero_device: false,
        alone_rows: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        let mut number = || value().parse::<u64>().unwrap_or_else(|_| panic!("{a} N"));
        match a.as_str() {
            "--full" => args.rows = 1_000_000,
            "--rows" => args.rows = number() as usize,
            "--three-rows" => args.three_rows = number() as usize,
            "--runs" => args.runs = (number() as usize).max(1),
            "--pipelines" => {
                args.pipelines = match value().as_str() {
                    "both" => vec![Pipeline::Two, Pipeline::Three],
                    one => vec![Pipeline::parse(one)],
                }
            }
            "--accelerator" => args.accelerator = value(),
            "--service-us" => args.service_us = number(),
            "--batch-rows" => args.batch_rows = number() as usize,
            "--dims" => args.dims = number() as usize,
            "--mem-scale" => args.mem_scale = number() as usize,
            "--skip-memory" => args.skip_memory = true,
            "--skip-sweep" => args.skip_sweep = true,
            "--warm" => args.warm = true,
            "--precision" => args.precision = value().parse().expect("--precision fp32|bf16|auto"),
            "--modes" => args.modes = parse_modes(&value()),
            "--first-block-rows" => args.first_block_rows = Some(number() as usize),
            "--timeline" => args.timeline = Some(PathBuf::from(value())),
            "--block-rows" => args.block_rows = Some(number() as usize),
            "--piece-rows" => args.piece_rows = Some(number() as usize),
            "--split-bytes" => args.split_bytes = Some(number()),
            "--post-layers" => args.post_layers = number() as usize,
            "--long-factor" => args.long_factor = number() as usize,
            "--a-batch-us" => args.a_batch_us = number(),
            "--a-per-kib-us" => args.a_per_kib_us = number(),
            "--b-service-us" => args.b_service_us = number(),
            "--out" => args.out = PathBuf::from(value()),
            "--child" => args.child = Some(value()),
            "--pipeline" => args.pipeline = Pipeline::parse(&value()),
            "--input" => args.input = Some(PathBuf::from(value())),
            "--target-partitions" => args.target_partitions = Some(number() as usize),
            "--zero-device" => args.zero_device = true,
            "--alone-rows" => args.alone_rows = Some(number() as usize),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

fn main() -> Result<()> {
    let mut args = parse_args();
    if let Some(mode) = args.child.clone() {
        let result = run_child(&args, &mode)?;
        println!("RESULT {result}");
        return Ok(());
    }
    if args.accelerator == "auto" {
        args.accelerator = if flumen::functions::embedding::cuda_driver::cuda_available() {
            "cuda".into()
        } else {
            "emulated".into()
        };
    }
    std::fs::create_dir_all(&args.out)?;
    for pipeline in args.pipelines.clone() {
        if pipeline == Pipeline::Three && args.accelerator != "emulated" {
            verdict::not_measured(
                "three-stage pipeline",
                "its models are emulated; run with --accelerator emulated",
            );
            continue;
        }
        run_pipeline(&args, pipeline)?;
    }
    verdict::finish();
    Ok(())
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// Median and (min, max) of some figures.
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    (median, values[0], values[n - 1])
}

/// `median [min–max]` of a figure over runs.
fn show(values: Vec<f64>, decimals: usize) -> String {
    let (median, min, max) = spread(values);
    format!("{median:.decimals$} [{min:.decimals$}–{max:.decimals$}]")
}

/// A device's busy seconds in a child's result.
fn device_busy(r: &Value, k: usize) -> f64 {
    f(&r["devices"][k], "busy_s")
}

/// A ratio's verdict: `met`, `NOT met`, or `not measured` where `--modes` left a mode out
/// (the ratio is NaN).
fn verdict(name: &str, ratio: f64, met: bool) -> &'static str {
    if ratio.is_nan() {
        verdict::not_measured(name, "--modes left a mode out");
        "not measured (--modes)"
    } else {
        ok(name, met)
    }
}

fn ok(name: &str, met: bool) -> &'static str {
    verdict::goal(name, met)
}

/// The rows a sampled plain loop reads: at least `least`, and as many past whole row groups
/// of the output as `rows` leaves in its last one, so the sample's last row group, which the
/// writer's close writes out and which is not scaled, is the size of the full run's.
fn sample_rows(rows: usize, least: usize) -> usize {
    let last_group = rows % OUTPUT_ROW_GROUP_ROWS;
    let groups = least
        .saturating_sub(last_group)
        .div_ceil(OUTPUT_ROW_GROUP_ROWS);
    (last_group + groups * OUTPUT_ROW_GROUP_ROWS).min(rows)
}

/// Measure one pipeline: the bound, the vanilla sweep, `--runs` interleaved rounds of the
/// modes, the idle gaps, memory at 10x the rows (two stages), and print it all.
fn run_pipeline(args: &Args, pipeline: Pipeline) -> Result<()> {
    let cores = flumen::config::available_cores() as f64;
    let (rows, input) = match pipeline {
        Pipeline::Two => {
            let input = args.out.join(format!("docs-{}.parquet", args.rows));
            ensure_file(&input, args.rows, |p| {
                flumen::demo::write_docs(p, args.rows)
            })?;
            (args.rows, input)
        }
        Pipeline::Three => {
            let rows = args.three_rows;
            let input = args
                .out
                .join(format!("docs-shift-{rows}-x{}.parquet", args.long_factor));
            ensure_file(&input, rows, |p| {
                pipeline_stages::write_shifted_docs(p, rows, args.long_factor)
            })?;
            (rows, input)
        }
    };
    println!("\n## pipeline: {}", pipeline.sql());
    match pipeline {
        Pipeline::Two => println!(
            "  rows={rows} accelerator={} {} cores={cores} runs={}",
            args.accelerator,
            if args.accelerator == "emulated" {
                format!(
                    "(emulated: {} us per batch of {} rows, one device)",
                    args.service_us, args.batch_rows
                )
            } else {
                format!("(real embed, device {})", args.accelerator)
            },
            args.runs
        ),
        Pipeline::Three => println!(
            "  rows={rows} (second half {}x longer) model_a: {} us/batch + {} us/KiB, post: {} \
             layers of 384x384, model_b: {} us/batch; batches of {} rows; cores={cores} runs={}",
            args.long_factor,
            args.a_batch_us,
            args.a_per_kib_us,
            args.post_layers,
            args.b_service_us,
            args.batch_rows,
            args.runs
        ),
    }

    let explain = spawn_child(args, pipeline, "explain", &input, None, false)?;
    println!(
        "\nflumen's plan (streaming):\n{}",
        explain["plan"].as_str().unwrap_or("?")
    );

    // Each stage alone, outside flumen's scheduler.
    let alone_args = Args {
        alone_rows: args.alone_rows.map(|least| sample_rows(rows, least)),
        ..args.clone()
    };
    let mut alone = spawn_child(&alone_args, pipeline, "alone", &input, None, false)?;
    let sampled_rows = f(&alone, "rows");
    if sampled_rows > 0.0 && sampled_rows < rows as f64 {
        pipeline_stages::scale_stage_costs(&mut alone, rows as f64 / sampled_rows);
    }
    let vanilla_cpu = spawn_child(
        args,
        pipeline,
        "vanilla",
        &input,
        Some(cores as usize),
        true,
    )?;
    // Vanilla's zero-time devices skip a real model's CPU step (the tokenizer), so with a
    // real model the plain loop alone, which runs it, measures the CPU work.
    let cpu_s = if args.accelerator != "emulated" && pipeline == Pipeline::Two {
        f(&alone, "cpu_s")
    } else {
        f(&alone, "cpu_s").min(f(&vanilla_cpu, "cpu_s"))
    };
    let writer_s = f(&alone, "writer_s");
    let mut devices: Vec<(String, f64)> = alone["devices"]
        .as_array()
        .map(|d| {
            d.iter()
                .map(|d| {
                    (
                        d["name"].as_str().unwrap_or("?").to_string(),
                        f(d, "device_s"),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let sample = if sampled_rows < rows as f64 {
        format!(", the first {sampled_rows:.0} of {rows} rows, scaled")
    } else {
        String::new()
    };
    print!(
        "\nstages alone (one thread, plain loop{sample}): decode {:.2}s",
        f(&alone, "decode_s")
    );
    for stage in alone["stages"].as_array().into_iter().flatten() {
        print!(
            ", {} {:.2}s{}",
            stage["name"].as_str().unwrap_or("?"),
            f(stage, "cpu_s"),
            if stage["model"].as_bool() == Some(true) {
                " (host)"
            } else {
                ""
            }
        );
    }
    println!(
        ", writer {:.2}s: {:.2} CPU s in all; vanilla with zero-time devices: {:.2} CPU s",
        writer_s,
        f(&alone, "cpu_s"),
        f(&vanilla_cpu, "cpu_s")
    );

    // Vanilla's best target_partitions.
    let mut best_tp = cores as usize;
    if !args.skip_sweep {
        let mut best_rate = 0.0;
        let mut line = String::from("vanilla target_partitions sweep:");
        for tp in SWEEP {
            let r = spawn_child(args, pipeline, "vanilla", &input, Some(tp), false)?;
            let rate = f(&r, "rows") / f(&r, "wall_s");
            line.push_str(&format!(" {tp}: {rate:.0} rows/s;"));
            if rate > best_rate {
                (best_rate, best_tp) = (rate, tp);
            }
        }
        println!("{line} best {best_tp}");
    }

    // Interleaved rounds: every mode once per round.
    let modes = &args.modes;
    let mut runs: Vec<Vec<Value>> = vec![vec![]; modes.len()];
    for round in 0..args.runs {
        eprintln!("  round {}/{}", round + 1, args.runs);
        for (k, mode) in modes.iter().enumerate() {
            let tp = (*mode == "vanilla").then_some(best_tp);
            runs[k].push(spawn_child(args, pipeline, mode, &input, tp, false)?);
        }
    }
    let reference = &runs[0][0];
    for r in runs.iter().flatten() {
        if r["checksum"] != reference["checksum"] || r["rows"] != reference["rows"] {
            return Err(DataFusionError::Execution(format!(
                "mode {} wrote rows={} checksum={}, {} rows={} checksum={}",
                r["mode"],
                r["rows"],
                r["checksum"],
                modes[0],
                reference["rows"],
                reference["checksum"]
            )));
        }
    }
    if args.accelerator != "emulated" {
        // A real device's time: the model called directly on the same inputs, outside
        // flumen's scheduler. Every mode's last output holds its vectors to the cosine.
        let alone = spawn_child(args, pipeline, "device", &input, None, false)?;
        let least_busy = runs
            .iter()
            .flatten()
            .map(|r| device_busy(r, 0))
            .fold(f64::INFINITY, f64::min);
        println!(
            "the model alone ({} blocks, one after another): {:.2}s of calls after a {:.2}s \
             load; flumen's model calls took {least_busy:.2}s at least",
            alone["blocks"],
            f(&alone, "device_s"),
            f(&alone, "load_s")
        );
        devices = vec![("model".into(), f(&alone, "device_s"))];
        for mode in modes {
            let output = args
                .out
                .join(format!("out-{}-{mode}.parquet", pipeline.name()));
            let least = model_alone::least_cosine(&output, &device_output(args, pipeline))?;
            println!("  {mode}: its vectors against the model alone's: least cosine {least:.6}");
            if least < 0.9999 {
                return Err(DataFusionError::Execution(format!(
                    "mode {mode} wrote a vector at cosine {least:.6} from the model alone's \
                     (at least 0.9999 expected)"
                )));
            }
        }
    }

    // The bound: no schedule takes less than the busiest resource's work. And none ends
    // before the writer's close after that work: the close writes out the last row group,
    // which holds the rows that arrive last, so it follows the last device batch and the
    // last CPU work, and overlaps nothing.
    let close_s = f(&alone, "writer_close_s");
    let mut resources = vec![
        ("cpu".to_string(), cpu_s / cores),
        ("writer".to_string(), writer_s),
    ];
    resources.extend(devices.iter().cloned());
    let busiest = |resources: &[(String, f64)]| {
        resources.iter().cloned().fold(
            ("none".to_string(), 0.0),
            |a, b| if b.1 > a.1 { b } else { a },
        )
    };
    let (_, resource_time) = busiest(&resources);
    let mut paths = vec![
        ("cpu".to_string(), (cpu_s - close_s) / cores + close_s),
        ("writer".to_string(), writer_s),
    ];
    paths.extend(devices.iter().map(|(name, s)| (name.clone(), s + close_s)));
    let (bottleneck, least_time) = busiest(&paths);
    let bound = rows as f64 / least_time;
    println!(
        "bound: {bound:.0} rows/s ({bottleneck}-bound, then the writer's close of its last row \
         group, {:.0} ms; the busiest resource alone: {:.0} rows/s)\n",
        1e3 * close_s,
        rows as f64 / resource_time
    );

    let rate = |r: &Value| f(r, "rows") / f(r, "wall_s");
    let mut header = String::from("| mode | rows/s | seconds | first row ms | cpu busy");
    for (name, _) in &devices {
        header.push_str(&format!(" | {name} busy"));
    }
    header.push_str(" | peak RSS MiB | % of bound |");
    println!("{header}");
    println!("{}", "|---".repeat(header.matches('|').count() - 1) + "|");
    for (mode, rs) in modes.iter().zip(&runs) {
        let each = |g: &dyn Fn(&Value) -> f64| rs.iter().map(g).collect::<Vec<_>>();
        let mut line = format!(
            "| {mode}{} | {} | {} | {} | {}",
            if *mode == "vanilla" {
                format!(" (tp={best_tp})")
            } else {
                String::new()
            },
            show(each(&rate), 0),
            show(each(&|r| f(r, "wall_s")), 2),
            show(each(&|r| 1e3 * f(r, "first_row_s")), 0),
            show(
                each(&|r| 100.0 * f(r, "cpu_s") / (f(r, "wall_s") * cores)),
                0
            ) + "%",
        );
        for k in 0..devices.len() {
            line.push_str(&format!(
                " | {}%",
                show(each(&|r| 100.0 * device_busy(r, k) / f(r, "wall_s")), 0)
            ));
        }
        line.push_str(&format!(
            " | {} | {}% |",
            show(each(&|r| f(r, "peak_rss_kb") / 1024.0), 0),
            show(each(&|r| 100.0 * rate(r) / bound), 0)
        ));
        println!("{line}");
    }
    // A mode's median rate (NaN for a mode `--modes` left out).
    let median_rate = |mode: &str| match modes.iter().position(|m| *m == mode) {
        Some(k) => spread(runs[k].iter().map(rate).collect()).0,
        None => f64::NAN,
    };
    let streaming = runs.last().expect("streaming is always measured");
    println!("\nidle gaps between consecutive batches on each device (streaming runs):");
    let mut gap_medians = vec![];
    for (k, (name, _)) in devices.iter().enumerate() {
        for r in streaming {
            let g = &r["devices"][k]["gaps"];
            gap_medians.push(f(g, "median_ms"));
            println!(
                "  {name}: median {:.2} ms, p90 {:.2} ms, max {:.1} ms, {} of {} gaps over 1 ms, {:.2} s idle between its first and last batch; busy from {:.3} s to {:.3} s; last batch written {:.3} s, stream ended {:.3} s, writer closed {:.3} s (its close: {:.0} ms of CPU), wall {:.3} s",
                f(g, "median_ms"),
                f(g, "p90_ms"),
                f(g, "max_ms"),
                g["over_1ms"],
                g["n"],
                f(g, "idle_s"),
                r["devices"][k]["span_s"][0].as_f64().unwrap_or(f64::NAN),
                r["devices"][k]["span_s"][1].as_f64().unwrap_or(f64::NAN),
                f(r, "last_batch_written_s"),
                f(r, "stream_ended_s"),
                f(r, "writer_closed_s"),
                1e3 * f(r, "writer_close_cpu_s"),
                f(r, "wall_s")
            );
            let largest: Vec<String> = r["devices"][k]["largest_gaps"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|g| {
                    let at = |i: usize| g[i].as_f64().unwrap_or(f64::NAN);
                    format!("{:.1} ms at {:.3} s", at(1), at(0))
                })
                .collect();
            if !largest.is_empty() {
                println!("    largest gaps: {}", largest.join(", "));
            }
            for load in r["devices"][k]["loads_s"].as_array().into_iter().flatten() {
                println!(
                    "    {name} loaded from {:.3} s to {:.3} s ({})",
                    load[0].as_f64().unwrap_or(f64::NAN),
                    load[1].as_f64().unwrap_or(f64::NAN),
                    load[2].as_str().unwrap_or_default()
                );
            }
        }
    }

    let pct_of_bound = 100.0 * median_rate("streaming") / bound;
    let pct_of_resources = 100.0 * median_rate("streaming") * resource_time / rows as f64;
    let first_row_ms = 1e3 * spread(streaming.iter().map(|r| f(r, "first_row_s")).collect()).0;
    let gap_ms = spread(gap_medians).0;
    println!(
        "\ngoals ({} pipeline, medians of {} runs):",
        pipeline.name(),
        args.runs
    );
    let mut summary = format!(
        "pipeline={} accelerator={} precision={} rows={rows} bound_rows_per_s={bound:.0} streaming_rows_per_s={:.0} pct_of_bound={pct_of_bound:.0} pct_of_resources={pct_of_resources:.0} speedup_vs_vanilla={:.2} speedup_vs_batch={:.2} speedup_vs_static={:.2} first_row_ms={first_row_ms:.0} gap_median_ms={gap_ms:.2}",
        pipeline.name(),
        args.accelerator,
        args.precision,
        median_rate("streaming"),
        median_rate("streaming") / median_rate("vanilla"),
        median_rate("streaming") / median_rate("batch"),
        median_rate("streaming") / median_rate("static")
    );
    match pipeline {
        Pipeline::Two => {
            println!(
                "  first output row {first_row_ms:.0} ms (goal ≤ 50): {}",
                ok("first output row ≤ 50 ms", first_row_ms <= 50.0)
            );
            println!(
                "  % of bound {pct_of_bound:.0}% (goal ≥ 95%): {} ({pct_of_resources:.0}% of the \
                 busiest resource's time alone)",
                ok("two-stage ≥ 95% of bound", pct_of_bound >= 95.0)
            );
        }
        Pipeline::Three => {
            // Stage by stage, each stage alone takes its own time: the CPU stages on every
            // core, each model its device's time plus its host work on one worker.
            let stage_cpu = |model: bool| -> f64 {
                alone["stages"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|s| s["model"].as_bool() == Some(model))
                    .map(|s| f(s, "cpu_s"))
                    .sum()
            };
            let batch_time = (f(&alone, "decode_s") + stage_cpu(false)) / cores
                + stage_cpu(true)
                + devices.iter().map(|d| d.1).sum::<f64>()
                + writer_s;
            let ratio = batch_time / resource_time;
            let vs_static = median_rate("streaming") / median_rate("static");
            let vs_batch = median_rate("streaming") / median_rate("batch");
            println!(
                "  streaming vs static {vs_static:.2}x (goal ≥ 1.3): {}",
                verdict("streaming ≥ 1.3x static", vs_static, vs_static >= 1.3)
            );
            println!(
                "  streaming vs batch {vs_batch:.2}x, theoretical batch ratio {ratio:.2} (sum of stage times {batch_time:.2}s / busiest resource {resource_time:.2}s): {:.2} of it (goal ≥ 0.9): {}",
                vs_batch / ratio,
                verdict(
                    "streaming ≥ 0.9 of the batch ratio",
                    vs_batch,
                    vs_batch / ratio >= 0.9
                )
            );
            println!(
                "  % of bound {pct_of_bound:.0}% (goal ≥ 90%): {} ({pct_of_resources:.0}% of the \
                 busiest resource's time alone)",
                ok("three-stage ≥ 90% of bound", pct_of_bound >= 90.0)
            );
            summary.push_str(&format!(
                " batch_ratio={ratio:.2} of_batch_ratio={:.2}",
                vs_batch / ratio
            ));
        }
    }
    println!(
        "  accelerator idle gap median {gap_ms:.2} ms (goal ≤ 1): {}",
        ok("accelerator idle gap ≤ 1 ms", gap_ms <= 1.0)
    );

    if pipeline == Pipeline::Two && !args.skip_memory {
        let big_rows = rows * args.mem_scale;
        let big_input = args.out.join(format!("docs-{big_rows}.parquet"));
        ensure_file(&big_input, big_rows, |p| {
            flumen::demo::write_docs(p, big_rows)
        })?;
        let big = spawn_child(args, pipeline, "streaming", &big_input, None, false)?;
        let small_rss = spread(streaming.iter().map(|r| f(r, "peak_rss_kb")).collect()).0;
        let ratio = f(&big, "peak_rss_kb") / small_rss;
        println!(
            "  memory: streaming over {}x the rows ({big_rows}): peak RSS {:.0} MiB vs {:.0} MiB at 1x (ratio {ratio:.2}, goal ≤ 1.2: {}), {:.0} rows/s",
            args.mem_scale,
            f(&big, "peak_rss_kb") / 1024.0,
            small_rss / 1024.0,
            ok("RSS at 10x rows ≤ 1.2x", ratio <= 1.2),
            rate(&big)
        );
        summary.push_str(&format!(" rss_10x_ratio={ratio:.2}"));
    }
    let svg = args.out.join(format!("pipeline-{}.svg", pipeline.name()));
    let last: Vec<Value> = runs.iter().filter_map(|r| r.last().cloned()).collect();
    let names: Vec<String> = devices.iter().map(|d| d.0.clone()).collect();
    plot::timelines(&svg, &last, cores, rows, &names)?;
    println!("timeline plot: {}", svg.display());
    println!("{summary}");
    Ok(())
}

/// Run one mode in a child process and read its `RESULT` line.
fn spawn_child(
    args: &Args,
    pipeline: Pipeline,
    mode: &str,
    input: &Path,
    target_partitions: Option<usize>,
    zero_device: bool,
) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe);
    child
        .args(["--child", mode, "--pipeline", pipeline.name(), "--input"])
        .arg(input)
        .args(["--accelerator", &args.accelerator])
        .args(["--precision", &args.precision.to_string()])
        .args(["--service-us", &args.service_us.to_string()])
        .args(["--batch-rows", &args.batch_rows.to_string()])
        .args(["--dims", &args.dims.to_string()])
        .args(["--post-layers", &args.post_layers.to_string()])
        .args(["--a-batch-us", &args.a_batch_us.to_string()])
        .args(["--a-per-kib-us", &args.a_per_kib_us.to_string()])
        .args(["--b-service-us", &args.b_service_us.to_string()])
        .arg("--out")
        .arg(&args.out);
    if let Some(rows) = args.first_block_rows {
        child.args(["--first-block-rows", &rows.to_string()]);
    }
    if let Some(path) = &args.timeline {
        child.arg("--timeline").arg(path);
    }
    if let Some(rows) = args.block_rows {
        child.args(["--block-rows", &rows.to_string()]);
    }
    if let Some(rows) = args.piece_rows {
        child.args(["--piece-rows", &rows.to_string()]);
    }
    if let Some(bytes) = args.split_bytes {
        child.args(["--split-bytes", &bytes.to_string()]);
    }
    if let Some(tp) = target_partitions {
        child.args(["--target-partitions", &tp.to_string()]);
    }
    if zero_device {
        child.arg("--zero-device");
    }
    if let Some(rows) = args.alone_rows {
        child.args(["--alone-rows", &rows.to_string()]);
    }
    if args.warm {
        child.arg("--warm");
    }
    let output = child.output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("RESULT "));
    match line {
        Some(json) if output.status.success() => {
            let value: Value = serde_json::from_str(json)
                .map_err(|e| DataFusionError::Execution(format!("bad child result: {e}")))?;
            if mode == "explain" {
                return Ok(value);
            }
            eprintln!(
                "  {mode:>10}{}: {:.2}s, {:.0} rows/s",
                target_partitions.map_or(String::new(), |tp| format!(" tp={tp}")),
                f(&value, "wall_s"),
                f(&value, "rows") / f(&value, "wall_s")
            );
            Ok(value)
        }
        _ => Err(DataFusionError::Execution(format!(
            "mode {mode} failed ({}): {}{}",
            output.status,
            stdout,
            String::from_utf8_lossy(&output.stderr)
        ))),
    }
}

/// CPU seconds (user + system) of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// A device a child can watch while it runs: its busy time, and when it was busy.
trait DeviceMeter: Send + Sync {
    fn busy_s(&self) -> f64;
    fn intervals(&self) -> Vec<(Duration, Duration)>;
    /// What the intervals count from.
    fn created(&self) -> Instant;
    /// When a worker loaded the model (a real model only), from `created`, and the parts
    /// of its load it reports.
    fn loads(&self) -> Vec<(Duration, Duration, String)> {
        vec![]
    }
}

impl DeviceMeter for EmulatedDevice {
    fn busy_s(&self) -> f64 {
        self.busy_ns() as f64 / 1e9
    }
    fn intervals(&self) -> Vec<(Duration, Duration)> {
        self.busy_intervals()
    }
    fn created(&self) -> Instant {
        EmulatedDevice::created(self)
    }
}

/// When a real model's `process` calls ran (`embed` on CUDA: the device's busy time).
#[derive(Debug)]
struct CallLog {
    created: Instant,
    calls: Mutex<Vec<(Duration, Duration)>>,
    /// When each worker's `load` ran, and the parts of it the worker reports (`*_ms`).
    loads: Mutex<Vec<(Duration, Duration, String)>>,
}

impl DeviceMeter for CallLog {
    fn busy_s(&self) -> f64 {
        let calls = self.calls.lock().unwrap();
        calls.iter().map(|(s, e)| (*e - *s).as_secs_f64()).sum()
    }
    fn intervals(&self) -> Vec<(Duration, Duration)> {
        self.calls.lock().unwrap().clone()
    }
    fn created(&self) -> Instant {
        self.created
    }
    fn loads(&self) -> Vec<(Duration, Duration, String)> {
        self.loads.lock().unwrap().clone()
    }
}

/// A model function whose `process` calls are logged.
#[derive(Debug)]
struct Metered {
    inner: Arc<dyn AcceleratorFunction>,
    log: Arc<CallLog>,
}

impl AcceleratorFunction for Metered {
    fn name(&self) -> &str {
        "model"
    }
    fn signature(&self) -> &datafusion::logical_expr::Signature {
        self.inner.signature()
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }
    fn load(&self, config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        let started = self.log.created.elapsed();
        let inner = self.inner.load(config)?;
        let ended = self.log.created.elapsed();
        let parts: Vec<String> = inner
            .metrics()
            .into_iter()
            .filter(|(name, _)| name.ends_with("_ms"))
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        self.log
            .loads
            .lock()
            .unwrap()
            .push((started, ended, parts.join(", ")));
        Ok(Box::new(MeteredWorker {
            inner,
            log: Arc::clone(&self.log),
        }))
    }
    fn load_key(&self, config: &ConfigOptions) -> String {
        self.inner.load_key(config)
    }
    fn batch_rows(&self, config: &ConfigOptions) -> Option<usize> {
        self.inner.batch_rows(config)
    }
    fn resources(&self, config: &ConfigOptions) -> WorkerResources {
        self.inner.resources(config)
    }
    fn cpu_step(&self) -> Option<Arc<ScalarUDF>> {
        self.inner.cpu_step()
    }
}

struct MeteredWorker {
    inner: Box<dyn AcceleratorWorker>,
    log: Arc<CallLog>,
}

impl AcceleratorWorker for MeteredWorker {
    fn process(
        &mut self,
        args: &[datafusion::arrow::array::ArrayRef],
        return_type: &DataType,
    ) -> Result<datafusion::arrow::array::ArrayRef> {
        let started = self.log.created.elapsed();
        let out = self.inner.process(args, return_type);
        let ended = self.log.created.elapsed();
        self.log.calls.lock().unwrap().push((started, ended));
        out
    }
}

/// Models, the devices to watch by name, CPU functions.
type PipelineFunctions = (
    Vec<ScalarUDF>,
    Vec<(&'static str, Arc<dyn DeviceMeter>)>,
    Vec<ScalarUDF>,
);

/// The pipeline's models as UDFs (named as its SQL calls them), the devices to watch, and
/// its CPU functions.
fn pipeline_functions(args: &Args, pipeline: Pipeline, zero_device: bool) -> PipelineFunctions {
    let time = |us: u64| {
        if zero_device {
            Duration::ZERO
        } else {
            Duration::from_micros(us)
        }
    };
    let emulated = |name: &'static str, per_batch: u64, per_kib: u64, dims: usize| {
        let device = Arc::new(EmulatedDevice::default());
        let model = EmulatedModel::new(
            name,
            time(per_batch),
            args.batch_rows,
            dims,
            Arc::clone(&device),
        )
        .with_service_per_kib(time(per_kib));
        (
            flumen::accelerator_udf(model),
            (name, device as Arc<dyn DeviceMeter>),
        )
    };
    match pipeline {
        Pipeline::Two if args.accelerator != "emulated" && !zero_device => {
            let log = Arc::new(CallLog {
                created: Instant::now(),
                calls: Mutex::new(vec![]),
                loads: Mutex::new(vec![]),
            });
            let model = Metered {
                inner: Arc::new(flumen::functions::embedding::EmbedFunction::default()),
                log: Arc::clone(&log),
            };
            (
                vec![flumen::accelerator_udf(model)],
                vec![("model", log as Arc<dyn DeviceMeter>)],
                vec![flumen::functions::clean_text_udf()],
            )
        }
        Pipeline::Two => {
            let (udf, device) = emulated("model", args.service_us, 0, args.dims);
            (
                vec![udf],
                vec![device],
                vec![flumen::functions::clean_text_udf()],
            )
        }
        Pipeline::Three => {
            let (a, device_a) = emulated(
                "model_a",
                args.a_batch_us,
                args.a_per_kib_us,
                pipeline_stages::POST_DIMS,
            );
            let (b, device_b) = emulated("model_b", args.b_service_us, 0, 16);
            (
                vec![a, b],
                vec![device_a, device_b],
                vec![
                    flumen::functions::clean_text_udf(),
                    Post::udf(args.post_layers),
                ],
            )
        }
    }
}

/// Where the real model alone writes its vectors (see `model_alone`).
fn device_output(args: &Args, pipeline: Pipeline) -> PathBuf {
    args.out
        .join(format!("out-{}-device.parquet", pipeline.name()))
}

/// Rows in a row group of the output.
const OUTPUT_ROW_GROUP_ROWS: usize = 65_536;

/// The Parquet writer's settings for the output: row groups of 64k rows (the writer buffers
/// a whole row group), no dictionary for vectors of floats.
fn writer_props() -> WriterProperties {
    WriterProperties::builder()
        .set_dictionary_enabled(false)
        .set_max_row_group_row_count(Some(OUTPUT_ROW_GROUP_ROWS))
        .build()
}

/// Run one mode over `--input` in this process; returns its figures as JSON.
fn run_child(args: &Args, mode: &str) -> Result<Value> {
    let cores = flumen::config::available_cores();
    let input = args.input.clone().expect("--input");
    let pipeline = args.pipeline;
    let (models, meters, cpu_functions) =
        pipeline_functions(args, pipeline, args.zero_device || mode == "alone");
    if mode == "device" {
        // The real model alone, called directly on flumen's blocks (see `model_alone`).
        let mut config = FlumenConfig::default();
        config.embed_precision = args.precision;
        if args.accelerator == "cuda" {
            config.device = flumen::Device::Cuda;
        }
        if let Some(rows) = args.block_rows {
            config.target_block_rows = rows;
        }
        let block_rows = config.block_rows();
        let mut options = ConfigOptions::new();
        options.extensions.insert(config);
        let prep = [
            flumen::functions::clean_text_udf(),
            flumen::functions::embedding::tokenize_step::embed_tokens_udf()
                .as_ref()
                .clone(),
        ];
        return model_alone::run(
            &input,
            &device_output(args, pipeline),
            &prep,
            &flumen::functions::embedding::EmbedFunction::default(),
            &options,
            block_rows,
            writer_props(),
        );
    }
    if mode == "alone" {
        let output = args
            .out
            .join(format!("out-{}-alone.parquet", pipeline.name()));
        let by_name = |name: &str| {
            models
                .iter()
                .chain(&cpu_functions)
                .find(|u| u.name() == name)
                .cloned()
                .expect("function")
        };
        let model_stage = |name: &'static str, per_batch: u64, per_kib: u64| LoopStage {
            name,
            udf: by_name(name),
            device: Some((
                args.batch_rows,
                Duration::from_micros(per_batch),
                Duration::from_micros(per_kib),
            )),
        };
        let cpu_stage = |name: &'static str| LoopStage {
            name,
            udf: by_name(name),
            device: None,
        };
        let stages = match pipeline {
            // The real model's CPU step (its tokenizer, on the CPU pool in flumen's plan)
            // is CPU work too; the zero-time model stands for the device alone.
            Pipeline::Two if args.accelerator != "emulated" => {
                let tokenize = flumen::functions::embedding::tokenize_step::embed_tokens_udf();
                // Its first call reads `tokenizer.json`, once per process: not per-row work.
                let one: datafusion::arrow::array::ArrayRef =
                    Arc::new(datafusion::arrow::array::StringArray::from(vec!["warm up"]));
                pipeline_stages::call(&tokenize, &[one])?;
                vec![
                    cpu_stage("clean_text"),
                    LoopStage {
                        name: "embed_tokens",
                        udf: tokenize.as_ref().clone(),
                        device: None,
                    },
                    model_stage("model", args.service_us, 0),
                ]
            }
            Pipeline::Two => vec![
                cpu_stage("clean_text"),
                model_stage("model", args.service_us, 0),
            ],
            Pipeline::Three => vec![
                cpu_stage("clean_text"),
                model_stage("model_a", args.a_batch_us, args.a_per_kib_us),
                cpu_stage("post"),
                model_stage("model_b", args.b_service_us, 0),
            ],
        };
        return pipeline_stages::stage_costs(
            &input,
            &output,
            &stages,
            writer_props(),
            // The three-stage input's second half is longer: it is measured whole.
            args.alone_rows.filter(|_| pipeline == Pipeline::Two),
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()?;
    let ctx = match mode {
        "vanilla" => SessionContext::new_with_config(
            SessionConfig::new().with_target_partitions(args.target_partitions.unwrap_or(cores)),
        ),
        _ => {
            let mut config = FlumenConfig::default();
            config.embed_precision = args.precision;
            config.mode = match mode {
                "batch" => ExecMode::Batch,
                "static" => ExecMode::Static,
                _ => ExecMode::Streaming,
            };
            if args.accelerator == "cuda" && pipeline == Pipeline::Two {
                config.device = flumen::Device::Cuda;
            }
            // One worker per device: the two models of the three-stage pipeline each have one.
            config.accelerator_slots = meters.len();
            if let Some(rows) = args.first_block_rows {
                config.first_block_rows = rows;
            }
            if let Some(rows) = args.block_rows {
                config.target_block_rows = rows;
            }
            if let Some(bytes) = args.split_bytes {
                config.model_split_bytes = flumen::config::ByteSize(bytes);
            }
            if let Some(rows) = args.piece_rows {
                config.model_piece_rows = rows;
            }
            if let Some(path) = &args.timeline {
                let mut file = path.clone().into_os_string();
                file.push(format!("-{}-{mode}.json", pipeline.name()));
                config.timeline_file = file.to_string_lossy().into_owned();
            }
            flumen::session(config)
        }
    };
    for udf in models.into_iter().chain(cpu_functions) {
        ctx.register_udf(udf);
    }

    if mode == "explain" {
        let plan = runtime.block_on(async {
            ctx.register_parquet(
                "docs",
                input.to_str().unwrap(),
                ParquetReadOptions::default(),
            )
            .await?;
            ctx.sql("SET datafusion.explain.physical_plan_only = true")
                .await?
                .collect()
                .await?;
            let batches = ctx
                .sql(&format!("EXPLAIN {}", pipeline.sql()))
                .await?
                .collect()
                .await?;
            Ok::<_, DataFusionError>(batches[0].column(1).as_string::<i32>().value(0).to_string())
        })?;
        return Ok(json!({"mode": mode, "plan": plan}));
    }
    if args.warm {
        // A session's earlier query over a few rows: it loads the model, which the session
        // keeps, so the measured run starts with it loaded.
        runtime.block_on(async {
            ctx.register_parquet(
                "docs",
                input.to_str().unwrap(),
                ParquetReadOptions::default(),
            )
            .await?;
            let sql = format!("SELECT * FROM ({}) LIMIT 64", pipeline.sql());
            ctx.sql(&sql).await?.collect().await?;
            ctx.deregister_table("docs")?;
            Ok::<_, DataFusionError>(())
        })?;
    }
    let output = args
        .out
        .join(format!("out-{}-{mode}.parquet", pipeline.name()));
    // The earlier run's output goes before the clock starts (see `remove_old_output`).
    pipeline_stages::remove_old_output(&output)?;
    let rows_done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let timeline = Arc::new(Mutex::new(Vec::<Vec<f64>>::new()));
    let started = Instant::now();
    let cpu_at_start = cpu_seconds();
    let sampler = {
        let (rows_done, stop, timeline, meters) = (
            Arc::clone(&rows_done),
            Arc::clone(&stop),
            Arc::clone(&timeline),
            meters.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let cpu = cpu_seconds();
                let mut sample = vec![
                    started.elapsed().as_secs_f64(),
                    rows_done.load(Ordering::Relaxed) as f64,
                    cpu - cpu_at_start,
                ];
                sample.extend(meters.iter().map(|(_, m)| m.busy_s()));
                timeline.lock().unwrap().push(sample);
                std::thread::sleep(SAMPLE_EVERY);
            }
        })
    };
    let deterministic = args.accelerator == "emulated" || pipeline == Pipeline::Three;
    let mut ends = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    let (first_row_s, checksum, writer_busy) = runtime.block_on(async {
        ctx.register_parquet(
            "docs",
            input.to_str().unwrap(),
            ParquetReadOptions::default(),
        )
        .await?;
        let mut stream = ctx.sql(pipeline.sql()).await?.execute_stream().await?;
        let mut writer = ArrowWriter::try_new(
            pipeline_stages::new_output_file(&output)?,
            stream.schema(),
            Some(writer_props()),
        )?;
        let mut writer_busy = Duration::ZERO;
        let mut first_row_s = None;
        let mut checksum = 0u64;
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            if batch.num_rows() == 0 {
                continue;
            }
            first_row_s.get_or_insert(started.elapsed().as_secs_f64());
            checksum = checksum.wrapping_add(batch_checksum(&batch, deterministic));
            let write_started = Instant::now();
            writer.write(&batch)?;
            writer_busy += write_started.elapsed();
            rows_done.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
            ends.0 = started.elapsed().as_secs_f64();
        }
        ends.1 = started.elapsed().as_secs_f64();
        let write_started = Instant::now();
        let close_cpu = pipeline_stages::thread_cpu();
        writer.close()?;
        ends.3 = (pipeline_stages::thread_cpu() - close_cpu).as_secs_f64();
        writer_busy += write_started.elapsed();
        ends.2 = started.elapsed().as_secs_f64();
        Ok::<_, DataFusionError>((first_row_s.unwrap_or(f64::NAN), checksum, writer_busy))
    })?;
    let wall_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler thread");
    let cpu_at_end = cpu_seconds();
    // Untimed: the next run must not write this one's output back (see `flush_output`).
    pipeline_stages::flush_output(&output)?;
    let peak_rss_kb = rss::peak_bytes() as f64 / 1024.0;
    let timeline = std::mem::take(&mut *timeline.lock().unwrap());
    let devices: Vec<Value> = meters
        .iter()
        .map(|(name, m)| {
            // Batches of this run (not of a `--warm` query before it).
            let after_start = |d: &Duration| m.created() + *d >= started;
            let intervals: Vec<_> = m
                .intervals()
                .into_iter()
                .filter(|(s, _)| after_start(s))
                .collect();
            let busy_s: f64 = intervals.iter().map(|(s, e)| (*e - *s).as_secs_f64()).sum();
            // When the device first started and last finished, from the query's start.
            let since_start = |d: Duration| (m.created() + d).saturating_duration_since(started);
            let span = match (intervals.first(), intervals.last()) {
                (Some(first), Some(last)) => json!([
                    since_start(first.0).as_secs_f64(),
                    since_start(last.1).as_secs_f64()
                ]),
                _ => json!(null),
            };
            let loads: Vec<Value> = m
                .loads()
                .iter()
                .filter(|(s, _, _)| after_start(s))
                .map(|(s, e, parts)| {
                    json!([
                        since_start(*s).as_secs_f64(),
                        since_start(*e).as_secs_f64(),
                        parts
                    ])
                })
                .collect();
            // The three largest gaps: when each began (from the query's start) and how long it was.
            let mut largest: Vec<(f64, f64)> = intervals
                .windows(2)
                .map(|w| {
                    (
                        since_start(w[0].1).as_secs_f64(),
                        w[1].0.saturating_sub(w[0].1).as_secs_f64() * 1e3,
                    )
                })
                .collect();
            largest.sort_by(|a, b| b.1.total_cmp(&a.1));
            largest.truncate(3);
            json!({"name": name, "busy_s": busy_s, "largest_gaps": largest, "gaps": gap_stats(&intervals), "span_s": span, "loads_s": loads})
        })
        .collect();
    Ok(json!({
        "mode": mode,
        "rows": rows_done.load(Ordering::Relaxed) as f64,
        "wall_s": wall_s,
        "first_row_s": first_row_s,
        "cpu_s": cpu_at_end - cpu_at_start,
        "devices": devices,
        "writer_busy_s": writer_busy.as_secs_f64(),
        "last_batch_written_s": ends.0,
        "stream_ended_s": ends.1,
        "writer_closed_s": ends.2,
        "writer_close_cpu_s": ends.3,
        "peak_rss_kb": peak_rss_kb,
        "checksum": checksum.to_string(),
        "timeline": timeline,
    }))
}

/// An order-independent checksum of output rows: ids, and the first vector element's bits
/// when the vectors are deterministic (the emulated models).
fn batch_checksum(batch: &RecordBatch, with_vectors: bool) -> u64 {
    let ids = batch.column(0).as_primitive::<Int64Type>();
    let vectors = batch.column(1).as_fixed_size_list();
    let mut sum = 0u64;
    for row in 0..batch.num_rows() {
        let mut h = (ids.value(row) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        if with_vectors && !vectors.is_null(row) {
            let first = vectors.value(row).as_primitive::<Float32Type>().value(0);
            h ^= first.to_bits() as u64;
        }
        sum = sum.wrapping_add(h);
    }
    sum
}

/// Write a table of `rows` rows at `path` with `write` unless it is there.
fn ensure_file(path: &Path, rows: usize, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if !path.exists() {
        let started = Instant::now();
        write(path)?;
        eprintln!(
            "generated {} ({rows} rows) in {:.1}s",
            path.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

mod plot {
    use super::*;
    use plotters::prelude::*;

    const COLORS: [RGBColor; 4] = [
        RGBColor(120, 120, 120),
        RGBColor(200, 80, 40),
        RGBColor(60, 120, 200),
        RGBColor(20, 150, 60),
    ];
    const DEVICE_COLORS: [RGBColor; 2] = [RGBColor(220, 30, 30), RGBColor(160, 60, 200)];

    fn err(e: impl std::fmt::Display) -> DataFusionError {
        DataFusionError::Execution(format!("plot: {e}"))
    }

    /// Rows done over time for every mode, then each mode's CPU and device utilisation over
    /// time (from the samples `[t, rows, cpu seconds, busy seconds of each device...]`).
    pub fn timelines(
        path: &Path,
        results: &[Value],
        cores: f64,
        rows: usize,
        devices: &[String],
    ) -> Result<()> {
        let series: Vec<Vec<Vec<f64>>> = results
            .iter()
            .map(|r| {
                r["timeline"]
                    .as_array()
                    .map(|samples| {
                        samples
                            .iter()
                            .map(|s| {
                                s.as_array()
                                    .map(|v| v.iter().map(|x| x.as_f64().unwrap_or(0.0)).collect())
                                    .unwrap_or_default()
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();
        let t_max = results.iter().map(|r| f(r, "wall_s")).fold(1.0, f64::max);
        let rows_max = results.iter().map(|r| f(r, "rows")).fold(1.0, f64::max);
        let root = SVGBackend::new(path, (1000, 1100)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, rest) = root.split_vertically(380);
        let mut chart = ChartBuilder::on(&top)
            .caption(
                format!("rows done: {rows} rows, {cores} cores"),
                ("sans-serif", 20),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, 0.0..rows_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc("rows written")
            .draw()
            .map_err(err)?;
        for (i, (r, s)) in results.iter().zip(&series).enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    s.iter().filter(|p| p.len() > 1).map(|p| (p[0], p[1])),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(r["mode"].as_str().unwrap_or("?").to_string())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
        let panels = rest.split_evenly((results.len(), 1));
        for ((panel, r), s) in panels.iter().zip(results).zip(&series) {
            let mut chart = ChartBuilder::on(panel)
                .caption(
                    format!("{}: utilisation", r["mode"].as_str().unwrap_or("?")),
                    ("sans-serif", 16),
                )
                .margin(8)
                .x_label_area_size(25)
                .y_label_area_size(70)
                .build_cartesian_2d(0.0..t_max, 0.0..105.0)
                .map_err(err)?;
            chart
                .configure_mesh()
                .y_desc("% busy")
                .draw()
                .map_err(err)?;
            let rate = |k: usize, scale: f64| {
                s.windows(2)
                    .filter(|w| w[0].len() > k && w[1].len() > k)
                    .map(move |w| {
                        let dt = (w[1][0] - w[0][0]).max(1e-9);
                        (
                            w[1][0],
                            (100.0 * (w[1][k] - w[0][k]) / dt / scale).min(105.0),
                        )
                    })
                    .collect::<Vec<_>>()
            };
            chart
                .draw_series(LineSeries::new(rate(2, cores), BLUE.stroke_width(2)))
                .map_err(err)?
                .label("cpu")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
            for (k, name) in devices.iter().enumerate() {
                let color = DEVICE_COLORS[k % DEVICE_COLORS.len()];
                chart
                    .draw_series(LineSeries::new(rate(3 + k, 1.0), color.stroke_width(2)))
                    .map_err(err)?
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(err)?;
        }
        root.present().map_err(err)?;
        Ok(())
    }
}
