//! Vector helpers for embeddings: `cosine_similarity(a, b)`, `dot_product(a, b)` and
//! `l2_distance(a, b)` over lists (FixedSizeList, List or LargeList) of floats.
//!
//! Either side may be a constant (`cosine_similarity(v, embed('query'))`). A NULL vector gives
//! NULL; vectors of different lengths are an error naming both lengths. Sums are taken in
//! f64 and returned as Float64.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array, Float64Builder};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Float64Type};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

/// Which vector function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VectorOp {
    /// `a·b / (|a| |b|)`; NULL when either vector is all zeros.
    Cosine,
    /// `a·b`.
    Dot,
    /// `|a - b|`.
    L2,
}

impl VectorOp {
    fn name(self) -> &'static str {
        match self {
            Self::Cosine => "cosine_similarity",
            Self::Dot => "dot_product",
            Self::L2 => "l2_distance",
        }
    }

    fn apply(self, a: &[f64], b: &[f64]) -> Option<f64> {
        match self {
            Self::Dot => Some(a.iter().zip(b).map(|(x, y)| x * y).sum()),
            Self::L2 => Some(
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y) * (x - y))
                    .sum::<f64>()
                    .sqrt(),
            ),
            Self::Cosine => {
                let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
                let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
                let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
                (na > 0.0 && nb > 0.0).then(|| dot / (na * nb))
            }
        }
    }
}

/// One of the vector functions as a `ScalarUDFImpl`.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct VectorFunction {
    op: VectorOp,
    signature: Signature,
}

impl VectorFunction {
    /// The function for `op`.
    pub fn new(op: VectorOp) -> Self {
        Self {
            op,
            signature: Signature::any(2, Volatility::Immutable),
        }
    }
}

/// All three vector functions, ready to register.
pub fn vector_functions() -> Vec<ScalarUDF> {
    [VectorOp::Cosine, VectorOp::Dot, VectorOp::L2]
        .into_iter()
        .map(|op| ScalarUDF::new_from_impl(VectorFunction::new(op)))
        .collect()
}

fn is_float_list(t: &DataType) -> bool {
    match t {
        DataType::FixedSizeList(f, _) | DataType::List(f) | DataType::LargeList(f) => {
            matches!(
                f.data_type(),
                DataType::Float16 | DataType::Float32 | DataType::Float64
            )
        }
        DataType::Null => true,
        _ => false,
    }
}

impl ScalarUDFImpl for VectorFunction {
    fn name(&self) -> &str {
        self.op.name()
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        for t in arg_types {
            if !is_float_list(t) {
                return Err(DataFusionError::Plan(format!(
                    "{}() takes two vectors (lists of Float32 or Float64, e.g. embed(...)), got {t}",
                    self.op.name()
                )));
            }
        }
        Ok(DataType::Float64)
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let target = DataType::LargeList(Arc::new(Field::new_list_field(DataType::Float64, true)));
        let a = cast(&arrays[0], &target)?;
        let b = cast(&arrays[1], &target)?;
        let (a, b) = (a.as_list::<i64>(), b.as_list::<i64>());
        let mut out = Float64Builder::with_capacity(a.len());
        for row in 0..a.len() {
            if a.is_null(row) || b.is_null(row) {
                out.append_null();
                continue;
            }
            let (va, vb) = (a.value(row), b.value(row));
            let (va, vb) = (
                va.as_primitive::<Float64Type>(),
                vb.as_primitive::<Float64Type>(),
            );
            if va.len() != vb.len() {
                return Err(DataFusionError::Execution(format!(
                    "{}(): vectors of different lengths ({} and {})",
                    self.op.name(),
                    va.len(),
                    vb.len()
                )));
            }
            if va.null_count() > 0 || vb.null_count() > 0 {
                out.append_null();
                continue;
            }
            out.append_option(self.op.apply(va.values(), vb.values()));
        }
        let result: Float64Array = out.finish();
        Ok(ColumnarValue::Array(Arc::new(result) as ArrayRef))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_measures() {
        let (a, b) = ([1.0, 0.0, 2.0], [2.0, 1.0, 2.0]);
        assert_eq!(VectorOp::Dot.apply(&a, &b), Some(6.0));
        assert_eq!(VectorOp::L2.apply(&a, &b), Some(2f64.sqrt()));
        let cos = VectorOp::Cosine.apply(&a, &b).unwrap();
        assert!((cos - 6.0 / (5f64.sqrt() * 3.0)).abs() < 1e-12);
        assert_eq!(VectorOp::Cosine.apply(&[0.0, 0.0], &b[..2]), None);
    }
}
