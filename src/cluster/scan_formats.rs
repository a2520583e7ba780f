//! What datafusion-proto 55 drops of CSV, JSON and Arrow-stream scans, carried beside a task
//! plan's scan and put back on the worker's decoded copy:
//! - a CSV or JSON scan's **compression** (decoded as uncompressed: a worker read gzip bytes
//!   as text, copy.slt's `validate_csv` and `validate_json_gz`);
//! - a CSV scan's **line terminator** (decoded as `\n` or `\r\n`);
//! - a JSON scan's **array format** (`[{..}, {..}]`, `format.newline_delimited false`),
//!   decoded as newline-delimited JSON. DataFusion has no getter for it: it is read from
//!   what the scan's file opener does with a byte range ([`json_is_array`]);
//! - an Arrow scan's **stream format** (Arrow IPC streams, not files), decoded as the file
//!   format, whose reader fails on a stream.
//!
//! [`describe_format`] adds all four to the text the round-trip check compares, so a loss
//! shows there too.

use std::str::FromStr;
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::common::parsers::CompressionTypeVariant;
use datafusion::datasource::file_format::file_compression_type::FileCompressionType;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::{
    ArrowSource, CsvSource, FileScanConfig, FileScanConfigBuilder, FileSource, JsonSource,
};
use datafusion::error::{DataFusionError, Result};
use object_store::memory::InMemory;

/// The settings of a CSV, JSON or Arrow scan a task plan carries beside its datafusion-proto
/// encoding (none is set for a scan that loses nothing).
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct ScanFormat {
    /// The files' compression (`GZIP`, `BZIP2`, `XZ`, `ZSTD`); empty: uncompressed.
    #[prost(string, tag = "1")]
    pub compression: String,
    /// A CSV scan's line terminator byte, where it has one.
    #[prost(uint32, optional, tag = "2")]
    pub csv_terminator: Option<u32>,
    /// A JSON scan reads JSON arrays, not one object per line.
    #[prost(bool, tag = "3")]
    pub json_array: bool,
    /// An Arrow scan reads Arrow IPC streams, not Arrow IPC files.
    #[prost(bool, tag = "4")]
    pub arrow_stream: bool,
}

impl ScanFormat {
    /// What datafusion-proto would lose of the scan `config`; `None` when nothing.
    pub(super) fn lost_by_proto(config: &FileScanConfig) -> Result<Option<Self>> {
        let source = config.file_source();
        let csv = source.downcast_ref::<CsvSource>();
        let json = source.downcast_ref::<JsonSource>();
        let arrow_stream = source.file_type() == ARROW_STREAM;
        if csv.is_none() && json.is_none() && !arrow_stream {
            return Ok(None);
        }
        let format = Self {
            compression: config.file_compression_type.get_variant().to_string(),
            csv_terminator: csv.and_then(|csv| csv.terminator()).map(u32::from),
            json_array: match json {
                Some(json) => json_is_array(json, config)?,
                None => false,
            },
            arrow_stream,
        };
        Ok((format != Self::default()).then_some(format))
    }

    /// `builder` (a decoded scan's, whose source is `source`) with these settings back.
    pub(super) fn put_back(
        &self,
        mut builder: FileScanConfigBuilder,
        source: &Arc<dyn FileSource>,
    ) -> Result<FileScanConfigBuilder> {
        if !self.compression.is_empty() {
            let variant = CompressionTypeVariant::from_str(&self.compression)?;
            builder = builder.with_file_compression_type(FileCompressionType::from(variant));
        }
        if let Some(terminator) = self.csv_terminator {
            let csv = source.downcast_ref::<CsvSource>().ok_or_else(|| {
                DataFusionError::Execution("a task plan's CSV terminator is on another scan".into())
            })?;
            let terminator = u8::try_from(terminator).map_err(|_| {
                DataFusionError::Execution(format!(
                    "a task plan's CSV terminator {terminator} is not a byte"
                ))
            })?;
            builder = builder.with_source(Arc::new(csv.with_terminator(Some(terminator))));
        }
        if self.json_array {
            let json = source.downcast_ref::<JsonSource>().ok_or_else(|| {
                DataFusionError::Execution(
                    "a task plan's JSON array format is on another scan".into(),
                )
            })?;
            builder = builder.with_source(Arc::new(json.clone().with_newline_delimited(false)));
        }
        if self.arrow_stream {
            if source.downcast_ref::<ArrowSource>().is_none() {
                return Err(DataFusionError::Execution(
                    "a task plan's Arrow stream format is on another scan".into(),
                ));
            }
            // The decoded file-format source, rebuilt as a stream one with its projection.
            let stream: Arc<dyn FileSource> = Arc::new(ArrowSource::new_stream_file_source(
                source.table_schema().clone(),
            ));
            let stream = match source.projection() {
                Some(projection) => {
                    stream.try_pushdown_projection(projection)?.ok_or_else(|| {
                        DataFusionError::Execution(
                            "an Arrow stream scan refused its own projection".into(),
                        )
                    })?
                }
                None => stream,
            };
            builder = builder.with_source(stream);
        }
        Ok(builder)
    }
}

/// The settings of the scan `config` that its plan text does not show and proto drops (for
/// the round-trip check); empty for other formats than CSV, JSON and Arrow streams.
pub(super) fn describe_format(config: &FileScanConfig) -> String {
    match ScanFormat::lost_by_proto(config) {
        Ok(None) => String::new(),
        Ok(Some(format)) => format!(
            "format: compression={} csv_terminator={:?} json_array={} arrow_stream={}\n",
            format.compression, format.csv_terminator, format.json_array, format.arrow_stream
        ),
        Err(e) => format!("format: unknown ({e})\n"),
    }
}

/// What an Arrow scan of IPC streams says its file type is.
const ARROW_STREAM: &str = "arrow_stream";

/// Whether the JSON scan `config` (whose source is `json`) reads JSON arrays. DataFusion 55
/// has no getter for it; its file opener refuses a byte range of a file, before any read,
/// exactly when it reads arrays. (A probe that panics is an error: the task then runs on
/// the driver.)
fn json_is_array(json: &JsonSource, config: &FileScanConfig) -> Result<bool> {
    let opener =
        json.with_batch_size(1)
            .create_file_opener(Arc::new(InMemory::new()), config, 0)?;
    let mut a_range = PartitionedFile::new("format-probe.json", 2).with_range(0, 1);
    a_range.partition_values = (config.table_partition_cols().iter())
        .map(|field| ScalarValue::try_from(field.data_type()))
        .collect::<Result<_>>()?;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        opener.open(a_range).is_err()
    }))
    .map_err(|_| {
        DataFusionError::NotImplemented(
            "cannot tell whether a JSON scan reads arrays or lines".into(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plans::{node_named, physical_plan};
    use datafusion::datasource::source::DataSourceExec;
    use datafusion::prelude::*;

    /// The file scan of the physical plan of `sql` in `ctx`.
    async fn scan_of(ctx: &SessionContext, sql: &str) -> FileScanConfig {
        let plan = physical_plan(ctx, sql).await;
        let scan = node_named(&plan, "DataSourceExec").expect("a scan");
        let config = scan.downcast_ref::<DataSourceExec>().unwrap().data_source();
        config.downcast_ref::<FileScanConfig>().unwrap().clone()
    }

    /// Each lost setting is read from a planned scan, and a plain scan has none to carry.
    #[tokio::test]
    async fn what_proto_drops_is_read_from_csv_and_json_scans() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        std::fs::write(dir.path().join("plain.csv"), "a,b\n1,x\n").unwrap();
        std::fs::write(dir.path().join("lines.csv"), "a,b;1,x;").unwrap();
        std::fs::write(dir.path().join("rows.json"), "{\"a\":1}\n").unwrap();
        std::fs::write(dir.path().join("array.json"), "[{\"a\":1}]").unwrap();
        let ctx = SessionContext::new();
        for ddl in [
            format!("CREATE EXTERNAL TABLE plain STORED AS CSV LOCATION '{d}/plain.csv'"),
            format!(
                "CREATE EXTERNAL TABLE lines STORED AS CSV LOCATION '{d}/lines.csv' \
                 OPTIONS ('format.terminator' ';')"
            ),
            format!("CREATE EXTERNAL TABLE rows STORED AS JSON LOCATION '{d}/rows.json'"),
            format!(
                "CREATE EXTERNAL TABLE arr STORED AS JSON LOCATION '{d}/array.json' \
                 OPTIONS ('format.newline_delimited' 'false')"
            ),
        ] {
            ctx.sql(&ddl).await.unwrap();
        }
        let lost = |sql: &'static str| {
            let ctx = ctx.clone();
            async move { ScanFormat::lost_by_proto(&scan_of(&ctx, sql).await).unwrap() }
        };
        assert_eq!(lost("SELECT * FROM plain").await, None);
        assert_eq!(lost("SELECT * FROM rows").await, None);
        let lines = lost("SELECT * FROM lines").await.unwrap();
        assert_eq!(lines.csv_terminator, Some(u32::from(b';')));
        let array = lost("SELECT * FROM arr").await.unwrap();
        assert!(array.json_array);
        assert_eq!(array.compression, "");
    }

    /// An Arrow IPC stream scan comes back from a task plan a stream scan with its
    /// projection, and reads what the driver's reads (proto alone decodes a file scan, whose
    /// reader fails on a stream); an Arrow file scan carries nothing.
    #[tokio::test]
    async fn an_arrow_stream_scan_comes_back_a_stream_scan_with_its_projection() {
        use crate::cluster::task_plan::{WorkerFunctions, check_round_trip, decode, encode};
        use datafusion::arrow::ipc::writer::StreamWriter;
        use datafusion::physical_plan::collect;

        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let ctx = SessionContext::new();
        let rows = "SELECT value AS a, value * 2 AS b, 'x' || value AS c FROM range(5)";
        let batches = ctx.sql(rows).await.unwrap().collect().await.unwrap();
        let file = std::fs::File::create(dir.path().join("s.arrow")).unwrap();
        let mut stream = StreamWriter::try_new(file, &batches[0].schema()).unwrap();
        stream.write(&batches[0]).unwrap();
        stream.finish().unwrap();
        let copy = format!("COPY ({rows}) TO '{d}/f.arrow' STORED AS ARROW");
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        for (name, file) in [("s", "s.arrow"), ("f", "f.arrow")] {
            let ddl = format!("CREATE EXTERNAL TABLE {name} STORED AS ARROW LOCATION '{d}/{file}'");
            ctx.sql(&ddl).await.unwrap();
        }
        let file_scan = scan_of(&ctx, "SELECT c, a FROM f").await;
        assert_eq!(ScanFormat::lost_by_proto(&file_scan).unwrap(), None);

        let scan = scan_of(&ctx, "SELECT c, a FROM s").await;
        assert!(
            ScanFormat::lost_by_proto(&scan)
                .unwrap()
                .unwrap()
                .arrow_stream
        );
        let plan: Arc<dyn datafusion::physical_plan::ExecutionPlan> =
            DataSourceExec::from_data_source(scan);
        let bytes = encode(&plan, Arc::new(WorkerFunctions::default())).unwrap();
        let task_ctx = ctx.task_ctx();
        check_round_trip(&plan, &bytes, &task_ctx).unwrap();
        let decoded = decode(&bytes, &task_ctx).unwrap();
        let source = decoded
            .downcast_ref::<DataSourceExec>()
            .unwrap()
            .data_source();
        let config = source.downcast_ref::<FileScanConfig>().unwrap();
        assert_eq!(config.file_source().file_type(), ARROW_STREAM);
        let read = |plan| collect(plan, ctx.task_ctx());
        let (here, there) = (read(plan).await.unwrap(), read(decoded).await.unwrap());
        assert_eq!(here, there);
        assert_eq!(there[0].num_columns(), 2);
        assert_eq!(there.iter().map(|b| b.num_rows()).sum::<usize>(), 5);
    }
}
