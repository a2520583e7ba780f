//! `row_hash(seed, value, ...)`: a seeded 64-bit hash of a row's values.
//!
//! The same seed and values give the same hash in every process and every run, so it can
//! key a reproducible sample (`WHERE row_hash(7, id) % 100 < 5`) or a random shuffle: the
//! planner's `ORDER BY random()` rewrite (`plan/random_shuffle.rs`) partitions rows by it.
//! NULLs hash to a fixed value; the result is never NULL. Types are those DataFusion's hash
//! joins hash (every primitive, string, binary, decimal, temporal, list and struct type).

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, UInt64Array, new_empty_array};
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::hash_utils::{RandomState, create_hashes};
use datafusion::common::{ScalarValue, exec_err, plan_err};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};

/// Name under which `row_hash` is registered (workers decode it by this name).
pub const ROW_HASH: &str = "row_hash";

/// The `row_hash` scalar function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct RowHash {
    signature: Signature,
}

impl Default for RowHash {
    fn default() -> Self {
        Self {
            signature: Signature::variadic_any(Volatility::Immutable),
        }
    }
}

impl ScalarUDFImpl for RowHash {
    fn name(&self) -> &str {
        ROW_HASH
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        if arg_types.len() < 2 || !arg_types[0].is_integer() {
            return plan_err!(
                "row_hash(seed, value, ...) takes an integer seed and at least one value, got \
                 ({})",
                arg_types
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(DataType::UInt64)
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let seed = match &args.args[0] {
            ColumnarValue::Scalar(s) => seed_of(s)?,
            ColumnarValue::Array(_) => return exec_err!("row_hash: the seed must be a constant"),
        };
        let rows = args.number_rows;
        let values = args.args[1..]
            .iter()
            .map(|v| v.to_array(rows))
            .collect::<Result<Vec<_>>>()?;
        let hashes: ArrayRef = Arc::new(UInt64Array::from(hash_rows(&values, seed, rows)?));
        Ok(ColumnarValue::Array(hashes))
    }
}

/// The seed as a `u64` (negative seeds wrap); an error for NULL.
fn seed_of(seed: &ScalarValue) -> Result<u64> {
    if seed.is_null() {
        return exec_err!("row_hash: the seed is NULL");
    }
    if let ScalarValue::UInt64(Some(v)) = seed {
        return Ok(*v);
    }
    match seed.cast_to(&DataType::Int64)? {
        ScalarValue::Int64(Some(v)) => Ok(v as u64),
        other => exec_err!("row_hash: the seed must be an integer, got {other}"),
    }
}

/// One hash per row of `columns` (all `rows` long), seeded by `seed`.
pub fn hash_rows(columns: &[ArrayRef], seed: u64, rows: usize) -> Result<Vec<u64>> {
    let mut hashes = vec![0u64; rows];
    create_hashes(columns, &RandomState::with_seed(seed), &mut hashes)?;
    Ok(hashes)
}

/// `row_hash` as a `ScalarUDF` to register.
pub fn row_hash_udf() -> ScalarUDF {
    ScalarUDF::new_from_impl(RowHash::default())
}

/// The physical expression `row_hash(seed, every column of schema that can be hashed)`
/// over rows of `schema`, leaving out the columns at `except`; `None` when no column is left.
pub fn row_hash_of_columns(
    schema: &Schema,
    seed: u64,
    except: &[usize],
    options: &ConfigOptions,
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let columns: Vec<Arc<dyn PhysicalExpr>> = schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(i, f)| !except.contains(i) && hashable(f.data_type()))
        .map(|(i, f)| Arc::new(Column::new(f.name(), i)) as Arc<dyn PhysicalExpr>)
        .collect();
    if columns.is_empty() {
        return Ok(None);
    }
    let seed: Arc<dyn PhysicalExpr> = Arc::new(Literal::new(ScalarValue::UInt64(Some(seed))));
    let hash = ScalarFunctionExpr::try_new(
        Arc::new(row_hash_udf()),
        std::iter::once(seed).chain(columns).collect(),
        schema,
        Arc::new(options.clone()),
    )?;
    Ok(Some(Arc::new(hash)))
}

/// Whether `row_hash` can hash values of type `data_type` (DataFusion's hashing takes it).
fn hashable(data_type: &DataType) -> bool {
    create_hashes(
        &[new_empty_array(data_type)],
        &RandomState::with_seed(0),
        &mut Vec::new(),
    )
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int64Array, StringArray};

    #[test]
    fn same_seed_same_hash_other_seed_other_hash() {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..1000));
        let names: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..1000).map(|i| format!("n{}", i % 7)),
        ));
        let columns = [ids, names];
        let a = hash_rows(&columns, 1, 1000).unwrap();
        assert_eq!(a, hash_rows(&columns, 1, 1000).unwrap());
        let b = hash_rows(&columns, 2, 1000).unwrap();
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert_eq!(same, 0, "seeds 1 and 2 agree on {same} rows");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), 1000);
        // Spread: each of 8 buckets gets close to an eighth of the rows.
        let mut buckets = [0usize; 8];
        a.iter().for_each(|h| buckets[(h % 8) as usize] += 1);
        assert!(
            buckets.iter().all(|&n| (80..170).contains(&n)),
            "{buckets:?}"
        );
    }
}
