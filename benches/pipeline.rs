//! The heterogeneous batch-inference pipeline: Parquet → CPU preprocessing → accelerator
//! model → Parquet, in four execution modes in one run (the question of the Ray Data paper,
//! arXiv 2501.12407, asked of flumen).
//!
//! ```text
//! cargo bench --bench pipeline -- [--full] [--rows N] [--accelerator auto|emulated|cuda]
//!                                 [--service-us N] [--batch-rows N] [--mem-scale N]
//!                                 [--skip-memory] [--first-block-rows N]
//! ```
//!
//! The SQL is `SELECT id, model(clean_text(body)) AS v FROM docs`, over flumen's demo table of
//! HTML documents (`flumen::demo`; `--rows`, default 100,000; `--full`: 1,000,000). `clean_text` is flumen's
//! real text preprocessing (markup, entities, NFKC, whitespace); `model` is the accelerator:
//! - `emulated` (default without a CUDA device): one emulated device that is busy for
//!   `--service-us` per batch of `--batch-rows` rows without using a CPU core
//!   (`flumen::emulated_accelerator`), returning 384-float vectors;
//! - `cuda`: flumen's real `embed` on the GPU.
//!
//! Each mode runs in a child process of this binary (so peak RSS is its own): vanilla
//! DataFusion with the same UDFs inline, flumen `batch`, flumen `static`, flumen `streaming`.
//! The query's output stream is written to Parquet as it arrives, as a training job's loader
//! would consume it. The bound comes from each stage alone: the CPU work per row (CPU seconds
//! of the pipeline with a zero-time accelerator) and the accelerator's busy time per row.
//! Results: a table on stdout, `target/pipeline-bench/pipeline.svg` (rows done and pool
//! utilisation over time), and a last machine-readable line.

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
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use flumen::functions::emulated_accelerator::{EmulatedDevice, EmulatedModel};
use flumen::{AcceleratorFunction, AcceleratorWorker, ExecMode, FlumenConfig, WorkerResources};
use futures::StreamExt;
use serde_json::{Value, json};

const SQL: &str = "SELECT id, model(clean_text(body)) AS v FROM docs";
const MODES: [&str; 4] = ["vanilla", "batch", "static", "streaming"];
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Command-line settings.
#[derive(Debug, Clone)]
struct Args {
    rows: usize,
    accelerator: String,
    service_us: u64,
    batch_rows: usize,
    dims: usize,
    mem_scale: usize,
    skip_memory: bool,
    /// `flumen.first_block_rows` for flumen's modes (`None`: flumen's default).
    first_block_rows: Option<usize>,
    out: PathBuf,
    /// Internal: run one mode and print its result.
    child: Option<String>,
    input: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut args = Args {
        rows: 100_000,
        accelerator: "auto".into(),
        service_us: 5_000,
        batch_rows: 256,
        dims: 384,
        mem_scale: 10,
        skip_memory: false,
        first_block_rows: None,
        out: PathBuf::from("target/pipeline-bench"),
        child: None,
        input: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--full" => args.rows = 1_000_000,
            "--rows" => args.rows = value().parse().expect("--rows N"),
            "--accelerator" => args.accelerator = value(),
            "--service-us" => args.service_us = value().parse().expect("--service-us N"),
            "--batch-rows" => args.batch_rows = value().parse().expect("--batch-rows N"),
            "--dims" => args.dims = value().parse().expect("--dims N"),
            "--mem-scale" => args.mem_scale = value().parse().expect("--mem-scale N"),
            "--skip-memory" => args.skip_memory = true,
            "--first-block-rows" => {
                args.first_block_rows = Some(value().parse().expect("--first-block-rows N"))
            }
            "--out" => args.out = PathBuf::from(value()),
            "--child" => args.child = Some(value()),
            "--input" => args.input = Some(PathBuf::from(value())),
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
        args.accelerator = if flumen::functions::embedding::cuda::cuda_available() {
            "cuda".into()
        } else {
            "emulated".into()
        };
    }
    std::fs::create_dir_all(&args.out)?;
    let input = args.out.join(format!("docs-{}.parquet", args.rows));
    ensure_docs(&input, args.rows)?;
    println!(
        "pipeline: {SQL}\n  rows={} accelerator={} {} cores={}",
        args.rows,
        args.accelerator,
        if args.accelerator == "emulated" {
            format!(
                "(emulated: {} us per batch of {} rows, one device)",
                args.service_us, args.batch_rows
            )
        } else {
            "(real embed on CUDA)".into()
        },
        flumen::config::available_cores()
    );

    // Each stage alone: the CPU work per row, from the pipeline with a zero-time accelerator.
    let cpu_alone = spawn_child(&args, "cpu_alone", &input)?;
    let cpu_s_per_row = f(&cpu_alone, "cpu_s") / f(&cpu_alone, "rows");
    let mut results = vec![];
    for mode in MODES {
        results.push(spawn_child(&args, mode, &input)?);
    }
    // The accelerator's work per row: its busy time per row, the least over the modes (the
    // emulated device's cost is fixed per batch; partial batches make some modes pay more).
    let accel_s_per_row = results
        .iter()
        .map(|r| f(r, "accel_busy_s") / f(r, "rows"))
        .fold(f64::INFINITY, f64::min);
    // The output is one Parquet file written by the query's reader: a serial stage, whose
    // time per row (the least over the modes) bounds the pipeline too.
    let writer_s_per_row = results
        .iter()
        .map(|r| f(r, "writer_busy_s") / f(r, "rows"))
        .fold(f64::INFINITY, f64::min);
    let cores = flumen::config::available_cores() as f64;
    let limits = [
        ("cpu", cores / cpu_s_per_row),
        ("accelerator", 1.0 / accel_s_per_row),
        ("writer", 1.0 / writer_s_per_row),
    ];
    let (bottleneck, bound_rows_per_s) = limits.into_iter().fold(
        ("none", f64::INFINITY),
        |a, b| if b.1 < a.1 { b } else { a },
    );

    let reference = &results[0];
    for r in &results[1..] {
        if r["checksum"] != reference["checksum"] || r["rows"] != reference["rows"] {
            return Err(DataFusionError::Execution(format!(
                "mode {} wrote rows={} checksum={}, vanilla rows={} checksum={}",
                r["mode"], r["rows"], r["checksum"], reference["rows"], reference["checksum"]
            )));
        }
    }

    println!(
        "\nstage costs: cpu {:.1} us/row on {cores} cores (alone: {:.0} rows/s), accelerator {:.1} us/row (alone: {:.0} rows/s), writer {:.1} us/row, serial (alone: {:.0} rows/s)",
        cpu_s_per_row * 1e6,
        cores / cpu_s_per_row,
        accel_s_per_row * 1e6,
        1.0 / accel_s_per_row,
        writer_s_per_row * 1e6,
        1.0 / writer_s_per_row
    );
    println!("bound: {bound_rows_per_s:.0} rows/s ({bottleneck}-bound)\n");
    println!(
        "| mode | rows/s | seconds | first row s | accel busy | cpu busy | peak RSS MiB | % of bound |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let rate = |r: &Value| f(r, "rows") / f(r, "wall_s");
    for r in &results {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.0}% | {:.0}% | {:.0} | {:.0}% |",
            r["mode"].as_str().unwrap_or("?"),
            rate(r),
            f(r, "wall_s"),
            f(r, "first_row_s"),
            100.0 * f(r, "accel_busy_s") / f(r, "wall_s"),
            100.0 * f(r, "cpu_s") / (f(r, "wall_s") * cores),
            f(r, "peak_rss_kb") / 1024.0,
            100.0 * rate(r) / bound_rows_per_s
        );
    }
    let streaming = &results[3];
    let rss_ratio = if args.skip_memory {
        None
    } else {
        let big_rows = args.rows * args.mem_scale;
        let big_input = args.out.join(format!("docs-{big_rows}.parquet"));
        ensure_docs(&big_input, big_rows)?;
        let big = spawn_child(&args, "streaming", &big_input)?;
        let ratio = f(&big, "peak_rss_kb") / f(streaming, "peak_rss_kb");
        println!(
            "\nmemory: streaming over {}x the rows ({big_rows}): peak RSS {:.0} MiB vs {:.0} MiB at 1x (ratio {ratio:.2}), {:.0} rows/s",
            args.mem_scale,
            f(&big, "peak_rss_kb") / 1024.0,
            f(streaming, "peak_rss_kb") / 1024.0,
            rate(&big)
        );
        Some(ratio)
    };
    let svg = args.out.join("pipeline.svg");
    plot::timelines(&svg, &results, cores, &args)?;
    println!("timeline plot: {}", svg.display());
    let speedup = |i: usize| rate(streaming) / rate(&results[i]);
    println!(
        "pipeline accelerator={} speedup_vs_vanilla={:.2} speedup_vs_batch={:.2} speedup_vs_static={:.2} pct_of_bound={:.0} accel_busy={:.0} rss_10x_ratio={}",
        args.accelerator,
        speedup(0),
        speedup(1),
        speedup(2),
        100.0 * rate(streaming) / bound_rows_per_s,
        100.0 * f(streaming, "accel_busy_s") / f(streaming, "wall_s"),
        rss_ratio.map_or("skipped".to_string(), |r| format!("{r:.2}"))
    );
    Ok(())
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// Run one mode in a child process and read its `RESULT` line.
fn spawn_child(args: &Args, mode: &str, input: &Path) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe);
    child
        .args(["--child", mode, "--input"])
        .arg(input)
        .args(["--accelerator", &args.accelerator])
        .args(["--service-us", &args.service_us.to_string()])
        .args(["--batch-rows", &args.batch_rows.to_string()])
        .args(["--dims", &args.dims.to_string()])
        .arg("--out")
        .arg(&args.out);
    if let Some(rows) = args.first_block_rows {
        child.args(["--first-block-rows", &rows.to_string()]);
    }
    let output = child.output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("RESULT "));
    match line {
        Some(json) if output.status.success() => {
            let value: Value = serde_json::from_str(json)
                .map_err(|e| DataFusionError::Execution(format!("bad child result: {e}")))?;
            eprintln!(
                "  {mode:>10}: {:.2}s, {:.0} rows/s",
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

/// CPU seconds (user + system) and peak RSS (KiB) of this process so far.
fn rusage() -> (f64, f64) {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (
        secs(usage.ru_utime) + secs(usage.ru_stime),
        usage.ru_maxrss as f64,
    )
}

/// The accelerator busy time a child can read while it runs.
trait BusyMeter: Send + Sync {
    fn busy_s(&self) -> f64;
}

impl BusyMeter for EmulatedDevice {
    fn busy_s(&self) -> f64 {
        self.busy_ns() as f64 / 1e9
    }
}

/// A model function whose `process` calls are timed: the accelerator's busy time when the
/// model is real (`embed` on CUDA).
#[derive(Debug)]
struct Metered {
    inner: Arc<dyn AcceleratorFunction>,
    busy_ns: Arc<AtomicU64>,
}

impl BusyMeter for AtomicU64 {
    fn busy_s(&self) -> f64 {
        self.load(Ordering::Relaxed) as f64 / 1e9
    }
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
        Ok(Box::new(MeteredWorker {
            inner: self.inner.load(config)?,
            busy_ns: Arc::clone(&self.busy_ns),
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
}

struct MeteredWorker {
    inner: Box<dyn AcceleratorWorker>,
    busy_ns: Arc<AtomicU64>,
}

impl AcceleratorWorker for MeteredWorker {
    fn process(
        &mut self,
        args: &[datafusion::arrow::array::ArrayRef],
        return_type: &DataType,
    ) -> Result<datafusion::arrow::array::ArrayRef> {
        let started = Instant::now();
        let out = self.inner.process(args, return_type);
        self.busy_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

/// Run one mode over `--input` in this process; returns its figures as JSON.
fn run_child(args: &Args, mode: &str) -> Result<Value> {
    let cores = flumen::config::available_cores();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()?;
    let input = args.input.clone().expect("--input");
    // The model: the emulated device, or `embed` on CUDA, or (cpu_alone) a zero-time device.
    let (model, meter): (ScalarUDF, Arc<dyn BusyMeter>) =
        if args.accelerator == "emulated" || mode == "cpu_alone" {
            let device = Arc::new(EmulatedDevice::default());
            let service = if mode == "cpu_alone" {
                Duration::ZERO
            } else {
                Duration::from_micros(args.service_us)
            };
            let model = EmulatedModel::new(
                "model",
                service,
                args.batch_rows,
                args.dims,
                Arc::clone(&device),
            );
            (flumen::accelerator_udf(model), device)
        } else {
            let busy = Arc::new(AtomicU64::new(0));
            let model = Metered {
                inner: Arc::new(flumen::functions::embedding::EmbedFunction::default()),
                busy_ns: Arc::clone(&busy),
            };
            (flumen::accelerator_udf(model), busy)
        };
    let ctx = match mode {
        "vanilla" => {
            let ctx = SessionContext::new();
            ctx.register_udf(flumen::functions::clean_text_udf());
            ctx
        }
        _ => {
            let mut config = FlumenConfig::default();
            config.mode = match mode {
                "batch" => ExecMode::Batch,
                "static" => ExecMode::Static,
                _ => ExecMode::Streaming,
            };
            if args.accelerator == "cuda" {
                config.device = flumen::Device::Cuda;
            }
            if let Some(rows) = args.first_block_rows {
                config.first_block_rows = rows;
            }
            flumen::session(config)
        }
    };
    ctx.register_udf(model);

    let rows_done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let timeline = Arc::new(Mutex::new(Vec::<[f64; 4]>::new()));
    let started = Instant::now();
    let (cpu_at_start, _) = rusage();
    let sampler = {
        let (rows_done, stop, timeline, meter) = (
            Arc::clone(&rows_done),
            Arc::clone(&stop),
            Arc::clone(&timeline),
            Arc::clone(&meter),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (cpu, _) = rusage();
                timeline.lock().unwrap().push([
                    started.elapsed().as_secs_f64(),
                    rows_done.load(Ordering::Relaxed) as f64,
                    cpu - cpu_at_start,
                    meter.busy_s(),
                ]);
                std::thread::sleep(SAMPLE_EVERY);
            }
        })
    };
    let output = args.out.join(format!("out-{mode}.parquet"));
    let (first_row_s, checksum, writer_busy) = runtime.block_on(async {
        ctx.register_parquet(
            "docs",
            input.to_str().unwrap(),
            ParquetReadOptions::default(),
        )
        .await?;
        let mut stream = ctx.sql(SQL).await?.execute_stream().await?;
        // Row groups of 64k rows (the writer buffers a whole row group), no dictionary for
        // vectors of floats; the writer's time is measured as a stage of its own.
        let props = WriterProperties::builder()
            .set_dictionary_enabled(false)
            .set_max_row_group_row_count(Some(65_536))
            .build();
        let mut writer = ArrowWriter::try_new(
            std::fs::File::create(&output)?,
            stream.schema(),
            Some(props),
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
            checksum =
                checksum.wrapping_add(batch_checksum(&batch, args.accelerator == "emulated"));
            let write_started = Instant::now();
            writer.write(&batch)?;
            writer_busy += write_started.elapsed();
            rows_done.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        }
        let write_started = Instant::now();
        writer.close()?;
        writer_busy += write_started.elapsed();
        Ok::<_, DataFusionError>((first_row_s.unwrap_or(f64::NAN), checksum, writer_busy))
    })?;
    let wall_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler thread");
    let (cpu_at_end, peak_rss_kb) = rusage();
    let timeline = std::mem::take(&mut *timeline.lock().unwrap());
    Ok(json!({
        "mode": mode,
        "rows": rows_done.load(Ordering::Relaxed) as f64,
        "wall_s": wall_s,
        "first_row_s": first_row_s,
        "cpu_s": cpu_at_end - cpu_at_start,
        "accel_busy_s": meter.busy_s(),
        "writer_busy_s": writer_busy.as_secs_f64(),
        "peak_rss_kb": peak_rss_kb,
        "checksum": checksum.to_string(),
        "timeline": timeline,
    }))
}

/// An order-independent checksum of output rows: ids, and the first vector element's bits
/// when the vectors are deterministic (the emulated model).
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

/// Write the demo `docs` table of `rows` rows at `path` unless it is there.
fn ensure_docs(path: &Path, rows: usize) -> Result<()> {
    if !path.exists() {
        let started = Instant::now();
        flumen::demo::write_docs(path, rows)?;
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

    fn err(e: impl std::fmt::Display) -> DataFusionError {
        DataFusionError::Execution(format!("plot: {e}"))
    }

    /// Rows done over time for every mode, then each mode's CPU and accelerator utilisation
    /// over time (from the samples: CPU seconds over cores, busy seconds per wall second).
    pub fn timelines(path: &Path, results: &[Value], cores: f64, args: &Args) -> Result<()> {
        let series: Vec<Vec<[f64; 4]>> = results
            .iter()
            .map(|r| {
                r["timeline"]
                    .as_array()
                    .map(|rows| {
                        rows.iter()
                            .map(|s| {
                                let v = |i: usize| s[i].as_f64().unwrap_or(0.0);
                                [v(0), v(1), v(2), v(3)]
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
                format!(
                    "rows done: {} rows, accelerator={}, {} cores",
                    args.rows, args.accelerator, cores
                ),
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
                    s.iter().map(|p| (p[0], p[1])),
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
            chart
                .draw_series(LineSeries::new(rate(3, 1.0), RED.stroke_width(2)))
                .map_err(err)?
                .label("accelerator")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
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
