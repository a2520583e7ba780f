//! The model-output cache (`flumen.model_cache`) with the real model over the demo docs:
//! the vectors it returns are the computed ones bit for bit, the model sees only misses, a
//! changed model file misses, a damaged segment is recomputed rather than returned, worker
//! processes share it, and `flumen` processes SIGKILLed while writing it leave nothing that
//! reads back wrong.
//!
//! Needs the model: `cargo run --release --bin flumen -- install-model` (`.ci/run` does it).

use crate::common;
use crate::common::s3_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;
use flumen::exec::FlumenExec;

const DOCS: usize = 200;

/// Each doc's vector, as the bits of its floats.
type Vectors = BTreeMap<i64, Vec<u32>>;

/// A session over the demo docs in `dir` with the cache at `cache` ('' for none).
async fn session(dir: &Path, cache: &str) -> SessionContext {
    session_with(dir, cache, FlumenConfig::default()).await
}

/// [`session`] with `config`.
async fn session_with(dir: &Path, cache: &str, config: FlumenConfig) -> SessionContext {
    let docs = dir.join("docs.parquet");
    flumen::demo::ensure_docs(&docs, DOCS).unwrap();
    let ctx = flumen::session(config);
    common::collect(&ctx, "SET flumen.device = 'cpu'").await;
    common::collect(&ctx, &format!("SET flumen.model_cache = '{cache}'")).await;
    common::collect(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
            docs.display()
        ),
    )
    .await;
    ctx
}

/// The vectors of `sql` (`id`, `v`) and the cache's figures, summed over the operators.
async fn embed(ctx: &SessionContext, sql: &str) -> (Vectors, BTreeMap<String, u64>) {
    let (vectors, figures) = embed_with_model_figures(ctx, sql).await;
    let cache = figures
        .into_iter()
        .filter(|(name, _)| name.starts_with("model_cache_"))
        .collect();
    (vectors, cache)
}

/// [`embed`] with every model figure the operators report (the model's own as well).
async fn embed_with_model_figures(
    ctx: &SessionContext,
    sql: &str,
) -> (Vectors, BTreeMap<String, u64>) {
    let (batches, plan) = common::run_plan(ctx, sql).await;
    let vectors: Vectors = common::embedding_bits_by_id(&batches).into_iter().collect();
    let exec = plan.downcast_ref::<FlumenExec>().unwrap();
    let mut figures = BTreeMap::new();
    for op in &exec.graph().operators {
        for (name, value) in exec.run_metrics().operator(op.id).model_metrics() {
            *figures.entry(name).or_default() += value;
        }
    }
    (vectors, figures)
}

/// How many models the session's `embed` has loaded in this process.
fn embed_loads(ctx: &SessionContext) -> u64 {
    let state = ctx.state();
    let udf = state
        .scalar_functions()
        .get("embed")
        .expect("embed is registered");
    flumen::functions::accelerator::as_accelerator_udf(udf)
        .expect("embed is an accelerator function")
        .loads()
}

fn figure(figures: &BTreeMap<String, u64>, name: &str) -> u64 {
    figures
        .get(&format!("model_cache_{name}"))
        .copied()
        .unwrap_or(0)
}

/// Every doc's vector (of its start: short texts keep the debug build's model quick).
const ALL: &str = "SELECT id, embed(substr(body, 1, 160)) AS v FROM docs";

/// The segments under a cache directory.
fn segments(cache: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for dir in std::fs::read_dir(cache).into_iter().flatten().flatten() {
        for file in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if file.path().extension().is_some_and(|e| e == "fmc") {
                found.push(file.path());
            }
        }
    }
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_vectors_are_the_computed_ones_and_the_model_sees_only_misses() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let cache_text = cache.display().to_string();
    let (reference, off) = embed(&session(dir.path(), "").await, ALL).await;
    assert_eq!(reference.len(), DOCS);
    assert!(off.is_empty(), "the cache ran while off: {off:?}");

    // Half the docs first: all misses, computed as without the cache.
    let ctx = session(dir.path(), &cache_text).await;
    let (half, figures) = embed(&ctx, &format!("{ALL} WHERE id % 2 = 0")).await;
    assert_eq!(figure(&figures, "misses"), DOCS as u64 / 2, "{figures:?}");
    assert_eq!(figure(&figures, "hits"), 0);
    assert!(figure(&figures, "bytes_written") > 0);
    assert!(
        embed_loads(&ctx) > 0,
        "the misses were computed by no model"
    );
    for (id, v) in &half {
        assert_eq!(v, &reference[id], "doc {id}");
    }
    // All of them, in another session: the model sees only the other half.
    let (all, figures) = embed(&session(dir.path(), &cache_text).await, ALL).await;
    assert_eq!(figure(&figures, "hits"), DOCS as u64 / 2, "{figures:?}");
    assert_eq!(figure(&figures, "misses"), DOCS as u64 / 2);
    assert_eq!(
        all, reference,
        "a merged result differs from the computed one"
    );
    // Again: every row from the cache, bit for bit, and no model loaded for it. The
    // session's own function counts its loads: tests running beside this one in the same
    // process load models too.
    let ctx = session(dir.path(), &cache_text).await;
    let (again, figures) = embed(&ctx, ALL).await;
    assert_eq!(figure(&figures, "hits"), DOCS as u64, "{figures:?}");
    assert_eq!(figure(&figures, "misses"), 0);
    assert_eq!(again, reference);
    assert_eq!(
        embed_loads(&ctx),
        0,
        "a query the cache answered in full loaded the model"
    );
    // The lookup runs before the tokenizer: with the tokenizer in the CPU stage the keys
    // are the same, every row hits, and the tokenizer runs for no row.
    let ctx = session(dir.path(), &cache_text).await;
    common::collect(&ctx, "SET flumen.preprocess_on_cpu = 'true'").await;
    let (stepped, figures) = embed(&ctx, ALL).await;
    assert_eq!(figure(&figures, "hits"), DOCS as u64, "{figures:?}");
    assert_eq!(stepped, reference);

    // A changed model file is another model: every row misses.
    let model = flumen::functions::embedding::model_files::model_dir("");
    let changed = dir.path().join("changed-model");
    std::fs::create_dir_all(&changed).unwrap();
    for name in ["tokenizer.json", "model.safetensors"] {
        std::fs::hard_link(model.join(name), changed.join(name))
            .or_else(|_| std::fs::copy(model.join(name), changed.join(name)).map(|_| ()))
            .unwrap();
    }
    let config = std::fs::read_to_string(model.join("config.json")).unwrap();
    std::fs::write(changed.join("config.json"), format!("{config}\n")).unwrap();
    let ctx = session(dir.path(), &cache_text).await;
    common::collect(
        &ctx,
        &format!("SET flumen.model_dir = '{}'", changed.display()),
    )
    .await;
    let (other, figures) = embed(&ctx, ALL).await;
    assert_eq!(figure(&figures, "hits"), 0, "{figures:?}");
    assert_eq!(other, reference);

    // A damaged segment is found out and its rows computed again, never returned.
    let original: Vec<PathBuf> = segments(&cache)
        .into_iter()
        .filter(|p| !p.starts_with(&changed))
        .collect();
    let victim = &original[0];
    let mut bytes = std::fs::read(victim).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(victim, bytes).unwrap();
    let (healed, figures) = embed(&session(dir.path(), &cache_text).await, ALL).await;
    // This process read the segment before it was damaged; a fresh reader is another
    // process (below). Either way the answer is the computed one.
    assert_eq!(healed, reference);
    let out = run_flumen(&[
        "-c",
        &format!("SET flumen.model_cache = '{cache_text}'"),
        "-c",
        &docs_table(dir.path()),
        "-c",
        &format!("EXPLAIN ANALYZE {ALL}"),
    ]);
    assert!(out.contains("model_cache_corrupt_segments=1"), "{out}");
    assert!(!victim.exists(), "the damaged segment was kept");
    println!("cache figures of the last in-process run: {figures:?}");
}

/// The precision is part of the model's identity: fp32 vectors in the cache are not bf16's
/// answers (every row misses and is computed in bf16), and each precision then hits its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_precision_caches_its_own_vectors() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache").display().to_string();
    let bf16_session = || async {
        let ctx = session(dir.path(), &cache).await;
        common::collect(&ctx, "SET flumen.embed_precision = 'bf16'").await;
        ctx
    };
    let (fp32, figures) = embed(&session(dir.path(), &cache).await, ALL).await;
    assert_eq!(figure(&figures, "misses"), DOCS as u64, "{figures:?}");
    let (bf16, figures) = embed(&bf16_session().await, ALL).await;
    assert_eq!(
        figure(&figures, "hits"),
        0,
        "bf16 read fp32's vectors: {figures:?}"
    );
    let differ = bf16.iter().filter(|(id, v)| fp32[id] != **v).count();
    assert!(
        differ > DOCS / 2,
        "only {differ} bf16 vectors differ from fp32's"
    );
    for (precision, expected, ctx) in [
        ("fp32", &fp32, session(dir.path(), &cache).await),
        ("bf16", &bf16, bf16_session().await),
    ] {
        let (again, figures) = embed(&ctx, ALL).await;
        assert_eq!(
            figure(&figures, "hits"),
            DOCS as u64,
            "{precision}: {figures:?}"
        );
        assert_eq!(&again, expected, "{precision}: cached vectors differ");
    }
}

/// `CREATE EXTERNAL TABLE docs` over the test's demo docs.
fn docs_table(dir: &Path) -> String {
    format!(
        "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
        dir.join("docs.parquet").display()
    )
}

/// The `flumen` binary, computing on the CPU, without the demo table.
fn flumen_on_cpu() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_flumen"));
    command.args(["--no-demo", "--quiet", "-c", "SET flumen.device = 'cpu'"]);
    command
}

/// Run the `flumen` binary on the CPU with `args`; its standard output (it must succeed).
fn run_flumen(args: &[&str]) -> String {
    let out = flumen_on_cpu().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Worker processes read and write the same cache: a run on two workers fills it, a second
/// run on them computes nothing, and a run in this process computes nothing either. The
/// workers' cache and model figures come back to the driver as a local run's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_share_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let cache_text = cache.display().to_string();
    let (reference, _) = embed(&session(dir.path(), "").await, ALL).await;
    let config = common::in_worker_processes(2);
    let workers = session_with(dir.path(), &cache_text, config).await;
    let (on_workers, figures) = embed_with_model_figures(&workers, ALL).await;
    assert_eq!(on_workers, reference);
    assert_eq!(figure(&figures, "misses"), DOCS as u64, "{figures:?}");
    assert_eq!(figure(&figures, "hits"), 0, "{figures:?}");
    assert!(figure(&figures, "bytes_written") > 0, "{figures:?}");
    assert!(
        figures.contains_key("embed_load_ms"),
        "the model's figures did not come back from its worker: {figures:?}"
    );
    // Every row read back by the workers' lookups, which read the segments their
    // processes had not seen.
    let (again, figures) = embed(&workers, ALL).await;
    assert_eq!(again, reference);
    assert_eq!(figure(&figures, "hits"), DOCS as u64, "{figures:?}");
    assert_eq!(figure(&figures, "misses"), 0, "{figures:?}");
    assert!(figure(&figures, "bytes_read") > 0, "{figures:?}");
    let ours = std::process::id().to_string();
    let written = segments(&cache);
    assert!(!written.is_empty(), "the workers wrote no segment");
    let by_workers = written
        .iter()
        .filter(|p| {
            !p.file_name()
                .unwrap()
                .to_string_lossy()
                .contains(&format!("-{ours}-"))
        })
        .count();
    println!(
        "{} segments, {by_workers} written by worker processes",
        written.len()
    );
    let (here, figures) = embed(&session(dir.path(), &cache_text).await, ALL).await;
    assert_eq!(here, reference);
    assert_eq!(figure(&figures, "misses"), 0, "{figures:?}");
    assert_eq!(figure(&figures, "hits"), DOCS as u64);
}

/// `flumen` processes filling the cache are SIGKILLed mid-fill, each at a seeded instant:
/// a seeded 0-40 ms after the first to third segment it wrote appeared (instants tied to its
/// progress, not to the clock, so that a loaded machine still kills it while it writes);
/// then a run over the cache they left returns every vector as computed, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_killed_mid_write_leave_nothing_that_reads_back_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let cache_text = cache.display().to_string();
    let (reference, _) = embed(&session(dir.path(), "").await, ALL).await;
    let mut seeded = common::Seeded(67);
    let mut killed_mid_fill = 0;
    for attempt in 0..3 {
        let before = segments(&cache).len();
        let after_segments = 1 + (seeded.next() * 3.0) as usize;
        let then = Duration::from_millis((seeded.next() * 40.0) as u64);
        let mut child = flumen_on_cpu()
            .args(["-c", &format!("SET flumen.model_cache = '{cache_text}'")])
            .args(["-c", "SET flumen.target_block_rows = 8"])
            .args(["-c", &docs_table(dir.path())])
            .args([
                "-c",
                &format!(
                    "COPY ({ALL}) TO '{}'",
                    dir.path().join("out.parquet").display()
                ),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reached: Option<std::time::Instant> = None;
        common::kill_when(&mut child, "a cache writer", || match reached {
            Some(at) => at.elapsed() >= then,
            None => {
                if segments(&cache).len() >= before + after_segments {
                    reached = Some(std::time::Instant::now());
                }
                false
            }
        });
        let status = child.wait().unwrap();
        let killed = std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL);
        assert!(
            killed || status.success(),
            "a cache writer failed: {status}"
        );
        killed_mid_fill += usize::from(killed);
        println!(
            "attempt {attempt}: {} ({after_segments} segments + {then:?}), {} segments now",
            if killed { "killed" } else { "finished first" },
            segments(&cache).len()
        );
    }
    assert!(killed_mid_fill > 0, "every writer finished before its kill");
    let left = segments(&cache).len();
    assert!(
        left > 0,
        "no writer got as far as a segment before its kill"
    );
    let (after, figures) = embed(&session(dir.path(), &cache_text).await, ALL).await;
    println!("after the kills ({left} segments): {figures:?}");
    assert!(figure(&figures, "hits") > 0, "{figures:?}");
    // The other processes' segments were read here, and this query says so.
    assert!(figure(&figures, "bytes_read") > 0, "{figures:?}");
    assert_eq!(
        after, reference,
        "a vector read back from the cache differs"
    );
    assert_eq!(figure(&figures, "corrupt_segments"), 0);
    // `flumen cache stats` names the model and its segments; `clear` empties the cache.
    let cache_cli = |action: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_flumen"))
            .args(["cache", action, &cache_text])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let stats = cache_cli("stats");
    assert!(
        stats.contains("embed all-MiniLM-L6-v2 files") && stats.contains(": 1 models,"),
        "{stats}"
    );
    assert!(cache_cli("clear").contains("cleared"));
    assert!(segments(&cache).is_empty());
    assert!(cache_cli("stats").contains(": 0 models, 0 bytes"));
}

/// A cache on S3 (a real moto server on loopback) works as a local one: a first `flumen`
/// process fills it, a second reads every vector back, the same bits as computed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_on_s3_works_like_a_local_one() {
    let Some(server) = s3_server::S3Server::start() else {
        common::skip_missing_tool("moto_server not found (run tests/install-test-tools.sh)");
        return;
    };
    server.create_bucket("cache");
    let dir = tempfile::tempdir().unwrap();
    let (reference, _) = embed(&session(dir.path(), "").await, ALL).await;
    let run = |out: &str, explain: bool| {
        let mut command = flumen_on_cpu();
        command
            .args(["-c", "SET flumen.model_cache = 's3://cache/models'"])
            .args(["-c", &docs_table(dir.path())])
            .env("AWS_ENDPOINT", &server.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
        if explain {
            command.args(["-c", &format!("EXPLAIN ANALYZE {ALL}")]);
        }
        command.args([
            "-c",
            &format!("COPY ({ALL}) TO '{}'", dir.path().join(out).display()),
        ]);
        let out = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    run("first.parquet", false);
    let second = run("second.parquet", true);
    assert!(
        second.contains(&format!("model_cache_hits={DOCS}"))
            && second.contains("model_cache_misses=0"),
        "{second}"
    );
    let read = flumen::session(FlumenConfig::default());
    for out in ["first.parquet", "second.parquet"] {
        let sql = format!("SELECT * FROM '{}'", dir.path().join(out).display());
        let (vectors, _) = embed(&read.clone().enable_url_table(), &sql).await;
        assert_eq!(vectors, reference, "{out}");
    }
}
