//! The tables a server's clients created, kept across restarts: each `CREATE EXTERNAL TABLE`
//! that succeeds is written (its SQL, verbatim) to a JSON file, `DROP TABLE` removes it,
//! and a server replays the file on start. The file holds whatever the DDL held (object
//! store keys in `OPTIONS` among them), so it is written owner-only (mode 0600), replaced
//! atomically (write to a temporary file, then rename).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;
use serde::{Deserialize, Serialize};

/// One persisted table: its name as the statement gave it, and the statement.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PersistedTable {
    /// The table's name (as written in the statement, e.g. `docs` or `s.docs`).
    pub name: String,
    /// The `CREATE EXTERNAL TABLE` statement that made it.
    pub sql: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CatalogContents {
    tables: Vec<PersistedTable>,
}

/// The catalog file of one server.
#[derive(Debug)]
pub struct CatalogFile {
    path: PathBuf,
    contents: Mutex<CatalogContents>,
}

impl CatalogFile {
    /// Open the catalog at `path` (an absent file is an empty catalog).
    pub fn open(path: &Path) -> Result<Self> {
        let contents = match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                DataFusionError::Execution(format!(
                    "catalog file {} is not flumen's JSON: {e}",
                    path.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => CatalogContents::default(),
            Err(e) => {
                return Err(DataFusionError::Execution(format!(
                    "cannot read catalog file {}: {e}",
                    path.display()
                )));
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            contents: Mutex::new(contents),
        })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tables it holds, in the order they were created.
    pub fn tables(&self) -> Vec<PersistedTable> {
        self.contents.lock().unwrap().tables.clone()
    }

    /// Create every table of the file in `ctx`; a table that cannot be created (its files
    /// gone, its store unreachable) is logged and kept in the file. Returns how many were
    /// created.
    pub async fn replay(&self, ctx: &SessionContext) -> usize {
        let mut created = 0;
        for table in self.tables() {
            let result = async {
                crate::io::register_for_statement(ctx, &table.sql)?;
                crate::session::sql(ctx, &table.sql).await?.collect().await
            }
            .await;
            match result {
                Ok(_) => created += 1,
                Err(e) => log::warn!(
                    "flumen serve: cannot recreate table {} from {}: {e}",
                    table.name,
                    self.path.display()
                ),
            }
        }
        created
    }

    /// Record that `name` was created by `sql` (replacing an entry of the same name).
    pub fn record_create(&self, name: &str, sql: &str) -> Result<()> {
        let mut contents = self.contents.lock().unwrap();
        contents.tables.retain(|t| t.name != name);
        contents.tables.push(PersistedTable {
            name: name.to_string(),
            sql: sql.to_string(),
        });
        self.write(&contents)
    }

    /// Record that `name` was dropped.
    pub fn record_drop(&self, name: &str) -> Result<()> {
        let mut contents = self.contents.lock().unwrap();
        let before = contents.tables.len();
        contents.tables.retain(|t| t.name != name);
        if contents.tables.len() == before {
            return Ok(());
        }
        self.write(&contents)
    }

    fn write(&self, contents: &CatalogContents) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let cannot = |e: std::io::Error| {
            DataFusionError::Execution(format!(
                "cannot write catalog file {}: {e}",
                self.path.display()
            ))
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(cannot)?;
        }
        let staging = self.path.with_extension("json.tmp");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&staging)
            .map_err(cannot)?;
        let text = serde_json::to_string_pretty(contents)
            .map_err(|e| DataFusionError::Execution(e.to_string()))?;
        file.write_all(text.as_bytes()).map_err(cannot)?;
        file.sync_all().map_err(cannot)?;
        std::fs::rename(&staging, &self.path).map_err(cannot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tables_survive_a_reopen_and_replay() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("t.csv");
        std::fs::write(&data, "a,b\n1,x\n2,y\n").unwrap();
        let path = dir.path().join("catalog.json");
        let catalog = CatalogFile::open(&path).unwrap();
        let sql = format!(
            "CREATE EXTERNAL TABLE t STORED AS CSV LOCATION '{}' OPTIONS ('format.has_header' 'true')",
            data.display()
        );
        catalog.record_create("t", &sql).unwrap();
        catalog
            .record_create(
                "gone",
                "CREATE EXTERNAL TABLE gone STORED AS CSV LOCATION '/nope/x.csv'",
            )
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let reopened = CatalogFile::open(&path).unwrap();
        assert_eq!(reopened.tables().len(), 2);
        let ctx = crate::session(crate::FlumenConfig::default());
        assert_eq!(reopened.replay(&ctx).await, 1);
        let rows = ctx
            .sql("SELECT count(*) FROM t")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(rows[0].num_rows(), 1);
        reopened.record_drop("t").unwrap();
        assert_eq!(CatalogFile::open(&path).unwrap().tables().len(), 1);
    }

    #[test]
    fn a_corrupt_catalog_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.json");
        std::fs::write(&path, "{not json").unwrap();
        let err = CatalogFile::open(&path).unwrap_err().to_string();
        assert!(err.contains("catalog.json"), "{err}");
    }
}
