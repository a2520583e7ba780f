//! What datafusion-proto 55 drops of CSV and JSON scans, carried beside a task plan's scan
//! and put back on the worker's decoded copy:
//! - a CSV or JSON scan's **compression** (decoded as uncompressed: a worker read gzip bytes
//!   as text, copy.slt's `validate_csv` and `validate_json_gz`);
//! - a CSV scan's **line terminator** (decoded as `\n` or `\r\n`);
//! - a JSON scan's **array format** (`[{..}, {..}]`, `format.newline_delimited false`),
//!   decoded as newline-delimited JSON. DataFusion has no getter for it: it is read from
//!   what the scan's file opener does with a byte range ([`json_is_array`]).
//!
//! [`describe_format`] adds all three to the text the round-trip check compares, so a loss
//! shows there too.

use std::str::FromStr;
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::common::parsers::CompressionTypeVariant;
use datafusion::datasource::file_format::file_compression_type::FileCompressionType;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::{
    CsvSource, FileScanConfig, FileScanConfigBuilder, FileSource, JsonSource,
};
use datafusion::error::{DataFusionError, Result};
use object_store::memory::InMemory;

/// The settings of a CSV or JSON scan a task plan carries beside its datafusion-proto
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
}

impl ScanFormat {
    /// What datafusion-proto would lose of the scan `config`; `None` when nothing.
    pub(super) fn lost_by_proto(config: &FileScanConfig) -> Result<Option<Self>> {
        let source = config.file_source();
        let csv = source.downcast_ref::<CsvSource>();
        let json = source.downcast_ref::<JsonSource>();
        if csv.is_none() && json.is_none() {
            return Ok(None);
        }
        let format = Self {
            compression: config.file_compression_type.get_variant().to_string(),
            csv_terminator: csv.and_then(|csv| csv.terminator()).map(u32::from),
            json_array: match json {
                Some(json) => json_is_array(json, config)?,
                None => false,
            },
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
        Ok(builder)
    }
}

/// The settings of the scan `config` that its plan text does not show and proto drops (for
/// the round-trip check); empty for other formats than CSV and JSON.
pub(super) fn describe_format(config: &FileScanConfig) -> String {
    match ScanFormat::lost_by_proto(config) {
        Ok(None) => String::new(),
        Ok(Some(format)) => format!(
            "format: compression={} csv_terminator={:?} json_array={}\n",
            format.compression, format.csv_terminator, format.json_array
        ),
        Err(e) => format!("format: unknown ({e})\n"),
    }
}

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
}
