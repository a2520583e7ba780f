//! Quoted paths and URLs read as tables (`SELECT * FROM 'data/t.parquet'`,
//! `FROM 's3://bucket/t/'`), as datafusion-cli reads them, with an error that says why when
//! one cannot be read.
//!
//! DataFusion's own resolver ([`DynamicListTableFactory`]) answers "table
//! 'datafusion.public./tmp/t.parquet' not found" for a missing file, an empty directory, a
//! file of no known format and an object store that refused the listing alike: the cause
//! is dropped. Here a name that reads as a path or URL ([`names_a_path`]) and cannot be read
//! fails with the cause: no file found there (none at the path, or an empty directory), or
//! the store's or the format's own error. Any other name not found is still "table ... not found".

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::{DynamicFileCatalog, TableProvider, UrlTableFactory};
use datafusion::datasource::dynamic_file::DynamicListTableFactory;
use datafusion::datasource::listing::{ListingTableConfig, ListingTableConfigExt, ListingTableUrl};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::context::SessionState;
use datafusion::prelude::SessionContext;

/// File name endings that mark a table name as a file: the formats a scan reads, and the
/// compressions it reads them through.
const FILE_ENDINGS: [&str; 14] = [
    ".parquet", ".csv", ".tsv", ".json", ".ndjson", ".jsonl", ".avro", ".arrow", ".ipc",
    ".feather", ".gz", ".bz2", ".xz", ".zst",
];

/// `ctx` reading quoted paths and URLs as tables, as DataFusion's
/// `SessionContext::enable_url_table` does, but failing with the cause where one cannot be
/// read.
pub fn with_url_tables(ctx: SessionContext) -> SessionContext {
    let listing = Arc::new(DynamicListTableFactory::default());
    let factory = Arc::new(PathTables {
        listing: Arc::clone(&listing),
    });
    let catalogs = Arc::new(DynamicFileCatalog::new(
        Arc::clone(ctx.state().catalog_list()),
        factory,
    ));
    let session_id = ctx.session_id();
    let ctx: SessionContext = ctx
        .into_state_builder()
        .with_session_id(session_id)
        .with_catalog_list(catalogs)
        .build()
        .into();
    listing.session_store().with_state(ctx.state_weak_ref());
    ctx
}

/// Whether a table name not found reads as a path or URL rather than a table's name: a URL,
/// a name with a `/`, or a file name with a data format's ending.
pub fn names_a_path(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    name.contains('/') || FILE_ENDINGS.iter().any(|ending| lower.ends_with(ending))
}

/// DataFusion's listing-table resolver, explaining the names it could not read.
#[derive(Debug)]
struct PathTables {
    listing: Arc<DynamicListTableFactory>,
}

impl PathTables {
    /// Why `name`, a path or URL, could not be read as a table.
    async fn why_not_a_table(&self, name: &str) -> DataFusionError {
        let explained =
            |why: String| DataFusionError::Plan(format!("cannot read '{name}' as a table: {why}"));
        let url = match ListingTableUrl::parse(name) {
            Ok(url) => url,
            Err(e) => return explained(e.to_string()),
        };
        let Some(state) = self.session_state() else {
            return explained("the session is gone".into());
        };
        // Asked of the session's object store, as the scan would be (a server's store refuses
        // what its client may not read): never of the file system directly, which would
        // tell a client what exists where it may not look.
        match ListingTableConfig::new(url).infer_options(&state).await {
            // The listing found no file: none at that path, or an empty directory
            // (DataFusion raises it as an internal error).
            Err(DataFusionError::Internal(why)) if why.starts_with("No files for table") => {
                explained("no file found there".into())
            }
            Err(e) => explained(e.to_string()),
            Ok(_) => explained("its files could not be read as one table".into()),
        }
    }

    /// The session the resolver serves, as it is now.
    fn session_state(&self) -> Option<SessionState> {
        let session = self.listing.session_store().get_session().upgrade()?;
        let session = session.read();
        session.as_any().downcast_ref::<SessionState>().cloned()
    }
}

#[async_trait]
impl UrlTableFactory for PathTables {
    async fn try_new(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if let Some(table) = self.listing.try_new(name).await? {
            return Ok(Some(table));
        }
        if !names_a_path(name) {
            return Ok(None);
        }
        Err(self.why_not_a_table(name).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_urls_are_told_from_table_names() {
        for path in [
            "data/t.parquet",
            "/tmp/dir/",
            "s3://bucket/t/",
            "t.parquet",
            "T.CSV",
            "events.json.gz",
            "./x",
        ] {
            assert!(names_a_path(path), "{path}");
        }
        for name in ["events", "my_table", "v2", "a.b"] {
            assert!(!names_a_path(name), "{name}");
        }
    }
}
