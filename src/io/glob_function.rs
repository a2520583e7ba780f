//! `glob('pattern')` (DuckDB's function): the files a path, directory, glob or URL names, a
//! row each, with their size and modification time, listed through the session's object
//! stores as a scan would list them. What `read_parquet(pattern)` would read, before it
//! reads it.

use std::sync::Arc;

use datafusion::arrow::array::UInt64Builder;
use datafusion::arrow::array::{ArrayRef, RecordBatch, StringBuilder, TimestampMicrosecondBuilder};
use datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::error::Result;
use datafusion::execution::SessionState;
use futures::TryStreamExt;

use super::file_functions::{one_batch_table, read_call, shown_location};

/// The `glob` table function.
#[derive(Debug, Default)]
pub struct Glob;

impl TableFunctionImpl for Glob {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let batch = read_call("glob", &args, |state, paths| async move {
            files_listed(state, &paths).await
        })?;
        one_batch_table(batch)
    }
}

/// A row for each file `paths` name (none where none matches), in the order listed.
async fn files_listed(state: &SessionState, paths: &[String]) -> Result<RecordBatch> {
    let mut file = StringBuilder::new();
    let mut size = UInt64Builder::new();
    let mut modified = TimestampMicrosecondBuilder::new().with_timezone("UTC");
    for path in paths {
        let url = ListingTableUrl::parse(path)?;
        let store = state.runtime_env().object_store(&url)?;
        let mut listed: Vec<_> = (url.list_all_files(state, store.as_ref(), "").await?)
            .try_collect()
            .await?;
        listed.sort_by(|a, b| a.location.cmp(&b.location));
        for meta in listed {
            file.append_value(shown_location(&url, &meta.location));
            size.append_value(meta.size);
            modified.append_value(meta.last_modified.timestamp_micros());
        }
    }
    let columns: Vec<(Field, ArrayRef)> = vec![
        (
            Field::new("file", DataType::Utf8, false),
            Arc::new(file.finish()),
        ),
        (
            Field::new("size", DataType::UInt64, false),
            Arc::new(size.finish()),
        ),
        (
            Field::new(
                "last_modified",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                false,
            ),
            Arc::new(modified.finish()),
        ),
    ];
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = columns.into_iter().unzip();
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
}
