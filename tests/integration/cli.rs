//! The `flumen` binary driven as a user drives it: the REPL under a pseudo-terminal,
//! statements on standard input, `-c`/`-f` with each output format, and exit codes.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::common::s3_server;
use crate::common::skip;
use s3_server::S3Server;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

/// Run `flumen` with `args` (the demo table's cache in a temp dir) and `stdin` as input.
fn flumen(args: &[&str], stdin: &str) -> Output {
    let cache = tempfile::tempdir().unwrap();
    let mut child = Command::new(FLUMEN)
        .args(args)
        .env("XDG_CACHE_HOME", cache.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_string()
}

/// Run `flumen --no-demo --quiet --format csv` with each of `statements` as a `-c`.
fn csv_statements(statements: &[&str]) -> Output {
    let mut args = vec!["--no-demo", "--quiet", "--format", "csv"];
    for statement in statements {
        args.extend(["-c", statement]);
    }
    flumen(&args, "")
}

const DATA: &str =
    "SELECT * FROM (VALUES (1, 'one', 1.5), (2, 'two, \"2\"', NULL)) AS t(id, name, x) ORDER BY id";

#[test]
fn csv_output() {
    let out = flumen(&["--no-demo", "--format", "csv", "-c", DATA], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    insta::assert_snapshot!(text(&out.stdout));
}

#[test]
fn json_and_ndjson_output() {
    let out = flumen(
        &["--no-demo", "--quiet", "--format", "json", "-c", DATA],
        "",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "", "--quiet prints no timing line");
    insta::assert_snapshot!("json", text(&out.stdout));
    let out = flumen(&["--no-demo", "--format", "ndjson", "-c", DATA], "");
    insta::assert_snapshot!("ndjson", text(&out.stdout));
}

#[test]
fn table_output_with_maxrows_and_timing() {
    let out = flumen(
        &[
            "--no-demo",
            "--maxrows",
            "3",
            "-c",
            "SELECT x FROM generate_series(1, 10) AS t(x)",
        ],
        "",
    );
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("| 3 |") && !stdout.contains("| 4 |"),
        "{stdout}"
    );
    assert!(stdout.contains("(3 of 10 rows shown"), "{stdout}");
    assert!(
        text(&out.stderr).contains("10 rows in "),
        "{}",
        text(&out.stderr)
    );
}

/// `--maxwidth N` and `\maxwidth N` cut long table cells (a vector, a long string) to N
/// characters ending in `…`, and say so; 0 shows them whole, as `-c` does by default; a
/// word that is no number is an error naming the command.
#[test]
fn table_cells_cut_at_maxwidth() {
    let vector = "SELECT id, range(0, 50) AS v FROM (VALUES (1)) AS t(id)";
    let out = flumen(
        &["--no-demo", "--quiet", "--maxwidth", "16", "-c", vector],
        "",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("| 1  | [0, 1, 2, 3, 4,… |"), "{stdout}");
    assert!(stdout.contains("(cells cut at 16 characters;"), "{stdout}");
    let out = flumen(
        &[
            "--no-demo",
            "--quiet",
            "-c",
            "\\maxwidth 10",
            "-c",
            "\\maxwidth",
            "-c",
            vector,
        ],
        "",
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("maxwidth is 10") && stdout.contains("| [0, 1, 2,… |"),
        "{stdout}"
    );
    let out = flumen(
        &["--no-demo", "--quiet", "--maxwidth", "0", "-c", vector],
        "",
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("48, 49]") && !stdout.contains("cells cut"),
        "{stdout}"
    );
    let out = flumen(&["--no-demo", "-c", "\\maxwidth wide"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("\\maxwidth takes a number (0: no limit), got 'wide'"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn exit_status_is_non_zero_when_a_statement_fails() {
    let out = flumen(
        &[
            "--no-demo",
            "-c",
            "SELECT * FROM no_such_table",
            "-c",
            "SELECT 7 AS seven",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("no_such_table") && stderr.contains("not found"),
        "{stderr}"
    );
    // The statements after a failed one still run.
    assert!(text(&out.stdout).contains("| 7 "), "{}", text(&out.stdout));
    let out = flumen(&["--no-demo", "-c", "SELECT 1"], "");
    assert_eq!(out.status.code(), Some(0));
    let out = flumen(&["-f", "/no/such/file.sql"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("/no/such/file.sql"));
}

#[test]
fn statements_from_stdin_and_files() {
    let out = flumen(
        &["--no-demo", "--format", "csv", "--quiet"],
        "SELEC 1;\nSELECT 'a;b' AS s; -- a comment; with a semicolon\nSELECT 2 AS n",
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("SELEC"), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "s\na;b\nn\n2\n");
    // A line that starts with `\` where a statement would start is a shell command, as in
    // the REPL (it was read as SQL: "No table named '\d'").
    let out = flumen(
        &["--no-demo", "--quiet"],
        "CREATE TABLE t AS VALUES (1);\n\\d t\n\\format csv\nSELECT '\n\\d' AS s;\n",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("column1") && stdout.contains("Int64"),
        "{stdout}"
    );
    assert!(stdout.ends_with("s\n\"\n\\d\"\n"), "{stdout}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("script.sql");
    std::fs::write(
        &file,
        "CREATE TABLE t AS SELECT x FROM generate_series(1, 5) AS g(x);\n\
         SELECT sum(x) AS total\n  FROM t;",
    )
    .unwrap();
    let out = flumen(
        &["--no-demo", "--format", "csv", "-f", file.to_str().unwrap()],
        "",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "total\n15\n");
    // `-c` and `-f` run in the order given: the file makes the table the statement reads,
    // and the last statement sees the row the one before it added (in threads mode and
    // with 2 worker processes).
    for mode in [&[][..], &["--workers", "2"][..]] {
        let mut argv = vec!["--no-demo", "--format", "csv", "--quiet"];
        argv.extend_from_slice(mode);
        argv.extend_from_slice(&["-f", file.to_str().unwrap()]);
        argv.extend_from_slice(&["-c", "INSERT INTO t VALUES (10)"]);
        argv.extend_from_slice(&["-c", "SELECT count(*) AS n, sum(x) AS s FROM t"]);
        let out = flumen(&argv, "");
        assert!(out.status.success(), "{mode:?}: {}", text(&out.stderr));
        assert_eq!(
            text(&out.stdout),
            "total\n15\ncount\n1\nn,s\n6,25\n",
            "{mode:?}"
        );
    }
}

#[test]
fn meta_commands_and_the_demo_table() {
    let out = flumen(&["--quiet", "-c", "\\d", "-c", "\\d docs"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("datafusion.public.docs"), "{stdout}");
    assert!(
        stdout.contains("body") && stdout.contains("Utf8"),
        "{stdout}"
    );
    // The demo table is written on first use: 100,000 documents about 8 topics.
    let out = flumen(
        &[
            "--quiet",
            "--format",
            "csv",
            "-c",
            "SELECT count(*) AS n, count(DISTINCT topic) AS t FROM docs",
        ],
        "",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "n,t\n100000,8\n");
    let out = flumen(&["--no-demo", "-c", "\\nonsense"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("\\?"), "{}", text(&out.stderr));
}

/// The REPL in a terminal: a bad statement, then good ones (one over two lines), a long
/// query cancelled with Ctrl-C, and `\q`; the process stays alive throughout.
#[test]
fn repl_keeps_running_after_errors_and_ctrl_c() {
    let cache = tempfile::tempdir().unwrap();
    let mut command = Command::new(FLUMEN);
    command.arg("--no-demo").env("XDG_DATA_HOME", cache.path());
    let mut p = rexpect::session::spawn_command(command, Some(30_000)).unwrap();
    p.exp_string("\\? for help").unwrap();
    p.send_line("SELEC 1;").unwrap();
    p.exp_string("Error").unwrap();
    p.send_line("SELECT 40 + 2").unwrap();
    p.exp_string("->").unwrap();
    p.send_line("  AS answer;").unwrap();
    p.exp_string("42").unwrap();
    p.exp_string("1 row in").unwrap();
    p.send_line("SELECT count(*) FROM generate_series(1, 100000000000) AS t(x) WHERE x % 7 = 3;")
        .unwrap();
    // Progress lines appear after a second, one per operator.
    p.exp_string("op0").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    p.send_control('c').unwrap();
    p.exp_string("cancelled").unwrap();
    // A cell wider than 80 characters is cut in the REPL's table.
    p.send_line("SELECT repeat('ab', 100) AS wide;").unwrap();
    // (rexpect reads the terminal's bytes as Latin-1, so the `…` is checked by the border:
    // 80 characters and a space each side.)
    p.exp_string(&format!("| {}", "ab".repeat(39) + "a"))
        .unwrap();
    p.exp_string(&format!("\n+{}+\r", "-".repeat(82))).unwrap();
    p.exp_string("cells cut at 80 characters").unwrap();
    p.send_line("\\timing").unwrap();
    p.exp_string("timing is off").unwrap();
    p.send_line("SELECT upper('still here') AS s;").unwrap();
    p.exp_string("STILL HERE").unwrap();
    p.send_line("\\q").unwrap();
    p.exp_eof().unwrap();
    // The history was saved in the data dir.
    let history = std::fs::read_to_string(cache.path().join("flumen/history.txt")).unwrap();
    assert!(history.contains("AS answer;"), "{history}");
}

/// `COPY ... TO 's3://...'`, `CREATE EXTERNAL TABLE ... LOCATION 's3://...'` and a query of
/// it, against a real S3-compatible server on 127.0.0.1; a missing bucket is a clear error.
#[test]
fn s3_tables_on_a_loopback_server() {
    let Some(server) = S3Server::start() else {
        skip::skip_missing_tool("moto_server not found (run tests/install-test-tools.sh)");
        return;
    };
    server.create_bucket("flumen-test");
    let options = server.options();
    let out = csv_statements(&[
        &format!(
            "COPY (SELECT x AS id, 'row ' || x AS body FROM generate_series(1, 5000) AS t(x)) \
             TO 's3://flumen-test/nums/part-0.parquet' {options}"
        ),
        &format!(
            "CREATE EXTERNAL TABLE nums STORED AS PARQUET LOCATION 's3://flumen-test/nums/' {options}"
        ),
        "SELECT count(*) AS n, sum(id) AS total, max(body) AS last FROM nums",
        "SELECT count(*) AS by_url FROM 's3://flumen-test/nums/part-0.parquet'",
        // Table functions register the store of the URL they read, as a quoted path does.
        "SELECT sum(id) AS by_function FROM read_parquet('s3://flumen-test/nums/')",
        "SELECT sum(row_group_num_rows) AS footer_rows FROM parquet_metadata('s3://flumen-test/nums/part-0.parquet') WHERE column_id = 0",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).ends_with(
            "n,total,last\n5000,12502500,row 999\nby_url\n5000\n\
             by_function\n12502500\nfooter_rows\n5000\n"
        ),
        "{}",
        text(&out.stdout)
    );
    let started = std::time::Instant::now();
    let out = flumen(
        &[
            "--no-demo",
            "-c",
            &format!(
                "CREATE EXTERNAL TABLE gone STORED AS PARQUET LOCATION 's3://no-such-bucket/x/' {options}"
            ),
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("no-such-bucket"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

/// `RESET flumen.<name>` puts the setting back to its default (DataFusion 55's `RESET` knows
/// only its own namespace), a wrong name or a startup option is an error naming it; the
/// shell has `information_schema` and `SHOW` on, as datafusion-cli does, and `SHOW` and
/// `df_settings` name flumen's settings as `SET` does.
#[test]
fn reset_puts_a_flumen_setting_back_and_show_works() {
    let out = csv_statements(&[
        "SET flumen.target_block_rows = 100",
        "SHOW flumen.target_block_rows",
        "RESET flumen.target_block_rows",
        "SELECT value FROM information_schema.df_settings WHERE name = 'flumen.target_block_rows'",
        "SET flumen.delta_txn_version = 5",
        "RESET flumen.delta_txn_version",
        "SHOW flumen.delta_txn_version",
        "RESET flumen.no_such_setting",
        "RESET flumen.worker_binary",
        "SHOW datafusion.execution.batch_size",
    ]);
    let stdout = text(&out.stdout);
    let block_rows = flumen::FlumenConfig::default().target_block_rows;
    let batch_size = datafusion::prelude::SessionConfig::new().batch_size();
    assert_eq!(
        stdout,
        format!(
            "name,value\nflumen.target_block_rows,100\nvalue\n{block_rows}\n\
             name,value\nflumen.delta_txn_version,\n\
             name,value\ndatafusion.execution.batch_size,{batch_size}\n"
        ),
        "{}",
        text(&out.stderr)
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("\"no_such_setting\" not found"), "{stderr}");
    assert!(stderr.contains("startup options"), "{stderr}");
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_quoted_path_is_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.parquet");
    let file = file.to_str().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let empty = empty.to_str().unwrap();
    let notes = dir.path().join("notes.sql");
    std::fs::write(&notes, "SELECT 1;").unwrap();
    let notes = notes.to_str().unwrap().to_string();
    let out = csv_statements(&[
        &format!("COPY (SELECT x AS id FROM generate_series(1, 100) AS t(x)) TO '{file}'"),
        &format!("SELECT count(*) AS n, sum(id) AS total FROM '{file}'"),
        "SELECT * FROM 'no/such/file.parquet'",
        &format!("SELECT * FROM '{empty}/'"),
        &format!("SELECT * FROM '{notes}'"),
        // A table whose name only looks like a path is created and read as any other.
        "CREATE TABLE \"made/here.csv\" AS SELECT 3 AS three",
        "SELECT three FROM \"made/here.csv\"",
        "SELECT 7 AS seven",
    ]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("n,total\n100,5050\n"), "{stdout}");
    let stderr = text(&out.stderr);
    // Each path that cannot be read says why, not "table ... not found".
    let why = |name: &str, cause: &str| {
        assert!(
            stderr.contains(&format!("cannot read '{name}' as a table: {cause}")),
            "{name}: {stderr}"
        )
    };
    why("no/such/file.parquet", "no file found there");
    why(&format!("{empty}/"), "no file found there");
    why(
        &notes,
        "its name ends in no format flumen reads (.parquet, .csv, .json, .avro, .arrow, ...); \
         name the format with read_csv(",
    );
    assert!(!stderr.contains("not found"), "{stderr}");
    assert!(
        stdout.ends_with("three\n3\nseven\n7\n"),
        "the shell went on: {stdout}"
    );
    assert_eq!(out.status.code(), Some(1), "the missing file fails the run");
}

/// Files of one directory that disagree on a column's type: each statement reading them
/// (a quoted path, `read_parquet`, `CREATE EXTERNAL TABLE`) names the types and a file of
/// each, where arrow's merge error names none; the shell goes on.
#[test]
fn files_that_disagree_on_a_column_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("t");
    let t = table.to_str().unwrap();
    let out = csv_statements(&[
        &format!("COPY (SELECT 1 AS a, 'x' AS b) TO '{t}/one.parquet'"),
        &format!("COPY (SELECT 2 AS a, 'y' AS b) TO '{t}/two.parquet'"),
        &format!("COPY (SELECT 'three' AS a, 'z' AS b) TO '{t}/three.parquet'"),
        &format!("SELECT count(*) AS n FROM '{t}/'"),
        &format!("SELECT count(*) AS n FROM read_parquet('{t}/')"),
        &format!("CREATE EXTERNAL TABLE e STORED AS PARQUET LOCATION '{t}/'"),
        "SELECT 7 AS seven",
    ]);
    let stderr = text(&out.stderr);
    println!("{stderr}");
    let told = "as one table: its files disagree on the type of column 'a': ";
    assert_eq!(stderr.matches(told).count(), 3, "{stderr}");
    assert_eq!(stderr.matches("Int64 in 2 files (").count(), 3, "{stderr}");
    let odd = format!("Utf8View in 1 file ({t}/three.parquet)");
    assert_eq!(stderr.matches(&odd).count(), 3, "{stderr}");
    assert!(
        text(&out.stdout).ends_with("seven\n7\n"),
        "the shell went on"
    );
}

#[test]
fn extract_runs_the_main_job() {
    if !flumen::functions::embedding::model_files::model_dir("")
        .join("model.safetensors")
        .exists()
    {
        skip::skip_missing_tool("the embedding model (run `flumen install-model`)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("docs.parquet");
    flumen::demo::write_docs(&input, 300).unwrap();
    let output = dir.path().join("features.parquet");
    // Not through `flumen()`: the model lives in the user's cache dir.
    let out = Command::new(FLUMEN)
        .args(["extract", input.to_str().unwrap(), output.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("wrote 300 rows of features"), "{stdout}");
    assert!(stdout.contains("documents closest to"), "{stdout}");
    // What it wrote, against vanilla DataFusion (with flumen's functions) on the input.
    let count = |ctx: &datafusion::prelude::SessionContext, sql: String| {
        let ctx = ctx.clone();
        async move {
            let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            datafusion::arrow::util::pretty::pretty_format_batches(&batches)
                .unwrap()
                .to_string()
        }
    };
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        use datafusion::prelude::{ParquetReadOptions, SessionContext};
        let vanilla = SessionContext::new();
        flumen::register_functions(&vanilla);
        for (name, path) in [("docs", &input), ("features", &output)] {
            vanilla
                .register_parquet(name, path.to_str().unwrap(), ParquetReadOptions::default())
                .await
                .unwrap();
        }
        let wrong_rows = count(
            &vanilla,
            "SELECT count(*) AS wrong FROM docs d FULL JOIN features f ON d.id = f.id \
             WHERE d.id IS NULL OR f.id IS NULL OR d.topic <> f.topic \
             OR length(clean_text(d.body)) <> f.chars \
             OR array_length(string_to_array(clean_text(d.body), ' ')) <> f.words \
             OR md5(lower(clean_text(d.body))) <> f.fingerprint"
                .into(),
        )
        .await;
        assert!(wrong_rows.contains("| 0     |"), "{wrong_rows}");
        // Every tenth row's vector against vanilla's embed of the same text.
        let vectors = count(
            &vanilla,
            "SELECT count(*) AS n, min(cosine_similarity(f.embedding, embed(clean_text(d.body)))) \
             >= 0.9999 AS close FROM docs d JOIN features f ON d.id = f.id WHERE d.id % 10 = 0"
                .into(),
        )
        .await;
        assert!(vectors.contains("| 30 | true  |"), "{vectors}");
    });
    let out = flumen(&["extract", "no-such-input.parquet", "out.parquet"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no-such-input.parquet"),
        "{}",
        text(&out.stderr)
    );
}

/// The binary installs its allocator (jemalloc) as flumen's `HeapAllocator`: a query's
/// `EXPLAIN ANALYZE` shows the heap nobody reserved that its budget counted, and shows none
/// with `flumen.budget_counts_heap` off.
#[test]
fn the_budget_counts_the_binary_allocators_heap() {
    let explain = |counts_heap: bool| {
        let setting = format!("SET flumen.budget_counts_heap = {counts_heap}");
        let query = "EXPLAIN ANALYZE SELECT value % 1000 AS k, count(*) FROM \
                     generate_series(1, 2000000) GROUP BY k";
        let budget = "SET flumen.memory_budget = '64MB'";
        let out = flumen(
            &["--no-demo", "-c", budget, "-c", &setting, "-c", query],
            "",
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert!(stdout.contains("FlumenExec"), "{stdout}");
        stdout.contains("peak_unreserved_bytes=")
    };
    assert!(
        explain(true),
        "no peak_unreserved_bytes with the heap counted"
    );
    assert!(
        !explain(false),
        "peak_unreserved_bytes with the heap not counted"
    );
}

/// The shell as a user builds it (`cargo build --release --bin flumen`: no dev-dependencies)
/// reads every format `datafusion-cli` reads. Test builds cannot show a format missing
/// there: they unify DataFusion's features with `datafusion-sqllogictest`'s, which turn Avro
/// on whatever `[dependencies]` says. So this asks cargo for the graph without
/// dev-dependencies.
#[test]
fn the_shell_built_without_dev_dependencies_reads_avro() {
    const AVRO_FORMAT: &str = "datafusion-datasource-avro";
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(&cargo)
        .args([
            "tree",
            "--offline",
            "--edges",
            "no-dev",
            "--invert",
            AVRO_FORMAT,
        ])
        .args(["--manifest-path", manifest])
        .output()
        .expect("cannot run cargo tree");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "cargo tree failed: {stderr}");
    // `cargo tree -i` prints the crate first, then what pulls it in; without it, only
    // "nothing to print" on stderr.
    assert!(
        stdout.starts_with(&format!("{AVRO_FORMAT} v")),
        "the shell's build lacks {AVRO_FORMAT}: give datafusion and datafusion-proto their \
         `avro` feature in [dependencies]\n{stdout}{stderr}"
    );
}

/// Clauses DataFusion 55 parses and drops or refuses: `GROUP BY ... WITH ROLLUP` (a plain
/// `GROUP BY` before: the total row was missing, with no error), `WITH CUBE`, `WITH TOTALS`,
/// `OFFSET m ROWS FETCH FIRST n ROWS ONLY` and `PREWHERE` (ClickHouse's; every row came back);
/// in threads mode and with two workers. `CONNECT BY` (which returned the whole table) is
/// refused. `ORDER BY ALL` (DuckDB's: by every output column, left to right; `all` was read
/// as a column) orders; `LIMIT n BY k` is refused naming it (it failed "No field named k").
#[test]
fn group_by_with_rollup_and_fetch_first_answer_in_the_shell() {
    let statements = [
        "CREATE TABLE t AS SELECT value AS v, value % 3 AS g, value % 2 AS h FROM range(10)",
        "SELECT g, sum(v) AS s FROM t GROUP BY g WITH ROLLUP ORDER BY 1 NULLS LAST",
        "SELECT count(*) AS n, sum(s) AS total FROM (SELECT g, h, sum(v) AS s FROM t GROUP BY 1, 2 WITH CUBE)",
        "SELECT g, sum(v) AS s FROM t GROUP BY g WITH TOTALS ORDER BY 1 NULLS LAST",
        "SELECT v FROM t ORDER BY v OFFSET 2 ROWS FETCH FIRST 3 ROWS ONLY",
        "SELECT count(*) AS n FROM t PREWHERE v > 5 WHERE g = 0",
        "SELECT g, h, v * 10 AS w FROM t WHERE v < 4 ORDER BY ALL DESC",
        "SELECT * FROM t WHERE v IN (1, 4, 7) ORDER BY ALL",
    ];
    let expected = "g,s\n0,18\n1,12\n2,15\n,45\n\
                    n,total\n12,180\n\
                    g,s\n0,18\n1,12\n2,15\n,45\n\
                    v\n2\n3\n4\n\
                    n\n2\n\
                    g,h,w\n2,0,20\n1,1,10\n0,1,30\n0,0,0\n\
                    v,g,h\n1,1,1\n4,1,0\n7,1,1\n";
    for workers in [None, Some("2")] {
        let mut args = vec!["--no-demo", "--quiet", "--format", "csv"];
        if let Some(n) = workers {
            args.extend(["--workers", n]);
        }
        for statement in statements {
            args.extend(["-c", statement]);
        }
        let out = flumen(&args, "");
        assert!(out.status.success(), "{workers:?}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), expected, "{workers:?} workers");
    }
    // What it cannot rewrite is refused naming the clause.
    let out = csv_statements(&[
        "CREATE TABLE t AS SELECT 1 AS g",
        "SELECT g FROM t GROUP BY ALL WITH ROLLUP",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("GROUP BY ALL WITH ROLLUP: name the columns"),
        "{}",
        text(&out.stderr)
    );
    for (statement, named) in [
        (
            "SELECT v FROM t START WITH v = 1 CONNECT BY PRIOR v = g",
            "WITH RECURSIVE",
        ),
        (
            "SELECT v, g FROM t ORDER BY v LIMIT 1 BY g",
            "LIMIT n BY g (n rows of each g) is not supported",
        ),
    ] {
        let out = csv_statements(&["CREATE TABLE t AS SELECT 1 AS v, 1 AS g", statement]);
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains(named), "{}", text(&out.stderr));
    }
}
