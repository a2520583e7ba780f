//! Which locations a statement reads as tables: a quoted path or URL in `FROM`
//! (`SELECT * FROM 'data/t/'`, with `SessionContext::enable_url_table`), what a function of a
//! file format is handed (`read_parquet('s3://...')`) and a `CREATE EXTERNAL TABLE`'s
//! `LOCATION`. [`crate::io::object_stores`] registers their stores before the statement
//! runs; [`crate::io::url_tables`] explains why one of them could not be read.

use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};

use super::file_functions::{self, FunctionArgument};

/// File name endings that mark a table name as a file: the formats a scan reads, and the
/// compressions it reads them through.
const FILE_ENDINGS: [&str; 14] = [
    ".parquet", ".csv", ".tsv", ".json", ".ndjson", ".jsonl", ".avro", ".arrow", ".ipc",
    ".feather", ".gz", ".bz2", ".xz", ".zst",
];

/// Whether a table name reads as a path or URL rather than a table's name: a URL, a name
/// with a `/`, or a file name with a data format's ending.
pub fn names_a_path(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    name.contains('/') || FILE_ENDINGS.iter().any(|ending| lower.ends_with(ending))
}

/// Every location `sql` reads as a table: quoted paths and URLs (`FROM 'data/t/'`), those a
/// function of a file format is handed (`read_parquet('s3://...')`) and a `CREATE EXTERNAL
/// TABLE`'s `LOCATION`. SQL that does not parse reads none.
pub fn locations_read(ctx: &SessionContext, sql: &str) -> Vec<String> {
    let Ok(statements) = DFParser::parse_sql(sql) else {
        return vec![];
    };
    let mut locations = vec![];
    for statement in &statements {
        match statement {
            Statement::CreateExternalTable(create) => {
                locations.extend(create.locations.iter().cloned())
            }
            // A table name is a location only where it reads as one; what a file function
            // is handed always is (`read_parquet('data')`, a directory with no `/`).
            other => locations.extend(
                (table_names(ctx, other).into_iter())
                    .filter(|name| names_a_path(name))
                    .chain(function_locations(other)),
            ),
        }
    }
    locations
}

/// The table names `statement` reads (any of which may be a quoted path or URL, with
/// `SessionContext::enable_url_table`) and the locations it hands to a function that reads
/// them while it is planned (`read_parquet('s3://...')`).
pub(crate) fn url_table_locations(ctx: &SessionContext, statement: &Statement) -> Vec<String> {
    let mut locations = table_names(ctx, statement);
    locations.extend(function_locations(statement));
    locations
}

/// The names of the tables `statement` reads, each as written after its schema.
fn table_names(ctx: &SessionContext, statement: &Statement) -> Vec<String> {
    (ctx.state().resolve_table_references(statement))
        .map(|tables| tables.iter().map(|t| t.table().to_string()).collect())
        .unwrap_or_else(|_| Vec::new())
}

/// The quoted locations `statement` hands to a function that reads them while it is planned.
fn function_locations(statement: &Statement) -> Vec<String> {
    (file_functions::locations_read_by_functions(statement).into_iter())
        .filter_map(|argument| match argument {
            FunctionArgument::Quoted(location) => Some(location),
            FunctionArgument::Computed(_) => None,
        })
        .collect()
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

    #[test]
    fn the_locations_a_statement_reads_are_its_paths_and_every_file_functions_argument() {
        let ctx = SessionContext::new();
        let read = |sql: &str| locations_read(&ctx, sql);
        assert_eq!(
            read("SELECT * FROM events JOIN 'data/t.parquet' USING (id)"),
            ["data/t.parquet"]
        );
        // A file function's argument is a location though it has no `/` nor an ending.
        assert_eq!(read("SELECT count(*) FROM read_parquet('data')"), ["data"]);
        assert_eq!(
            read("CREATE EXTERNAL TABLE e STORED AS CSV LOCATION 'in'"),
            ["in"]
        );
        assert!(read("SELECT * FROM events").is_empty());
        assert!(read("SELEC nothing").is_empty());
    }
}
