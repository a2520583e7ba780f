//! sqllogictest runner: flumen's own `sql/*.slt` files, then the test files that
//! `datafusion-sqllogictest` 55.2.0 ships, each run through vanilla DataFusion and through a
//! flumen session. A file counts against flumen only when vanilla DataFusion passes it.
//!
//! By default the upstream part runs `CI_SUBSET` (a few minutes on 2 cores);
//! `FLUMEN_SLT=full cargo test --test sqllogictests` runs every shipped file and prints the
//! pass counts recorded in `docs/sqllogictest.md`. `FLUMEN_SLT=ours` runs only `sql/`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_sqllogictest::{
    DataFusion, TestContext, df_value_validator, read_dir_recursive, setup_scratch_dir,
    value_normalizer,
};
use flumen::FlumenConfig;
use indicatif::ProgressBar;
use sqllogictest::{Record, parse_file, strict_column_validator};

/// Upstream files run in CI: broad SQL coverage that runs in a few minutes on 2 cores.
const CI_SUBSET: &[&str] = &[
    "aggregate.slt",
    "group_by.slt",
    "joins.slt",
    "order.slt",
    "window.slt",
    "limit.slt",
    "union.slt",
    "subquery.slt",
    "cte.slt",
    "select.slt",
    "expr.slt",
    "distinct_on.slt",
    "copy.slt",
    "insert.slt",
    "insert_to_external.slt",
    "create_external_table.slt",
    "errors.slt",
    "math.slt",
    "strings.slt",
    "scalar.slt",
    "predicates.slt",
    "tpch/tpch.slt",
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Vanilla,
    Flumen,
}

/// Errors of one file run, empty when it passed.
async fn run_file(path: &Path, relative: &Path, engine: Engine) -> Vec<String> {
    let Some(test_ctx) = TestContext::try_new_for_test_file(relative).await else {
        return vec![];
    };
    let ctx: SessionContext = match engine {
        Engine::Vanilla => test_ctx.session_ctx().clone(),
        Engine::Flumen => {
            let mut config = FlumenConfig::default();
            // DataFusion's files assert DataFusion's own EXPLAIN text.
            config.explain_operators = false;
            flumen::into_flumen(test_ctx.session_ctx(), config)
        }
    };
    if let Err(e) = setup_scratch_dir(relative) {
        return vec![format!("scratch dir: {e}")];
    }
    let config_changes = Arc::new(Mutex::new(Vec::new()));
    let relative_owned = relative.to_path_buf();
    let changes = Arc::clone(&config_changes);
    let mut runner = sqllogictest::Runner::new(move || {
        let ctx = ctx.clone();
        let relative = relative_owned.clone();
        let changes = Arc::clone(&changes);
        async move {
            Ok(DataFusion::new(ctx, relative, ProgressBar::hidden())
                .with_config_change_errors(changes))
        }
    });
    runner.add_label("Datafusion");
    runner.with_column_validator(strict_column_validator);
    runner.with_normalizer(value_normalizer);
    runner.with_validator(df_value_validator);
    let records = match parse_file(path) {
        Ok(r) => r,
        Err(e) => return vec![format!("parse: {e}")],
    };
    let mut errors = vec![];
    for record in records {
        if let Record::Halt { .. } = record {
            break;
        }
        if let Err(e) = runner.run_async(record).await {
            errors.push(e.to_string());
        }
    }
    runner.shutdown_async().await;
    errors
}

fn upstream_dir() -> Option<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let src = cargo_home.join("registry").join("src");
    std::fs::read_dir(src)
        .ok()?
        .flatten()
        .map(|d| d.path().join("datafusion-sqllogictest-55.2.0"))
        .find(|p| p.join("test_files").is_dir())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

async fn run_ours(root: &Path) -> (usize, usize) {
    let dir = root.join("sql");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "slt"));
    files.sort();
    let (mut passed, mut failed) = (0, 0);
    for path in files {
        let relative = PathBuf::from(path.file_name().unwrap());
        let errors = run_ours_file(&path, &relative).await;
        if errors.is_empty() {
            println!("flumen sql/{}: ok", relative.display());
            passed += 1;
        } else {
            println!("flumen sql/{}: FAILED", relative.display());
            for e in errors.iter().take(5) {
                println!("{e}");
            }
            failed += 1;
        }
    }
    (passed, failed)
}

/// flumen's own files run on a flumen session with default settings and 4 partitions.
async fn run_ours_file(path: &Path, relative: &Path) -> Vec<String> {
    let ctx = flumen::session_with_config(
        SessionConfig::new().with_target_partitions(4),
        FlumenConfig::default(),
    );
    let relative = relative.to_path_buf();
    let mut runner = sqllogictest::Runner::new(move || {
        let ctx = ctx.clone();
        let relative = relative.clone();
        async move { Ok(DataFusion::new(ctx, relative, ProgressBar::hidden())) }
    });
    runner.with_column_validator(strict_column_validator);
    runner.with_normalizer(value_normalizer);
    runner.with_validator(df_value_validator);
    let records = match parse_file(path) {
        Ok(r) => r,
        Err(e) => return vec![format!("parse: {e}")],
    };
    let mut errors = vec![];
    for record in records {
        if let Err(e) = runner.run_async(record).await {
            errors.push(e.to_string());
        }
    }
    errors
}

async fn run_upstream(root: &Path, full: bool) -> Result<(usize, usize), String> {
    let source = upstream_dir().ok_or("datafusion-sqllogictest 55.2.0 sources not found")?;
    let work = root.join("target").join("slt-upstream");
    if !work.join("test_files").is_dir() {
        copy_dir(&source, &work).map_err(|e| e.to_string())?;
    }
    std::env::set_current_dir(&work).map_err(|e| e.to_string())?;
    let files: Vec<PathBuf> = if full {
        let mut all: Vec<PathBuf> = read_dir_recursive("test_files")
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "slt"))
            .filter_map(|p| p.strip_prefix("test_files").ok().map(Path::to_path_buf))
            .collect();
        all.sort();
        all
    } else {
        CI_SUBSET.iter().map(PathBuf::from).collect()
    };
    let (mut vanilla_passed, mut flumen_passed, mut flumen_failed) = (0, 0, 0);
    let mut excluded = vec![];
    for relative in &files {
        let path = Path::new("test_files").join(relative);
        let started = Instant::now();
        let vanilla_errors = run_file(&path, relative, Engine::Vanilla).await;
        if !vanilla_errors.is_empty() {
            excluded.push(relative.display().to_string());
            continue;
        }
        vanilla_passed += 1;
        let errors = run_file(&path, relative, Engine::Flumen).await;
        if errors.is_empty() {
            flumen_passed += 1;
            println!(
                "upstream {}: ok ({:.1}s)",
                relative.display(),
                started.elapsed().as_secs_f64()
            );
        } else {
            flumen_failed += 1;
            println!("upstream {}: FAILED under flumen", relative.display());
            for e in errors.iter().take(if full { 2 } else { 5 }) {
                println!("{e}");
            }
        }
    }
    println!(
        "upstream sqllogictest files: {} run, vanilla DataFusion passed {}, flumen passed {} of those; \
         excluded (vanilla fails them here too): {}",
        files.len(),
        vanilla_passed,
        flumen_passed,
        excluded.join(", ")
    );
    Ok((flumen_passed, flumen_failed))
}

fn main() -> ExitCode {
    let mode = std::env::var("FLUMEN_SLT").unwrap_or_default();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = runtime.block_on(async {
        let (mut passed, mut failed) = run_ours(&root).await;
        if mode != "ours" {
            let (p, f) = run_upstream(&root, mode == "full").await?;
            passed += p;
            failed += f;
        }
        Ok::<_, String>((passed, failed))
    });
    match result {
        Ok((passed, failed)) => {
            println!("sqllogictests: {passed} passed, {failed} failed");
            if failed == 0 || mode == "full" {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            println!("sqllogictests: {e}");
            ExitCode::FAILURE
        }
    }
}
