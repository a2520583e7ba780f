//! External sort and random shuffle of a table ten times the memory budget, flumen against
//! vanilla DataFusion (same memory limit, as a user would set it on its `RuntimeEnv`) and
//! against this disk's bound, in the same run.
//!
//! `cargo bench --bench shuffle [-- --gb 2 --budget 200MB --dir target/sortbench --only flumen|vanilla --no-shuffle --no-unbounded --reserved-too --whole-ranges-too --memory-cap 1GB --set KEY=VALUE]`
//!
//! The table is the sort benchmark's: 100-byte records, a random 10-byte key and a 90-byte
//! payload holding the record's number, written as uncompressed Parquet (8 files) under
//! `--dir` (generated once per size, then reused). The bench first measures the disk's sequential
//! write (with fsync) and read (after dropping the file from the page cache) speed, three
//! times, and takes the median of each. Each run
//! is `COPY (SELECT ... ORDER BY key | random()) TO '<one Parquet file>'`; its disk bound is
//! the bytes an external sort must move (read the input, write and read back its runs, write
//! the output) at those speeds, and the run's share of the bound is bound / time. Every
//! output is read back: sorted (or, for a shuffle, in an order unlike the input's and the
//! other seed's), with the input's row count and order-independent checksum. Peak RSS is the
//! process's high-water mark, reset before each run; `rise/budget` is how far it rose above
//! the RSS the run started with, over the budget; `heap/budget` the same for the live heap
//! (jemalloc's count of allocated bytes, sampled every 5 ms), so that what the run's data
//! held is told apart from what the allocator kept resident. Vanilla also sorts once with no memory
//! limit (the time a user with the memory sees; `--no-unbounded` skips it). The bench installs
//! the `flumen` binary's allocator, so flumen's budget covers the heap nobody reserved
//! (`flumen.budget_counts_heap`); `--reserved-too` sorts once more with that off
//! (`flumen-reserved`: only blocks and operators' reservations count); `--whole-ranges-too`
//! sorts once more with `flumen.sort_runs` off (`flumen-whole`: each range sorted whole
//! by one task after the map side, instead of in runs as its blocks arrive, then merged).
//!
//! The disk bound leaves out the CPU: decoding the input's Parquet and encoding the output's
//! must be done by any engine, sort or no sort. So the bench first copies the table with no
//! `ORDER BY` (vanilla, no limit; `copy` below): the time no sort of this table can beat on
//! these cores. The sort's disk bound over that time is the highest share of the bound any
//! sort could reach here (`copy_bound_share`), and each run's `x copy` is its time over the
//! copy's.

#[path = "common/args.rs"]
mod args;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{Array, AsArray, FixedSizeBinaryArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use flumen::HeapAllocator;
use flumen::config::ByteSize;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

#[path = "common/heap_stats.rs"]
mod heap_stats;
#[path = "common/memory_cap.rs"]
mod memory_cap;
#[path = "common/rss.rs"]
mod rss;
#[path = "common/verdict.rs"]
mod verdict;
use rss::RssWatch;

/// Both engines allocate as the `flumen` binary does (jemalloc, its configuration): the RSS
/// figures are about memory bounds.
#[path = "../src/bin/flumen/allocator.rs"]
mod allocator;

const KEY_BYTES: usize = 10;
const PAYLOAD_BYTES: usize = 90;
const FILES: usize = 8;
const BATCH_ROWS: usize = 65_536;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("key", DataType::FixedSizeBinary(KEY_BYTES as i32), false),
        Field::new(
            "payload",
            DataType::FixedSizeBinary(PAYLOAD_BYTES as i32),
            false,
        ),
    ]))
}

/// Order-independent and order-dependent digests of a table's records.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Digest {
    rows: u64,
    /// Wrapping sum of the records' hashes: equal for any permutation.
    sum: u64,
    /// A hash of the hashes in order: differs when the order does.
    order: u64,
}

impl Digest {
    fn add(&mut self, key: &[u8], payload: &[u8]) {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for chunk in key.chunks(8).chain(payload.chunks(8)) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            h = (h ^ u64::from_le_bytes(word)).wrapping_mul(0x0000_0100_0000_01b3);
            h ^= h >> 29;
        }
        self.rows += 1;
        self.sum = self.sum.wrapping_add(h);
        self.order = self
            .order
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(h);
    }

    fn add_batch(&mut self, batch: &RecordBatch) {
        let keys = batch.column(0).as_fixed_size_binary();
        let payloads = batch.column(1).as_fixed_size_binary();
        for i in 0..batch.num_rows() {
            self.add(keys.value(i), payloads.value(i));
        }
    }
}

/// Write the table (`rows` records) unless it is there; returns its digest in file order.
fn generate(dir: &Path, rows: u64) -> Result<Digest> {
    std::fs::create_dir_all(dir)?;
    let digest_path = dir.join(format!("digest-{rows}"));
    if let Ok(text) = std::fs::read_to_string(&digest_path) {
        let v: Vec<u64> = text
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        if let [rows, sum, order] = v[..] {
            return Ok(Digest { rows, sum, order });
        }
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "parquet") {
            std::fs::remove_file(path)?;
        }
    }
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(2026);
    let mut digest = Digest::default();
    let per_file = rows.div_ceil(FILES as u64);
    let mut next = 0u64;
    for file in 0..FILES {
        let path = dir.join(format!("records-{file}.parquet"));
        let mut writer = ArrowWriter::try_new(File::create(&path)?, schema(), Some(props()))?;
        let end = (next + per_file).min(rows);
        while next < end {
            let n = (end - next).min(BATCH_ROWS as u64) as usize;
            let mut keys = vec![0u8; n * KEY_BYTES];
            rng.fill_bytes(&mut keys);
            let mut payloads = Vec::with_capacity(n * PAYLOAD_BYTES);
            for i in 0..n as u64 {
                let number = format!("{:020}", next + i);
                payloads.extend_from_slice(number.as_bytes());
                payloads.extend(
                    (0..PAYLOAD_BYTES - 20).map(|j| b'A' + ((next + i + j as u64) % 26) as u8),
                );
            }
            let batch = RecordBatch::try_new(
                schema(),
                vec![
                    Arc::new(FixedSizeBinaryArray::try_new(
                        KEY_BYTES as i32,
                        keys.into(),
                        None,
                    )?),
                    Arc::new(FixedSizeBinaryArray::try_new(
                        PAYLOAD_BYTES as i32,
                        payloads.into(),
                        None,
                    )?),
                ],
            )?;
            digest.add_batch(&batch);
            writer.write(&batch)?;
            next += n as u64;
        }
        writer.close()?;
    }
    std::fs::write(
        &digest_path,
        format!("{} {} {}", digest.rows, digest.sum, digest.order),
    )?;
    println!(
        "generated {rows} records in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(digest)
}

fn props() -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::UNCOMPRESSED)
        .set_dictionary_enabled(false)
        .set_max_row_group_row_count(Some(BATCH_ROWS * 2))
        .build()
}

/// Sequential (write, read) speed of the disk under `dir` in bytes/s: `bytes` written with
/// fsync, dropped from the page cache, read back.
fn measure_disk(dir: &Path, bytes: usize) -> Result<(f64, f64)> {
    let path = dir.join("disk-probe");
    let mut chunk = vec![0u8; 8 << 20];
    StdRng::seed_from_u64(7).fill_bytes(&mut chunk);
    let started = Instant::now();
    let mut file = File::create(&path)?;
    for _ in 0..bytes.div_ceil(chunk.len()) {
        file.write_all(&chunk)?;
    }
    file.sync_all()?;
    let write = bytes as f64 / started.elapsed().as_secs_f64();
    drop_cache(&file);
    drop(file);
    let mut file = File::open(&path)?;
    drop_cache(&file);
    let started = Instant::now();
    let mut read = 0;
    loop {
        let n = file.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        read += n;
    }
    let read_speed = read as f64 / started.elapsed().as_secs_f64();
    std::fs::remove_file(path)?;
    Ok((write, read_speed))
}

fn drop_cache(file: &File) {
    // SAFETY: an advisory call on an open descriptor; it changes no memory of ours.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// Read `path` back in order: its digest, and whether its keys are non-decreasing.
fn read_back(path: &Path) -> Result<(Digest, bool)> {
    if !path.is_file() {
        return Err(DataFusionError::Execution(format!(
            "{} is not one file",
            path.display()
        )));
    }
    let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?.build()?;
    let mut digest = Digest::default();
    let mut sorted = true;
    let mut last: Option<Vec<u8>> = None;
    for batch in reader {
        let batch = batch?;
        digest.add_batch(&batch);
        let keys = batch.column(0).as_fixed_size_binary();
        for i in 0..keys.len() {
            let key = keys.value(i);
            if last.as_deref().is_some_and(|l| l > key) {
                sorted = false;
            }
        }
        if keys.len() > 0 {
            last = Some(keys.value(keys.len() - 1).to_vec());
        }
    }
    Ok((digest, sorted))
}

/// One timed run's figures.
struct Run {
    seconds: f64,
    /// RSS when the run started (the binary, the runtime, what earlier runs left).
    base_rss: u64,
    peak_rss: u64,
    /// How far the peak rose above `base_rss`.
    rss_rise: u64,
    /// Most live heap bytes (jemalloc's count) during the run, above what it started with.
    heap_rise: u64,
    output_bytes: u64,
    digest: Digest,
    sorted: bool,
}

/// Drop every file under `dir` from the page cache.
fn drop_dir_cache(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir)?.flatten() {
        drop_cache(&File::open(entry.path())?);
    }
    Ok(())
}

/// `COPY (SELECT key, payload FROM records [ORDER BY order_by]) TO out` (uncompressed,
/// like the input), timed, and its output read back.
async fn run_copy(
    ctx: &SessionContext,
    order_by: Option<&str>,
    input_dir: &Path,
    out: &Path,
) -> Result<Run> {
    let _ = std::fs::remove_file(out);
    let _ = std::fs::remove_dir_all(out);
    drop_dir_cache(input_dir)?;
    // Start from an allocator holding no free pages, whatever the run before left.
    allocator::Jemalloc.return_freed();
    let order_by = order_by
        .map(|o| format!(" ORDER BY {o}"))
        .unwrap_or_default();
    let sql = format!(
        "COPY (SELECT key, payload FROM records{order_by}) TO '{}' STORED AS PARQUET \
         OPTIONS ('format.compression' 'uncompressed', 'format.dictionary_enabled' 'false')",
        out.display()
    );
    let rss = RssWatch::start();
    let heap = heap_stats::HeapWatch::start();
    let heap_base = heap.base();
    let started = Instant::now();
    let result = ctx.sql(&sql).await?.collect().await;
    let seconds = started.elapsed().as_secs_f64();
    let heap_rise = heap.finish().saturating_sub(heap_base);
    result?;
    let (base_rss, peak_rss, rss_rise) = (rss.base, rss.peak(), rss.rise());
    let output_bytes = std::fs::metadata(out)?.len();
    let (digest, sorted) = read_back(out)?;
    Ok(Run {
        seconds,
        base_rss,
        peak_rss,
        rss_rise,
        heap_rise,
        output_bytes,
        digest,
        sorted,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    allocator::install();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args::flag_value(&args, name);
    let gb: f64 = arg("--gb").map(|s| s.parse().unwrap()).unwrap_or(2.0);
    let budget: ByteSize = arg("--budget").unwrap_or_else(|| "200MB".into()).parse()?;
    let dir = PathBuf::from(arg("--dir").unwrap_or_else(|| "target/sortbench".into()));
    let only = arg("--only");
    let shuffles = !args.iter().any(|a| a == "--no-shuffle");
    let memory_cap: Option<ByteSize> = arg("--memory-cap").map(|s| s.parse()).transpose()?;
    let rows = (gb * 1e9 / (KEY_BYTES + PAYLOAD_BYTES) as f64) as u64;

    // One directory per size: a table of another size is generated beside it.
    let input_dir = dir.join(format!("input-{rows}"));
    let input = generate(&input_dir, rows)?;
    let input_bytes: u64 = std::fs::read_dir(&input_dir)?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "parquet"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    // This VM's disk (virtual, cached by its host) measures differently from one minute to
    // the next: three probes, the median of each speed.
    let mut probes = (0..3)
        .map(|_| measure_disk(&dir, 1 << 30))
        .collect::<Result<Vec<_>>>()?;
    println!(
        "disk probes (write, read MB/s): {}",
        probes
            .iter()
            .map(|(w, r)| format!("({:.0}, {:.0})", w / 1e6, r / 1e6))
            .collect::<Vec<_>>()
            .join(" ")
    );
    probes.sort_by(|a, b| a.0.total_cmp(&b.0));
    let write_speed = probes[1].0;
    probes.sort_by(|a, b| a.1.total_cmp(&b.1));
    let read_speed = probes[1].1;
    let cores = flumen::config::available_cores();
    println!(
        "{rows} records ({} of Parquet), budget {budget} ({:.1}x smaller), {cores} cores; \
         disk (median of the probes): write {:.0} MB/s, read {:.0} MB/s",
        ByteSize(input_bytes),
        input_bytes as f64 / budget.0 as f64,
        write_speed / 1e6,
        read_speed / 1e6
    );

    let config = || SessionConfig::new().with_target_partitions(cores);
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_limit(budget.0 as usize, 1.0)
        .build_arc()?;
    let vanilla = SessionContext::new_with_config_rt(config(), runtime);
    // Vanilla DataFusion with no limit: the time a user with the memory would see.
    let unbounded = SessionContext::new_with_config(config());
    let mut flumen_config = flumen::FlumenConfig::default();
    flumen_config.memory_budget = budget;
    let flumen = flumen::session_with_config(config(), flumen_config.clone());
    // The same, counting only what blocks and operators reserved against the budget (as
    // before `flumen.budget_counts_heap`, and as a program that installs no allocator).
    let mut whole_config = flumen_config.clone();
    whole_config.sort_runs = false;
    let flumen_whole = flumen::session_with_config(config(), whole_config);
    flumen_config.budget_counts_heap = false;
    let flumen_reserved = flumen::session_with_config(config(), flumen_config);
    // `--set KEY=VALUE` (repeatable): a setting for every engine, e.g.
    // `datafusion.execution.parquet.enable_page_index=false`.
    let settings: Vec<&String> = args
        .iter()
        .zip(args.iter().skip(1))
        .filter(|(flag, _)| *flag == "--set")
        .map(|(_, setting)| setting)
        .collect();
    for ctx in [
        &vanilla,
        &unbounded,
        &flumen,
        &flumen_reserved,
        &flumen_whole,
    ] {
        let is_flumen = ctx
            .state()
            .config()
            .options()
            .extensions
            .get::<flumen::FlumenConfig>()
            .is_some();
        for setting in &settings {
            let (key, value) = setting.split_once('=').ok_or_else(|| {
                DataFusionError::Plan(format!("--set {setting}: expected KEY=VALUE"))
            })?;
            // flumen's settings are for flumen's sessions.
            if key.starts_with("flumen.") && !is_flumen {
                continue;
            }
            ctx.sql(&format!("SET {key} = '{value}'"))
                .await?
                .collect()
                .await?;
        }
        ctx.register_parquet(
            "records",
            input_dir.to_str().unwrap(),
            ParquetReadOptions::default(),
        )
        .await?;
    }

    let mut runs: Vec<(&str, &str, &SessionContext)> = vec![];
    if only.as_deref() != Some("flumen") && !args.iter().any(|a| a == "--no-unbounded") {
        runs.push(("sort", "vanilla-no-limit", &unbounded));
    }
    // The floor: the same COPY with no ORDER BY (streaming: any limit would do).
    runs.push(("copy", "vanilla-no-limit", &unbounded));
    if only.as_deref() != Some("flumen") {
        runs.push(("sort", "vanilla", &vanilla));
    }
    if only.as_deref() != Some("vanilla") {
        runs.push(("sort", "flumen", &flumen));
        if args.iter().any(|a| a == "--reserved-too") {
            runs.push(("sort", "flumen-reserved", &flumen_reserved));
        }
        if args.iter().any(|a| a == "--whole-ranges-too") {
            runs.push(("sort", "flumen-whole", &flumen_whole));
        }
    }
    if shuffles {
        if only.as_deref() != Some("flumen") {
            runs.push(("shuffle", "vanilla", &vanilla));
        }
        if only.as_deref() != Some("vanilla") {
            runs.push(("shuffle", "flumen", &flumen));
            runs.push(("shuffle2", "flumen", &flumen));
        }
    }
    println!(
        "{:>8} {:>15} {:>8} {:>8} {:>8} {:>7} {:>10} {:>10} {:>11} {:>11}",
        "run",
        "engine",
        "seconds",
        "MB/s",
        "% bound",
        "x copy",
        "base_rss",
        "peak_rss",
        "rise/budget",
        "heap/budget"
    );
    let mut shuffle_orders = vec![];
    let mut summary = vec![];
    let mut cap = None;
    let mut copy_seconds = None;
    for (what, engine, ctx) in runs {
        // The unlimited sort holds the table in memory: it runs before the cap.
        if let Some(size) = memory_cap
            && cap.is_none()
            && !(what == "sort" && engine == "vanilla-no-limit")
        {
            cap = Some(memory_cap::MemoryCap::enter(size.0).map_err(|e| {
                DataFusionError::Execution(format!(
                    "--memory-cap {size}: {e} (needs root and a cgroup memory controller)"
                ))
            })?);
            println!("(the runs below are capped at {size}, page cache included)");
        }
        let order_by = match what {
            "sort" => Some("key"),
            "copy" => None,
            _ => {
                let seed = if what == "shuffle2" { 2 } else { 1 };
                if engine == "flumen" {
                    ctx.sql(&format!("SET flumen.shuffle_seed = {seed}"))
                        .await?
                        .collect()
                        .await?;
                }
                Some("random()")
            }
        };
        let out = dir.join(format!("out-{what}-{engine}.parquet"));
        let run = match run_copy(ctx, order_by, &input_dir, &out).await {
            Ok(run) => run,
            Err(e) => {
                let first_line = e.to_string().lines().next().unwrap_or_default().to_string();
                println!("{what:>8} {engine:>15} failed: {first_line}");
                summary.push(format!("{what}_{engine}=failed"));
                // Vanilla under the memory limit may fail (the limit is what is measured);
                // flumen and unlimited vanilla must answer.
                if engine != "vanilla" {
                    verdict::fail(format!("{what} on {engine}: {first_line}"));
                }
                continue;
            }
        };
        let _ = std::fs::remove_file(&out);
        assert_eq!(run.digest.rows, input.rows, "{what} {engine}: row count");
        assert_eq!(run.digest.sum, input.sum, "{what} {engine}: checksum");
        if what == "copy" {
            copy_seconds = Some(run.seconds);
        } else if what == "sort" {
            assert!(run.sorted, "{what} {engine}: output not sorted");
        } else {
            assert_ne!(
                run.digest.order, input.order,
                "{what} {engine}: input order"
            );
            if engine == "flumen" {
                shuffle_orders.push(run.digest.order);
            }
        }
        // Read the input, write and read back runs of it, write the output. (For the copy,
        // the sort's bound over the copy's time: the most any sort could reach here.)
        let bound = (input_bytes + input_bytes) as f64 / read_speed
            + (input_bytes + run.output_bytes) as f64 / write_speed;
        let share = bound / run.seconds;
        let over_copy = copy_seconds.map_or(f64::NAN, |c| run.seconds / c);
        println!(
            "{what:>8} {engine:>15} {:>8.1} {:>8.1} {:>7.0}% {:>7.2} {:>10} {:>10} {:>11.2} {:>11.2}",
            run.seconds,
            input_bytes as f64 / 1e6 / run.seconds,
            share * 100.0,
            over_copy,
            ByteSize(run.base_rss).to_string(),
            ByteSize(run.peak_rss).to_string(),
            run.rss_rise as f64 / budget.0 as f64,
            run.heap_rise as f64 / budget.0 as f64
        );
        if what == "copy" {
            summary.push(format!(
                "copy_s={:.1} copy_bound_share={share:.2}",
                run.seconds
            ));
            continue;
        }
        summary.push(format!(
            "{what}_{engine}_s={:.1} {what}_{engine}_bound={:.2} {what}_{engine}_over_copy={:.2} \
             {what}_{engine}_rss_rise={} {what}_{engine}_heap_rise={}",
            run.seconds, share, over_copy, run.rss_rise, run.heap_rise
        ));
    }
    if let [a, b] = shuffle_orders[..] {
        assert_ne!(a, b, "two seeds gave the same order");
        println!("two seeds: two different orders, both permutations of the input");
    }
    if let Some(peak) = cap.as_ref().and_then(|c| c.peak()) {
        println!(
            "capped runs' peak memory, page cache included: {}",
            ByteSize(peak)
        );
    }
    drop(cap);
    println!(
        "SUMMARY gb={gb} budget={} memory_cap={} disk_write_mbs={:.0} disk_read_mbs={:.0} {}",
        budget.0,
        memory_cap.map(|c| c.0).unwrap_or(0),
        write_speed / 1e6,
        read_speed / 1e6,
        summary.join(" ")
    );
    verdict::finish();
    Ok(())
}
