//! `parquet_metadata('path')`: what a Parquet file's footer says, a row per column chunk of
//! each row group, with the columns datafusion-cli's function of that name has (its
//! statistics' min and max as text, sizes, offsets, compression and encodings). The path is a
//! file, a directory (its `.parquet` files), a glob or an object store's URL, or a list of
//! them. It shows what a scan can prune by: how rows fall into row groups, and the bounds
//! each group's statistics give.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Int64Builder, RecordBatch, StringBuilder};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use datafusion::parquet::file::statistics::Statistics;
use futures::{StreamExt, TryStreamExt};

use super::file_functions::{one_batch_table, read_call, shown_location};

/// Footers read at once (a directory of many small files is many round trips to its store).
const FOOTERS_AT_ONCE: usize = 32;

/// The `parquet_metadata` table function.
#[derive(Debug, Default)]
pub struct ParquetMetadata;

impl TableFunctionImpl for ParquetMetadata {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let batch = read_call("parquet_metadata", &args, |state, paths| async move {
            footers_read(state, &paths).await
        })?;
        one_batch_table(batch)
    }
}

/// The rows of every Parquet file `paths` name, in the order listed.
async fn footers_read(state: &SessionState, paths: &[String]) -> Result<RecordBatch> {
    let mut rows = MetadataRows::default();
    let footer_cache = state.runtime_env().cache_manager.get_file_metadata_cache();
    for path in paths {
        let url = ListingTableUrl::parse(path)?;
        let store = state.runtime_env().object_store(&url)?;
        let extension = if url.is_collection() { ".parquet" } else { "" };
        let files: Vec<_> = (url.list_all_files(state, store.as_ref(), extension).await?)
            .try_collect()
            .await?;
        if files.is_empty() {
            return Err(DataFusionError::Plan("no file found there".into()));
        }
        let reads = futures::stream::iter(files.into_iter().map(|file| {
            let name = shown_location(&url, &file.location);
            let (store, footer_cache) = (Arc::clone(&store), Arc::clone(&footer_cache));
            async move {
                // Through the session's footer cache, as a scan reads it.
                let metadata = DFParquetMetadata::new(store.as_ref(), &file)
                    .with_file_metadata_cache(Some(footer_cache))
                    .with_page_index_policy(Some(PageIndexPolicy::Skip))
                    .fetch_metadata()
                    .await
                    .map_err(|e| DataFusionError::Plan(format!("'{name}' is not Parquet: {e}")))?;
                Ok::<_, DataFusionError>((name, metadata))
            }
        }))
        .buffered(FOOTERS_AT_ONCE);
        let footers: Vec<_> = reads.try_collect().await?;
        for (name, metadata) in footers {
            rows.add_file(&name, &metadata);
        }
    }
    rows.finish()
}

/// The columns of the function's rows, as they are built.
#[derive(Default)]
struct MetadataRows {
    filename: StringBuilder,
    row_group_id: Int64Builder,
    row_group_num_rows: Int64Builder,
    row_group_num_columns: Int64Builder,
    row_group_bytes: Int64Builder,
    column_id: Int64Builder,
    file_offset: Int64Builder,
    num_values: Int64Builder,
    path_in_schema: StringBuilder,
    physical_type: StringBuilder,
    stats_min: StringBuilder,
    stats_max: StringBuilder,
    stats_null_count: Int64Builder,
    stats_distinct_count: Int64Builder,
    stats_min_value: StringBuilder,
    stats_max_value: StringBuilder,
    compression: StringBuilder,
    encodings: StringBuilder,
    index_page_offset: Int64Builder,
    dictionary_page_offset: Int64Builder,
    data_page_offset: Int64Builder,
    total_compressed_size: Int64Builder,
    total_uncompressed_size: Int64Builder,
}

impl MetadataRows {
    /// A row for each column chunk of each row group of the file `name`.
    fn add_file(&mut self, name: &str, metadata: &ParquetMetaData) {
        for (group_id, group) in metadata.row_groups().iter().enumerate() {
            for (column_id, column) in group.columns().iter().enumerate() {
                self.filename.append_value(name);
                self.row_group_id.append_value(group_id as i64);
                self.row_group_num_rows.append_value(group.num_rows());
                self.row_group_num_columns
                    .append_value(group.num_columns() as i64);
                self.row_group_bytes.append_value(group.total_byte_size());
                self.column_id.append_value(column_id as i64);
                self.file_offset.append_value(column.file_offset());
                self.num_values.append_value(column.num_values());
                self.path_in_schema
                    .append_value(column.column_path().string());
                self.physical_type
                    .append_value(column.column_type().to_string());
                let stats = column.statistics();
                let (min, max) = stats.map(bounds_as_text).unwrap_or_default();
                // Both pairs, as datafusion-cli has them (the same values).
                self.stats_min.append_option(min.as_deref());
                self.stats_max.append_option(max.as_deref());
                self.stats_min_value.append_option(min);
                self.stats_max_value.append_option(max);
                let count = |n: Option<u64>| n.map(|n| n as i64);
                self.stats_null_count
                    .append_option(count(stats.and_then(|s| s.null_count_opt())));
                (self.stats_distinct_count)
                    .append_option(count(stats.and_then(|s| s.distinct_count_opt())));
                self.compression
                    .append_value(column.compression().to_string());
                let encodings: Vec<String> = column.encodings().map(|e| e.to_string()).collect();
                self.encodings
                    .append_value(format!("[{}]", encodings.join(", ")));
                self.index_page_offset
                    .append_option(column.index_page_offset());
                self.dictionary_page_offset
                    .append_option(column.dictionary_page_offset());
                self.data_page_offset
                    .append_value(column.data_page_offset());
                self.total_compressed_size
                    .append_value(column.compressed_size());
                self.total_uncompressed_size
                    .append_value(column.uncompressed_size());
            }
        }
    }

    /// The rows as one batch.
    fn finish(mut self) -> Result<RecordBatch> {
        let text = |name: &str| Field::new(name, DataType::Utf8, true);
        let number = |name: &str| Field::new(name, DataType::Int64, true);
        let columns: Vec<(Field, ArrayRef)> = vec![
            (text("filename"), Arc::new(self.filename.finish())),
            (number("row_group_id"), Arc::new(self.row_group_id.finish())),
            (
                number("row_group_num_rows"),
                Arc::new(self.row_group_num_rows.finish()),
            ),
            (
                number("row_group_num_columns"),
                Arc::new(self.row_group_num_columns.finish()),
            ),
            (
                number("row_group_bytes"),
                Arc::new(self.row_group_bytes.finish()),
            ),
            (number("column_id"), Arc::new(self.column_id.finish())),
            (number("file_offset"), Arc::new(self.file_offset.finish())),
            (number("num_values"), Arc::new(self.num_values.finish())),
            (
                text("path_in_schema"),
                Arc::new(self.path_in_schema.finish()),
            ),
            (text("type"), Arc::new(self.physical_type.finish())),
            (text("stats_min"), Arc::new(self.stats_min.finish())),
            (text("stats_max"), Arc::new(self.stats_max.finish())),
            (
                number("stats_null_count"),
                Arc::new(self.stats_null_count.finish()),
            ),
            (
                number("stats_distinct_count"),
                Arc::new(self.stats_distinct_count.finish()),
            ),
            (
                text("stats_min_value"),
                Arc::new(self.stats_min_value.finish()),
            ),
            (
                text("stats_max_value"),
                Arc::new(self.stats_max_value.finish()),
            ),
            (text("compression"), Arc::new(self.compression.finish())),
            (text("encodings"), Arc::new(self.encodings.finish())),
            (
                number("index_page_offset"),
                Arc::new(self.index_page_offset.finish()),
            ),
            (
                number("dictionary_page_offset"),
                Arc::new(self.dictionary_page_offset.finish()),
            ),
            (
                number("data_page_offset"),
                Arc::new(self.data_page_offset.finish()),
            ),
            (
                number("total_compressed_size"),
                Arc::new(self.total_compressed_size.finish()),
            ),
            (
                number("total_uncompressed_size"),
                Arc::new(self.total_uncompressed_size.finish()),
            ),
        ];
        let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = columns.into_iter().unzip();
        Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
    }
}

/// A column chunk's min and max as text: numbers as written, byte arrays as UTF-8 where
/// they are (else as hex).
fn bounds_as_text(stats: &Statistics) -> (Option<String>, Option<String>) {
    fn both<T>(
        min: Option<&T>,
        max: Option<&T>,
        show: impl Fn(&T) -> String,
    ) -> (Option<String>, Option<String>) {
        (min.map(&show), max.map(&show))
    }
    let bytes = |b: &[u8]| match std::str::from_utf8(b) {
        Ok(text) => text.to_string(),
        Err(_) => hex::encode(b),
    };
    match stats {
        Statistics::Boolean(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::Int32(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::Int64(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::Int96(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::Float(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::Double(s) => both(s.min_opt(), s.max_opt(), |v| v.to_string()),
        Statistics::ByteArray(s) => both(s.min_opt(), s.max_opt(), |v| bytes(v.data())),
        Statistics::FixedLenByteArray(s) => both(s.min_opt(), s.max_opt(), |v| bytes(v.data())),
    }
}
