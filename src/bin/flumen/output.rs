//! Printing query results: `table`, `csv`, `json` or `ndjson`, at most `--maxrows` rows, and
//! in the table format each cell cut at `--maxwidth` characters (a 384-number vector would
//! otherwise fill the screen).

use std::io::Write;
use std::sync::Arc;

use clap::ValueEnum;
use datafusion::arrow::array::{Array, ArrayRef, StringArray};
use datafusion::arrow::csv::WriterBuilder as CsvWriterBuilder;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::json::WriterBuilder as JsonWriterBuilder;
use datafusion::arrow::json::writer::{JsonArray, JsonFormat, LineDelimited};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
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

/// Print `batches` (the first `maxrows` rows of a result of `total_rows`) to `out`; in the
/// table format a cell longer than `max_width` characters is cut to that many, ending in `…`.
pub fn print(
    out: &mut dyn Write,
    format: Format,
    batches: &[RecordBatch],
    total_rows: usize,
    max_width: Option<usize>,
) -> Result<()> {
    let shown: usize = batches.iter().map(|b| b.num_rows()).sum();
    match format {
        Format::Table => {
            if batches.is_empty() || batches[0].num_columns() == 0 {
                return Ok(());
            }
            let (batches, cut) = match max_width {
                Some(width) => cut_cells(batches, width)?,
                None => (batches.to_vec(), false),
            };
            writeln!(out, "{}", pretty_format_batches(&batches)?)?;
            if shown < total_rows {
                writeln!(
                    out,
                    "({shown} of {total_rows} rows shown; --maxrows or \\maxrows N to see more)"
                )?;
            }
            if let (true, Some(width)) = (cut, max_width) {
                writeln!(
                    out,
                    "(cells cut at {width} characters; --maxwidth or \\maxwidth N to see more, \\maxwidth 0 whole)"
                )?;
            }
        }
        Format::Csv => {
            let mut writer = CsvWriterBuilder::new().with_header(true).build(&mut *out);
            for batch in batches {
                writer.write(&nested_as_text(batch)?)?;
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

/// `batch` with each nested column (lists, structs, maps, unions: what CSV has no form for)
/// as the text the table format shows for it, NULLs kept.
fn nested_as_text(batch: &RecordBatch) -> Result<RecordBatch> {
    if !(batch.schema().fields().iter()).any(|f| f.data_type().is_nested()) {
        return Ok(batch.clone());
    }
    let options = FormatOptions::default();
    let mut fields = Vec::with_capacity(batch.num_columns());
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if !field.data_type().is_nested() {
            fields.push(Arc::clone(field));
            columns.push(Arc::clone(column));
            continue;
        }
        fields.push(Arc::new(Field::new(field.name(), DataType::Utf8, true)));
        columns.push(Arc::new(as_text(column, &options)?) as ArrayRef);
    }
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// `column` as the text the table format shows for each value, NULLs kept.
fn as_text(column: &ArrayRef, options: &FormatOptions) -> Result<StringArray> {
    let formatter = ArrayFormatter::try_new(column.as_ref(), options)?;
    Ok((0..column.len())
        .map(|row| {
            column
                .is_valid(row)
                .then(|| formatter.value(row).to_string())
        })
        .collect())
}

/// `batches` with every column that has a value longer than `width` characters as text, each
/// such value cut to `width` characters ending in `…` (at least the `…`); and whether any was
/// cut. Columns with no long value stay as they are.
fn cut_cells(batches: &[RecordBatch], width: usize) -> Result<(Vec<RecordBatch>, bool)> {
    let options = FormatOptions::default();
    let mut any_cut = false;
    let mut cut_batches = Vec::with_capacity(batches.len());
    for batch in batches {
        let mut fields = Vec::with_capacity(batch.num_columns());
        let mut columns = Vec::with_capacity(batch.num_columns());
        for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
            let text = as_text(column, &options)?;
            let long = |value: &str| value.chars().nth(width).is_some();
            if !text.iter().flatten().any(long) {
                fields.push(Arc::clone(field));
                columns.push(Arc::clone(column));
                continue;
            }
            any_cut = true;
            let keep = width.saturating_sub(1);
            let cut: StringArray = text
                .iter()
                .map(|value| {
                    value.map(|v| match long(v) {
                        true => v.chars().take(keep).chain(['…']).collect(),
                        false => v.to_string(),
                    })
                })
                .collect();
            fields.push(Arc::new(Field::new(field.name(), DataType::Utf8, true)));
            columns.push(Arc::new(cut) as ArrayRef);
        }
        cut_batches.push(RecordBatch::try_new(
            Arc::new(Schema::new(fields)),
            columns,
        )?);
    }
    Ok((cut_batches, any_cut))
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

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Int64Array, ListArray};
    use datafusion::arrow::datatypes::Int64Type;

    use super::*;

    #[test]
    fn csv_shows_a_nested_column_as_the_table_does() {
        let lists = ListArray::from_iter_primitive::<Int64Type, _, _>(vec![
            Some(vec![Some(1), Some(2)]),
            None,
            Some(vec![]),
        ]);
        let ids = Int64Array::from(vec![1, 2, 3]);
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("xs", Arc::new(lists) as ArrayRef),
        ])
        .unwrap();
        let mut out = Vec::new();
        print(&mut out, Format::Csv, &[batch], 3, Some(2)).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "id,xs\n1,\"[1, 2]\"\n2,\n3,[]\n"
        );
    }

    #[test]
    fn a_table_cuts_long_cells_and_says_so() {
        let lists = ListArray::from_iter_primitive::<Int64Type, _, _>(vec![
            Some((0..100).map(Some).collect::<Vec<_>>()),
            Some(vec![Some(7)]),
            None,
        ]);
        let names = StringArray::from(vec![Some("é".repeat(30)), Some("short".into()), None]);
        let batch = RecordBatch::try_from_iter([
            ("xs", Arc::new(lists) as ArrayRef),
            ("name", Arc::new(names) as ArrayRef),
        ])
        .unwrap();
        let printed = |width| {
            let mut out = Vec::new();
            print(
                &mut out,
                Format::Table,
                std::slice::from_ref(&batch),
                3,
                width,
            )
            .unwrap();
            String::from_utf8(out).unwrap()
        };
        let cut = printed(Some(12));
        assert!(cut.contains("| [0, 1, 2, 3… |"), "{cut}");
        assert!(cut.contains(&format!("| {}… |", "é".repeat(11))), "{cut}");
        assert!(cut.contains("| [7]          | short        |"), "{cut}");
        assert!(cut.contains("(cells cut at 12 characters;"), "{cut}");
        let whole = printed(None);
        assert!(whole.contains("98, 99]"), "{whole}");
        assert!(
            !whole.contains('…') && !whole.contains("cells cut"),
            "{whole}"
        );
        // Wide enough for every cell: printed as without a limit.
        assert_eq!(printed(Some(400)), whole);
    }
}
