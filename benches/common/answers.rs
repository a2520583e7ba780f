//! Whether two engines gave the same answer to a query: rows sorted (TPC-H's `ORDER BY`
//! has ties, so order is not compared), floats to a relative 1e-9, everything else exactly.

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;

/// One cell of a result: floats compared to a tolerance, everything else as text.
#[derive(Debug, Clone)]
enum Cell {
    Float(f64),
    Text(String),
}

impl Cell {
    /// Sort key: floats rounded so that values within the tolerance sort alike.
    fn key(&self) -> String {
        match self {
            Cell::Float(x) => format!("{x:.6e}"),
            Cell::Text(t) => t.clone(),
        }
    }

    fn matches(&self, other: &Cell) -> bool {
        match (self, other) {
            (Cell::Float(a), Cell::Float(b)) => {
                (a.is_nan() && b.is_nan())
                    || a == b
                    || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
            }
            (Cell::Text(a), Cell::Text(b)) => a == b,
            _ => false,
        }
    }
}

/// A result as rows of cells, sorted (TPC-H's ORDER BY has ties, so order is not compared).
fn result_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<Cell>>> {
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
    use datafusion::arrow::util::display::array_value_to_string;
    let mut rows = vec![];
    for batch in batches {
        for row in 0..batch.num_rows() {
            let mut cells = vec![];
            for column in batch.columns() {
                cells.push(match column.data_type() {
                    _ if column.is_null(row) => Cell::Text("NULL".into()),
                    DataType::Float64 => {
                        Cell::Float(column.as_primitive::<Float64Type>().value(row))
                    }
                    DataType::Float32 => {
                        Cell::Float(column.as_primitive::<Float32Type>().value(row) as f64)
                    }
                    _ => Cell::Text(array_value_to_string(column, row)?),
                });
            }
            rows.push(cells);
        }
    }
    rows.sort_by_cached_key(|cells| cells.iter().map(Cell::key).collect::<Vec<_>>());
    Ok(rows)
}

/// Panics, naming the query and the first differing row, unless the answers match.
pub fn assert_same_answer(n: usize, vanilla: &[RecordBatch], flumen: &[RecordBatch]) -> Result<()> {
    let (v, f) = (result_rows(vanilla)?, result_rows(flumen)?);
    assert_eq!(
        v.len(),
        f.len(),
        "q{n}: flumen returned {} rows, vanilla DataFusion {}",
        f.len(),
        v.len()
    );
    for (i, (a, b)) in v.iter().zip(&f).enumerate() {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.matches(y));
        assert!(
            same,
            "q{n}: row {i} differs:\n vanilla {a:?}\n flumen  {b:?}"
        );
    }
    Ok(())
}
