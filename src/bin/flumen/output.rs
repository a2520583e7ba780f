//! Printing query results: `table`, `csv`, `json` or `ndjson`, at most `--maxrows` rows.

use std::io::Write;

use clap::ValueEnum;
use datafusion::arrow::csv::WriterBuilder as CsvWriterBuilder;
use datafusion::arrow::json::WriterBuilder as JsonWriterBuilder;
use datafusion::arrow::json::writer::{JsonArray, JsonFormat, LineDelimited};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// An aligned text table.
    Table,
    /// Comma-separated values with a header line.
    Csv,
    /// One JSON array of row objects.
    Json,
    /// One JSON object per line.
    Ndjson,
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        <Self as ValueEnum>::from_str(s.trim(), true)
            .map_err(|_| format!("unknown format '{s}': table, csv, json or ndjson"))
    }
}

impl Format {
    /// Its name as typed on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Table => "table",
            Self::Csv => "csv",
            Self::Json => "json",
            Self::Ndjson => "ndjson",
        }
    }
}

/// Print `batches` (the first `maxrows` rows of a result of `total_rows`) to `out`.
pub fn print(
    out: &mut dyn Write,
    format: Format,
    batches: &[RecordBatch],
    total_rows: usize,
) -> Result<()> {
    let shown: usize = batches.iter().map(|b| b.num_rows()).sum();
    match format {
        Format::Table => {
            if batches.is_empty() || batches[0].num_columns() == 0 {
                return Ok(());
            }
            writeln!(out, "{}", pretty_format_batches(batches)?)?;
            if shown < total_rows {
                writeln!(
                    out,
                    "({shown} of {total_rows} rows shown; --maxrows or \\maxrows N to see more)"
                )?;
            }
        }
        Format::Csv => {
            let mut writer = CsvWriterBuilder::new().with_header(true).build(&mut *out);
            for batch in batches {
                writer.write(batch)?;
            }
        }
        Format::Json if shown == 0 => writeln!(out, "[]")?,
        Format::Json => {
            write_json::<JsonArray>(out, batches)?;
            writeln!(out)?;
        }
        Format::Ndjson => write_json::<LineDelimited>(out, batches)?,
    }
    Ok(())
}

/// Write `batches` as JSON in layout `F` (an array, or one object per line), NULLs included.
fn write_json<F: JsonFormat>(out: &mut dyn Write, batches: &[RecordBatch]) -> Result<()> {
    let mut writer = JsonWriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, F>(out);
    for batch in batches {
        writer.write(batch)?;
    }
    writer.finish()?;
    Ok(())
}
