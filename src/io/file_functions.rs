//! Files read as a table by a function of their format, as DuckDB names them:
//! `read_parquet(path)`, `read_csv(path)`, `read_json(path)` (newline-delimited), `read_avro(path)`
//! and `read_arrow(path)`, with DuckDB's other names for them (`read_csv_auto`, `read_ndjson`,
//! `parquet_scan`, ...). The path is a file, a directory (the format's files in it), a glob
//! (`'data/*.parquet'`) or a URL of an object store, or a list of them
//! (`read_csv(['a.csv', 'b.csv'])`). Unlike a quoted path (`FROM 'data/x.txt'`), the function
//! names the format, so a file's name need not end in it. Each call is a DataFusion listing
//! table: the session's format options apply (`datafusion.catalog.has_header`, ...), Hive
//! partition directories (`dt=2026-12-06/`) become columns, and the scan is cut into splits
//! and pruned like any other.
//!
//! [`locations_read_by_functions`] finds the locations a statement hands to these functions,
//! to `parquet_metadata`, `glob` and `table_changes`, before it is planned (planning one of
//! them reads what it names): `flumen serve` checks them against its access policy, and the
//! session registers the object stores they need.

use std::collections::HashMap;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::ScalarValue;
use datafusion::datasource::MemTable;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::logical_expr::Expr;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{CopyToSource, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::{
    self, FunctionArg, FunctionArgExpr, TableFactor, Visit, Visitor,
};
use futures::StreamExt;

use super::planning_reads::read_while_planning;

/// Each file function's name and the file format (DataFusion's extension for it) it reads:
/// DuckDB's names, its `_auto` forms and `parquet_scan` among them.
pub const FILE_FUNCTIONS: [(&str, &str); 10] = [
    ("read_parquet", "parquet"),
    ("parquet_scan", "parquet"),
    ("read_csv", "csv"),
    ("read_csv_auto", "csv"),
    ("read_json", "json"),
    ("read_json_auto", "json"),
    ("read_ndjson", "json"),
    ("read_ndjson_auto", "json"),
    ("read_avro", "avro"),
    ("read_arrow", "arrow"),
];

/// The table functions besides [`FILE_FUNCTIONS`] whose string arguments are locations they
/// read while the statement is planned (`table_changes` takes a table's name or a location).
pub const OTHER_LOCATION_FUNCTIONS: [&str; 3] = ["parquet_metadata", "glob", "table_changes"];

/// Whether the table function `name` (lower case) reads the locations its string arguments
/// name while the statement is planned.
fn reads_locations(name: &str) -> bool {
    FILE_FUNCTIONS.iter().any(|(function, _)| *function == name)
        || OTHER_LOCATION_FUNCTIONS.contains(&name)
}

/// A `read_<format>(path)` table function.
#[derive(Debug)]
pub struct ReadFiles {
    /// The function's name, for its errors.
    name: &'static str,
    /// The format's extension, the key of its DataFusion file format factory.
    format: &'static str,
}

/// Register the `read_<format>` functions of [`FILE_FUNCTIONS`] in `ctx`.
pub fn register_file_functions(ctx: &SessionContext) {
    for (name, format) in FILE_FUNCTIONS {
        ctx.register_udtf(name, Arc::new(ReadFiles { name, format }));
    }
}

impl TableFunctionImpl for ReadFiles {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let format = self.format;
        let table = read_call(self.name, &args, |state, paths| async move {
            listing_table(state, format, &paths).await
        })?;
        Ok(Arc::new(table))
    }
}

/// What `read` makes of the locations of a call of the location function `name`, whose one
/// argument is a quoted path, glob or URL, or a list of them: read while the statement is
/// planned ([`read_while_planning`]), an error naming the call.
pub(crate) fn read_call<'s, T, F, Fut>(
    name: &str,
    args: &TableFunctionArgs<'_, 's>,
    read: F,
) -> Result<T>
where
    T: Send,
    F: FnOnce(&'s SessionState, Vec<String>) -> Fut + Send,
    Fut: Future<Output = Result<T>>,
{
    let usage = format!("{name}('path' or ['path', ...])");
    let paths = match args.exprs() {
        [one] => locations_in(one),
        _ => None,
    }
    .ok_or_else(|| {
        DataFusionError::Plan(format!(
            "{usage}: takes one quoted path, glob or URL, or a list of them"
        ))
    })?;
    let state = (args.session().as_any().downcast_ref::<SessionState>())
        .ok_or_else(|| DataFusionError::Plan(format!("{usage}: needs a SessionState")))?;
    let what = format!("{name}('{}')", paths.join("', '"));
    read_while_planning(&what, move || read(state, paths)).map_err(|e| failed_reading(&what, e))
}

/// A table of the one batch `batch`.
pub(crate) fn one_batch_table(batch: RecordBatch) -> Result<Arc<dyn TableProvider>> {
    Ok(Arc::new(MemTable::try_new(
        batch.schema(),
        vec![vec![batch]],
    )?))
}

/// The listing table of `paths`, read as `format` with the session's options for it; its
/// schema is inferred from the first path's files.
async fn listing_table(
    state: &SessionState,
    format: &str,
    paths: &[String],
) -> Result<ListingTable> {
    let urls = (paths.iter())
        .map(ListingTableUrl::parse)
        .collect::<Result<Vec<_>>>()?;
    // A directory holds other files too (`_SUCCESS`, `.crc`): only the format's are read
    // there, by the ending of its first one. A file or a glob names its files itself.
    let all_directories = urls.iter().all(|url| url.is_collection());
    let endings = all_directories.then(|| file_endings(format));
    let (ending, compression) = first_file(state, &urls[0], endings).await?;
    let mut format_options = HashMap::new();
    if let Some(compression) = &compression {
        format_options.insert("format.compression".to_string(), compression.clone());
    }
    let factory = (state.get_file_format_factory(format))
        .ok_or_else(|| DataFusionError::Plan(format!("no file format '{format}' is registered")))?;
    let file_format = factory.create(state, &format_options)?;
    let extension = match (all_directories, &compression) {
        (false, _) => String::new(),
        (true, None) => format!(".{ending}"),
        (true, Some(compression)) => format!(".{ending}.{compression}"),
    };
    let options = ListingOptions::new(file_format).with_file_extension(extension);
    let config = ListingTableConfig::new_with_multi_paths(urls)
        .with_listing_options(options)
        .infer_partitions_from_path(state)
        .await?
        .infer_schema(state)
        .await?;
    ListingTable::try_new(config)
}

/// `error`, met reading what `what` (a call) names, as a planning error that names the call.
fn failed_reading(what: &str, error: DataFusionError) -> DataFusionError {
    match error {
        DataFusionError::Plan(why) => DataFusionError::Plan(format!("{what}: {why}")),
        other => DataFusionError::Plan(format!("{what}: {other}")),
    }
}

/// The file name endings (without the dot) a directory's files of `format` have.
fn file_endings(format: &str) -> &'static [&'static str] {
    match format {
        "csv" => &["csv", "tsv"],
        "json" => &["json", "jsonl", "ndjson"],
        "arrow" => &["arrow", "ipc", "feather"],
        "avro" => &["avro"],
        _ => &["parquet"],
    }
}

/// The ending and compression (`gz`, ...) of the first file `url` lists, of the first one
/// ending in one of `endings` where they are given; an error saying none is there if none is.
async fn first_file(
    state: &SessionState,
    url: &ListingTableUrl,
    endings: Option<&[&str]>,
) -> Result<(String, Option<String>)> {
    let store = state.runtime_env().object_store(url)?;
    let mut files = url.list_all_files(state, store.as_ref(), "").await?;
    while let Some(file) = files.next().await {
        let location = file?.location.to_string();
        let (ending, compression) =
            ListingTableConfig::infer_file_extension_and_compression_type(&location)?;
        if endings.is_none_or(|endings| endings.contains(&ending.as_str())) {
            return Ok((ending, compression));
        }
    }
    Err(DataFusionError::Plan(match endings {
        Some(endings) => format!("no file ending in .{} found there", endings.join(", .")),
        None => "no file found there".into(),
    }))
}

/// How a listed file is named to the user: its path where it is on the local file system
/// (`/data/a.parquet`), else its store's URL and its location (`s3://bucket/a.parquet`).
pub(crate) fn shown_location(url: &ListingTableUrl, location: &object_store::path::Path) -> String {
    match url.object_store().as_str() {
        "file:///" => format!("/{location}"),
        prefix => format!("{prefix}{location}"),
    }
}

/// The paths an argument names: a quoted string, or a list of them.
pub(crate) fn locations_in(expr: &Expr) -> Option<Vec<String>> {
    match expr {
        Expr::Literal(value, _) => match value {
            ScalarValue::List(list) => {
                let values = list.values();
                (0..values.len())
                    .map(|i| match ScalarValue::try_from_array(values, i).ok()? {
                        ScalarValue::Utf8(Some(s))
                        | ScalarValue::Utf8View(Some(s))
                        | ScalarValue::LargeUtf8(Some(s)) => Some(s),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .filter(|paths| !paths.is_empty())
            }
            other => string_of(other).map(|s| vec![s]),
        },
        Expr::ScalarFunction(call) if call.name() == "make_array" => (call.args.iter())
            .map(|arg| match arg {
                Expr::Literal(value, _) => string_of(value),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .filter(|paths| !paths.is_empty()),
        _ => None,
    }
}

/// The text of a string literal.
fn string_of(value: &ScalarValue) -> Option<String> {
    match value {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::Utf8View(Some(s))
        | ScalarValue::LargeUtf8(Some(s)) => Some(s.clone()),
        _ => None,
    }
}

/// An argument a statement hands to a function that reads locations ([`FILE_FUNCTIONS`],
/// [`OTHER_LOCATION_FUNCTIONS`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FunctionArgument {
    /// A quoted string (or one of a list of them): a location the function reads when the
    /// statement is planned (or, for `table_changes`, a table's name).
    Quoted(String),
    /// An expression that is neither a quoted string, a list of them nor a number (`'/d/' ||
    /// 'x.csv'`): what it names is known only once it is planned. The SQL text.
    Computed(String),
}

/// The arguments `statement` hands to the functions that read locations in its `FROM`
/// clauses, in the order written, numbers left out.
pub fn locations_read_by_functions(statement: &DFStatement) -> Vec<FunctionArgument> {
    let mut finder = LocationFinder::default();
    match statement {
        DFStatement::Statement(s) => {
            let _ = s.visit(&mut finder);
        }
        DFStatement::CopyTo(copy) => {
            if let CopyToSource::Query(query) = &copy.source {
                let _ = query.visit(&mut finder);
            }
        }
        DFStatement::Explain(explain) => {
            finder.arguments = locations_read_by_functions(&explain.statement)
        }
        DFStatement::CreateExternalTable(_) | DFStatement::Reset(_) => {}
    }
    finder.arguments
}

/// A visitor gathering the arguments of location functions.
#[derive(Default)]
struct LocationFinder {
    arguments: Vec<FunctionArgument>,
}

impl Visitor for LocationFinder {
    type Break = ();

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        let TableFactor::Table {
            name,
            args: Some(args),
            ..
        } = factor
        else {
            return ControlFlow::Continue(());
        };
        let function = (name.0.last())
            .and_then(|part| part.as_ident())
            .map(|ident| ident.value.to_ascii_lowercase());
        if !function.is_some_and(|f| reads_locations(&f)) {
            return ControlFlow::Continue(());
        }
        for arg in &args.args {
            match arg {
                FunctionArg::Unnamed(FunctionArgExpr::Expr(expr))
                | FunctionArg::Named {
                    arg: FunctionArgExpr::Expr(expr),
                    ..
                }
                | FunctionArg::ExprNamed {
                    arg: FunctionArgExpr::Expr(expr),
                    ..
                } => arguments_in(expr, &mut self.arguments),
                other => (self.arguments).push(FunctionArgument::Computed(other.to_string())),
            }
        }
        ControlFlow::Continue(())
    }
}

/// The arguments `expr` holds: a quoted string, the elements of an array literal, nothing
/// for a number, else the expression as computed.
fn arguments_in(expr: &ast::Expr, out: &mut Vec<FunctionArgument>) {
    match expr {
        ast::Expr::Value(value) => match &value.value {
            ast::Value::Number(..) => {}
            other => match other.clone().into_string() {
                Some(s) => out.push(FunctionArgument::Quoted(s)),
                None => out.push(FunctionArgument::Computed(expr.to_string())),
            },
        },
        ast::Expr::Array(array) => {
            for element in &array.elem {
                arguments_in(element, out);
            }
        }
        ast::Expr::Nested(inner) => arguments_in(inner, out),
        other => out.push(FunctionArgument::Computed(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use datafusion::sql::parser::DFParser;

    use super::*;

    fn found(sql: &str) -> Vec<String> {
        let statement = DFParser::parse_sql(sql).unwrap().pop_front().unwrap();
        (locations_read_by_functions(&statement).into_iter())
            .map(|arg| match arg {
                FunctionArgument::Quoted(s) => s,
                FunctionArgument::Computed(sql) => format!("computed: {sql}"),
            })
            .collect()
    }

    #[test]
    fn the_locations_a_statement_hands_to_file_functions_are_found() {
        assert_eq!(
            found("SELECT * FROM read_parquet('/d/a.parquet')"),
            ["/d/a.parquet"]
        );
        assert_eq!(
            found("SELECT * FROM t JOIN READ_CSV(['a.csv', \"b\"]) ON true"),
            ["a.csv", "computed: \"b\""],
            "a double-quoted name is an identifier, not a string"
        );
        assert_eq!(
            found("SELECT * FROM read_csv('/d/' || 'x.csv'), table_changes('t', 2)"),
            ["computed: '/d/' || 'x.csv'", "t"]
        );
        assert_eq!(
            found(
                "COPY (SELECT * FROM (SELECT 1) x, parquet_metadata('s3://b/k.parquet')) \
                 TO 'out.csv'"
            ),
            ["s3://b/k.parquet"]
        );
        assert_eq!(
            found("EXPLAIN WITH w AS (SELECT * FROM table_changes('/t', 0)) SELECT * FROM w"),
            ["/t"]
        );
        assert_eq!(
            found("SELECT * FROM t WHERE id IN (SELECT id FROM read_json('/j/*.json'))"),
            ["/j/*.json"]
        );
        assert_eq!(found("SELECT file FROM glob('/d/*')"), ["/d/*"]);
        assert!(found("SELECT * FROM generate_series(1, 3), '/x.parquet'").is_empty());
    }

    #[test]
    fn an_argument_names_a_path_or_a_list_of_them() {
        let text = |s: &str| Expr::Literal(ScalarValue::Utf8(Some(s.into())), None);
        assert_eq!(
            locations_in(&text("a.csv")),
            Some(vec!["a.csv".to_string()])
        );
        let list = ScalarValue::List(ScalarValue::new_list_nullable(
            &[ScalarValue::from("a"), ScalarValue::from("b")],
            &datafusion::arrow::datatypes::DataType::Utf8,
        ));
        assert_eq!(
            locations_in(&Expr::Literal(list, None)),
            Some(vec!["a".to_string(), "b".to_string()])
        );
        assert_eq!(
            locations_in(&Expr::Literal(ScalarValue::Int64(Some(1)), None)),
            None
        );
    }
}
