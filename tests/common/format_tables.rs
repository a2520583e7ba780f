//! Tables in every file format workers read, each in a form whose settings
//! datafusion-proto 55 drops (gzip CSV and JSON, CSV lines ended by `;`, JSON arrays, Arrow
//! IPC streams), Arrow files, Avro files, and Parquet with large types (`LargeUtf8`, `LargeList`), which Flight once
//! mangled: for checking that worker processes and cluster hosts read each as the driver
//! would.

use std::path::Path;

use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::prelude::{SessionConfig, SessionContext};

/// The tables [`write_format_tables`] makes; each has the columns `id` (0..), `name`
/// (`'name ' || id`) and `x` (`id * 1.5`).
pub const FORMAT_TABLES: &[&str] = &[
    "csv_gz",
    "json_gz",
    "arrow_files",
    "csv_semi",
    "json_array",
    "large_types",
    "arrow_streams",
    "avro_files",
];

/// Write [`FORMAT_TABLES`] under `dir`, `files` files of `rows_per_file` rows each; returns
/// the `CREATE EXTERNAL TABLE` statements that register them.
pub async fn write_format_tables(dir: &Path, files: usize, rows_per_file: usize) -> Vec<String> {
    let d = dir.display();
    let writer = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    for table in FORMAT_TABLES {
        std::fs::create_dir_all(dir.join(table)).unwrap();
    }
    for file in 0..files {
        let ids = file * rows_per_file..(file + 1) * rows_per_file;
        let rows = format!(
            "SELECT value AS id, 'name ' || value AS name, value * 1.5 AS x \
             FROM range({}, {})",
            ids.start, ids.end
        );
        for copy in [
            format!(
                "COPY ({rows}) TO '{d}/csv_gz/part-{file}.csv.gz' STORED AS CSV \
                 OPTIONS ('format.compression' 'gzip')"
            ),
            format!(
                "COPY ({rows}) TO '{d}/json_gz/part-{file}.json.gz' STORED AS JSON \
                 OPTIONS ('format.compression' 'gzip')"
            ),
            format!("COPY ({rows}) TO '{d}/arrow_files/part-{file}.arrow' STORED AS ARROW"),
            format!(
                "COPY (SELECT id, arrow_cast(name, 'LargeUtf8') AS name, x, \
                     arrow_cast(make_array(id, id + 1), 'LargeList(Int64)') AS ll \
                     FROM ({rows})) \
                 TO '{d}/large_types/part-{file}.parquet' STORED AS PARQUET"
            ),
        ] {
            writer.sql(&copy).await.unwrap().collect().await.unwrap();
        }
        let batches = writer.sql(&rows).await.unwrap().collect().await.unwrap();
        let stream = std::fs::File::create(dir.join(format!("arrow_streams/part-{file}.arrow")));
        let mut stream = StreamWriter::try_new(stream.unwrap(), &batches[0].schema()).unwrap();
        for batch in &batches {
            stream.write(batch).unwrap();
        }
        stream.finish().unwrap();
        write_avro(
            &dir.join(format!("avro_files/part-{file}.avro")),
            ids.clone(),
        );
        let semi: String = ids
            .clone()
            .map(|i| {
                format!(
                    "{i},name {i},{}.{};",
                    i * 3 / 2,
                    if i % 2 == 1 { 5 } else { 0 }
                )
            })
            .collect();
        std::fs::write(
            dir.join(format!("csv_semi/part-{file}.csv")),
            format!("id,name,x;{semi}"),
        )
        .unwrap();
        let objects: Vec<String> = ids
            .map(|i| {
                format!(
                    "{{\"id\": {i}, \"name\": \"name {i}\", \"x\": {}}}",
                    i as f64 * 1.5
                )
            })
            .collect();
        std::fs::write(
            dir.join(format!("json_array/part-{file}.json")),
            format!("[{}]", objects.join(",\n")),
        )
        .unwrap();
    }
    vec![
        format!(
            "CREATE EXTERNAL TABLE csv_gz STORED AS CSV LOCATION '{d}/csv_gz/' \
             OPTIONS ('format.compression' 'gzip')"
        ),
        format!(
            "CREATE EXTERNAL TABLE json_gz STORED AS JSON LOCATION '{d}/json_gz/' \
             OPTIONS ('format.compression' 'gzip')"
        ),
        format!("CREATE EXTERNAL TABLE arrow_files STORED AS ARROW LOCATION '{d}/arrow_files/'"),
        format!(
            "CREATE EXTERNAL TABLE csv_semi (id BIGINT, name VARCHAR, x DOUBLE) STORED AS CSV \
             LOCATION '{d}/csv_semi/' OPTIONS ('format.terminator' ';', 'format.has_header' 'true')"
        ),
        format!(
            "CREATE EXTERNAL TABLE json_array STORED AS JSON LOCATION '{d}/json_array/' \
             OPTIONS ('format.newline_delimited' 'false')"
        ),
        format!("CREATE EXTERNAL TABLE large_types STORED AS PARQUET LOCATION '{d}/large_types/'"),
        format!(
            "CREATE EXTERNAL TABLE arrow_streams STORED AS ARROW LOCATION '{d}/arrow_streams/'"
        ),
        format!("CREATE EXTERNAL TABLE avro_files STORED AS AVRO LOCATION '{d}/avro_files/'"),
    ]
}

/// An Avro file of the rows `ids` (DataFusion writes no Avro: apache-avro does).
fn write_avro(path: &Path, ids: std::ops::Range<usize>) {
    use apache_avro::types::Record;
    let schema = apache_avro::Schema::parse_str(
        r#"{"type": "record", "name": "row", "fields": [
            {"name": "id", "type": "long"},
            {"name": "name", "type": "string"},
            {"name": "x", "type": "double"}]}"#,
    )
    .unwrap();
    let mut writer =
        apache_avro::Writer::new(&schema, std::fs::File::create(path).unwrap()).unwrap();
    for i in ids {
        let mut record = Record::new(writer.schema()).unwrap();
        record.put("id", i as i64);
        record.put("name", format!("name {i}"));
        record.put("x", i as f64 * 1.5);
        writer.append_value(record).unwrap();
    }
    writer.flush().unwrap();
}

/// An aggregate over `table` (one of [`FORMAT_TABLES`]) that reads every column of it.
pub fn format_query(table: &str) -> String {
    format!(
        "SELECT id % 4 AS g, count(*) AS n, sum(id) AS s, max(name) AS m, sum(x) AS sx \
         FROM {table} WHERE id % 5 <> 1 GROUP BY id % 4 ORDER BY g"
    )
}
