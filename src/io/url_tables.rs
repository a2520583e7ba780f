//! Why a quoted path or URL read as a table (`SELECT * FROM 'data/t.parquet'`,
//! `FROM 's3://bucket/t/'`, with DataFusion's `SessionContext::enable_url_table`, as
//! datafusion-cli reads them) could not be read.
//!
//! DataFusion's resolver drops the cause: a missing file, an empty directory, a file of no
//! known format and an object store that refused the listing all end as "table
//! 'datafusion.public./tmp/t.parquet' not found". [`explain_missing_table`] turns that error,
//! for a name that reads as a path or URL ([`names_a_path`]), into the cause: no file found
//! there, or the store's or the format's own error. It looks only once the statement has
//! failed: a statement that merely names such a table without reading it (`CREATE TABLE
//! "x/y" AS ...`, `DROP TABLE IF EXISTS 'old.parquet'`) is not held to it.
//!
//! A location whose files disagree on a column's type fails with arrow's "Fail to merge
//! schema field 'c' because the from data_type = Utf8 does not equal Int64", which names no
//! file; [`explain_schema_conflict`] reads the files' schemas one by one and names the first
//! file of each type.

use datafusion::datasource::listing::{ListingTableConfig, ListingTableConfigExt, ListingTableUrl};
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use futures::StreamExt;

use super::table_locations::{locations_read, names_a_path};

/// The most files of one location whose schemas [`explain_schema_conflict`] reads.
const FILES_CHECKED: usize = 10_000;

/// `error` as it is, unless it is DataFusion's "table '…' not found" for a name in the
/// session's default schema that reads as a path or URL: then why that path cannot be read
/// as a table.
pub async fn explain_missing_table(
    ctx: &SessionContext,
    error: DataFusionError,
) -> DataFusionError {
    let Some(name) = missing_path_table(ctx, &error.to_string()) else {
        return error;
    };
    let explained =
        |why: String| DataFusionError::Plan(format!("cannot read '{name}' as a table: {why}"));
    let url = match ListingTableUrl::parse(&name) {
        Ok(url) => url,
        Err(e) => return explained(e.to_string()),
    };
    // Asked of the session's object store, as the scan would be (a server's store refuses
    // what its client may not read): never of the file system directly, which would tell a
    // client what exists where it may not look.
    match ListingTableConfig::new(url)
        .infer_options(&ctx.state())
        .await
    {
        // The listing found no file: none at that path, or an empty directory (DataFusion
        // raises it as an internal error).
        Err(DataFusionError::Internal(why)) if why.starts_with("No files for table") => {
            explained("no file found there".into())
        }
        // A file whose name ends in no format DataFusion knows (it names the whole path
        // as the "extension").
        Err(DataFusionError::Configuration(why)) if why.starts_with("No file_format found") => {
            explained(format!(
                "its name ends in no format flumen reads (.parquet, .csv, .json, .avro, .arrow, \
                 ...); name the format with read_csv('{name}'), read_json, read_parquet, \
                 or CREATE EXTERNAL TABLE ... STORED AS"
            ))
        }
        Err(e) => explained(e.to_string()),
        // Readable now: nothing to add to the error.
        Ok(_) => error,
    }
}

/// `error` explained where it is about a location `sql` reads: a path that could not be
/// read as a table ([`explain_missing_table`]), or files that disagree on a column's type
/// ([`explain_schema_conflict`]). The shell, the Python module and `flumen serve` call it
/// on a statement that failed to plan.
pub async fn explain_table_error(
    ctx: &SessionContext,
    sql: &str,
    error: DataFusionError,
) -> DataFusionError {
    let error = explain_missing_table(ctx, error).await;
    explain_schema_conflict(ctx, sql, error).await
}

/// `error` as it is, unless it is DataFusion's "Fail to merge schema field 'c' ..." for a
/// location `sql` reads (the files of a directory or glob whose column `c` has another type
/// in some of them): then which type each file holds, counted, with the first file of each,
/// so that the odd file among thousands can be found. Reads at most [`FILES_CHECKED`]
/// files' schemas, and only once the statement has failed.
pub async fn explain_schema_conflict(
    ctx: &SessionContext,
    sql: &str,
    error: DataFusionError,
) -> DataFusionError {
    let Some(field) = conflicting_field(&error.to_string()) else {
        return error;
    };
    for location in locations_read(ctx, sql) {
        let types = types_by_file(ctx, &location, &field).await;
        if types.len() > 1 {
            let kinds: Vec<String> = (types.iter())
                .map(|kind| {
                    let files = if kind.files == 1 { "file" } else { "files" };
                    format!(
                        "{} in {} {files} ({})",
                        kind.data_type, kind.files, kind.first
                    )
                })
                .collect();
            return DataFusionError::Plan(format!(
                "cannot read '{location}' as one table: its files disagree on the type of \
                 column '{field}': {}; read them apart, or cast the column in each",
                kinds.join(", ")
            ));
        }
    }
    error
}

/// The column of arrow's "Fail to merge schema field 'c' because ..." message.
fn conflicting_field(message: &str) -> Option<String> {
    let (_, rest) = message.split_once("Fail to merge schema field '")?;
    let (field, _) = rest.split_once("' because")?;
    Some(field.to_string())
}

/// One type of a column among a location's files: how many files hold it, and the first.
#[derive(Debug, PartialEq)]
struct TypeInFiles {
    data_type: String,
    files: usize,
    first: String,
}

/// The types column `field` has in the files at `location`, in the order the listing first
/// meets them; empty where the location cannot be listed or a schema read.
async fn types_by_file(ctx: &SessionContext, location: &str, field: &str) -> Vec<TypeInFiles> {
    let state = ctx.state();
    let Ok(url) = ListingTableUrl::parse(location) else {
        return vec![];
    };
    let Some(options) = ListingTableConfig::new(url.clone())
        .infer_options(&state)
        .await
        .ok()
        .and_then(|config| config.options)
    else {
        return vec![];
    };
    let Ok(store) = state.runtime_env().object_store(url.object_store()) else {
        return vec![];
    };
    let Ok(files) = url
        .list_all_files(&state, store.as_ref(), &options.file_extension)
        .await
    else {
        return vec![];
    };
    let files: Vec<_> = files.take(FILES_CHECKED).collect().await;
    let mut types: Vec<TypeInFiles> = vec![];
    for file in files {
        let Ok(file) = file else {
            return vec![];
        };
        let Ok(schema) = (options.format)
            .infer_schema(&state, &store, std::slice::from_ref(&file))
            .await
        else {
            return vec![];
        };
        let Ok(column) = schema.field_with_name(field) else {
            continue;
        };
        let data_type = column.data_type().to_string();
        match types.iter_mut().find(|kind| kind.data_type == data_type) {
            Some(kind) => kind.files += 1,
            None => types.push(TypeInFiles {
                data_type,
                files: 1,
                first: file_name(&url, &file.location),
            }),
        }
    }
    types
}

/// A listed file as a user names it: a local path with its leading `/`, else a URL.
fn file_name(url: &ListingTableUrl, path: &object_store::path::Path) -> String {
    match url.scheme() {
        "file" => format!("/{path}"),
        _ => format!("{}{path}", url.object_store().as_str()),
    }
}

/// The table name of a "table '<catalog>.<schema>.<name>' not found" message, where the
/// catalog and schema are the session's defaults and the name reads as a path.
fn missing_path_table(ctx: &SessionContext, message: &str) -> Option<String> {
    let options = ctx.copied_config();
    let catalog = &options.options().catalog;
    let default_schema = format!("{}.{}.", catalog.default_catalog, catalog.default_schema);
    let (_, rest) = message.split_once("table '")?;
    let resolved = rest.strip_suffix("' not found")?;
    let name = resolved.strip_prefix(&default_schema)?;
    names_a_path(name).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_failure_names_its_column() {
        assert_eq!(
            conflicting_field(
                "Arrow error: Schema error: Fail to merge schema field 'a b' because the from \
                 data_type = Utf8 does not equal Int64"
            ),
            Some("a b".into())
        );
        assert_eq!(conflicting_field("Schema error: No field named a"), None);
    }

    #[test]
    fn only_a_missing_path_in_the_default_schema_is_taken_for_a_file() {
        let ctx = SessionContext::new();
        let missing = |message: &str| missing_path_table(&ctx, message);
        assert_eq!(
            missing("Error during planning: table 'datafusion.public./tmp/t.parquet' not found"),
            Some("/tmp/t.parquet".into())
        );
        assert_eq!(
            missing("Error during planning: table 'datafusion.public.events' not found"),
            None
        );
        assert_eq!(
            missing("Error during planning: table 'other.public.t.parquet' not found"),
            None
        );
        assert_eq!(
            missing("Error during planning: column 'a/b' not found"),
            None
        );
    }
}
