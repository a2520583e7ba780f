//! `flumen extract --checkpoint INPUT OUTPUT_DIR`: the main job over a source without a
//! change feed (a Parquet file or directory), resumable by key, as Ray Data's and Daft's
//! checkpoints are: the output is a directory of parts, each written whole by one `COPY`
//! (staged, then committed), each holding the features of the next `chunk_rows` input rows
//! by `id` not yet in any part. A run killed mid-way loses at most the part it was writing;
//! the next run skips every id the committed parts hold and goes on from there.

use std::path::Path;
use std::time::Instant;

use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::{ParquetReadOptions, SessionContext};

use crate::feature_job::FEATURES;

/// What one checkpointed run did.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointRun {
    /// Rows the output held before this run.
    pub done_before: u64,
    /// Rows this run computed.
    pub computed_rows: u64,
    /// Parts this run wrote.
    pub parts_written: usize,
    /// Seconds the run took.
    pub seconds: f64,
}

/// The parts of `output` (`part-NNNNN.parquet`), by number.
fn parts(output: &Path) -> Vec<(u64, std::path::PathBuf)> {
    let mut found: Vec<(u64, std::path::PathBuf)> = (std::fs::read_dir(output).into_iter())
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().to_string();
            let number = name
                .strip_prefix("part-")?
                .strip_suffix(".parquet")?
                .parse()
                .ok()?;
            Some((number, entry.path()))
        })
        .collect();
    found.sort();
    found
}

/// The number of rows `sql` counts (its first column's one value).
async fn count(ctx: &SessionContext, sql: &str) -> Result<u64> {
    let batches = ctx.sql(sql).await?.collect().await?;
    let value = batches
        .first()
        .filter(|b| b.num_rows() > 0)
        .and_then(|b| {
            datafusion::arrow::compute::cast(
                b.column(0),
                &datafusion::arrow::datatypes::DataType::UInt64,
            )
            .ok()
        })
        .map(|a| {
            a.as_any()
                .downcast_ref::<datafusion::arrow::array::UInt64Array>()
                .map_or(0, |a| a.value(0))
        })
        .unwrap_or(0);
    Ok(value)
}

/// Compute the features of every row of `input` not yet in `output`'s parts, `chunk_rows`
/// rows (by `id`) per part.
pub async fn extract_with_checkpoint(
    ctx: &SessionContext,
    input: &Path,
    output: &Path,
    chunk_rows: usize,
) -> Result<CheckpointRun> {
    let started = Instant::now();
    let text = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| DataFusionError::Plan(format!("path {} is not UTF-8", p.display())))
    };
    std::fs::create_dir_all(output).map_err(|e| {
        DataFusionError::Execution(format!("cannot create {}: {e}", output.display()))
    })?;
    let (input_name, done_name) = (
        format!("__flumen_checkpoint_input_{}", std::process::id()),
        format!("__flumen_checkpoint_done_{}", std::process::id()),
    );
    ctx.register_parquet(&input_name, text(input)?, ParquetReadOptions::default())
        .await?;
    let mut run = CheckpointRun {
        done_before: 0,
        computed_rows: 0,
        parts_written: 0,
        seconds: 0.0,
    };
    let result = async {
        loop {
            let written = parts(output);
            let filter = match written.is_empty() {
                true => String::new(),
                false => {
                    let _ = ctx.deregister_table(&done_name);
                    let files: Vec<String> = written
                        .iter()
                        .map(|(_, p)| text(p))
                        .collect::<Result<_>>()?;
                    let done = ctx
                        .read_parquet(files, ParquetReadOptions::default())
                        .await?
                        .select_columns(&["id"])?;
                    ctx.register_table(&done_name, done.into_view())?;
                    if run.parts_written == 0 {
                        run.done_before =
                            count(ctx, &format!("SELECT count(*) FROM {done_name}")).await?;
                    }
                    format!("WHERE id NOT IN (SELECT id FROM {done_name})")
                }
            };
            let next = written.last().map_or(0, |(n, _)| n + 1);
            let part = output.join(format!("part-{next:05}.parquet"));
            // The limit below the projection: only the chunk's rows reach the model.
            let rows = count(
                ctx,
                &format!(
                    "COPY (SELECT {FEATURES} FROM \
                       (SELECT * FROM {input_name} {filter} ORDER BY id LIMIT {chunk_rows})) \
                     TO '{}' STORED AS PARQUET",
                    text(&part)?.replace('\'', "''")
                ),
            )
            .await?;
            if rows == 0 {
                let _ = std::fs::remove_file(&part);
                return Ok::<(), DataFusionError>(());
            }
            run.computed_rows += rows;
            run.parts_written += 1;
        }
    }
    .await;
    let _ = ctx.deregister_table(&input_name);
    let _ = ctx.deregister_table(&done_name);
    result?;
    run.seconds = started.elapsed().as_secs_f64();
    Ok(run)
}
