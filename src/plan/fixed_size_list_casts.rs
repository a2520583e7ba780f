//! Casts of lists to fixed-size lists that read a sliced list right. arrow-cast 59's
//! `cast_list_to_fixed_size_list` takes the child values from position 0, not from where a
//! sliced list's offsets start (arrow-rs issue 10975), so `arrow_cast(v, 'FixedSizeList(3,
//! Int64)')` over rows that a `LIMIT ... OFFSET`, a TopK or a block cut sliced silently
//! answers with other rows' values (vanilla DataFusion 55 too: 987,202,000 for 980,010,000
//! over 20,000 rows).
//!
//! [`UnslicedListCasts`], a logical optimizer rule run last, wraps the input of every cast
//! to a fixed-size list in `unsliced_lists(..)` ([`UnslicedLists`]): the same lists, with
//! offsets that start at 0 (a zero-copy slice of the child values). Its name in schemas is
//! its argument's, so column names do not change.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, GenericListArray, OffsetSizeTrait};
use datafusion::arrow::buffer::OffsetBuffer;
use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Result, exec_err};
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::{
    Cast, ColumnarValue, Expr, LogicalPlan, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, TryCast, Volatility,
};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};

/// `unsliced_lists(list)`: the same lists, with offsets from 0 (any other value passes
/// through unchanged).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct UnslicedLists {
    /// Any one argument.
    signature: Signature,
}

impl Default for UnslicedLists {
    fn default() -> Self {
        Self {
            signature: Signature::any(1, Volatility::Immutable),
        }
    }
}

/// The `unsliced_lists` scalar UDF (registered in every flumen session, so workers decode
/// the casts that call it).
pub fn unsliced_lists_udf() -> ScalarUDF {
    ScalarUDF::new_from_impl(UnslicedLists::default())
}

impl ScalarUDFImpl for UnslicedLists {
    fn name(&self) -> &str {
        "unsliced_lists"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        match arg_types {
            [one] => Ok(one.clone()),
            _ => exec_err!("unsliced_lists takes one argument"),
        }
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        match args {
            [one] => Ok(one.schema_name().to_string()),
            _ => exec_err!("unsliced_lists takes one argument"),
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let [value] = args.args.as_slice() else {
            return exec_err!("unsliced_lists takes one argument");
        };
        Ok(match value {
            ColumnarValue::Array(array) => ColumnarValue::Array(unsliced(array)),
            scalar => scalar.clone(),
        })
    }
}

/// `array` with its list offsets starting at 0; other arrays as they are.
pub fn unsliced(array: &ArrayRef) -> ArrayRef {
    match array.data_type() {
        DataType::List(_) => unsliced_list(array.as_list::<i32>()),
        DataType::LargeList(_) => unsliced_list(array.as_list::<i64>()),
        _ => Arc::clone(array),
    }
}

/// `list` with offsets from 0 over the slice of its child values they span.
fn unsliced_list<O: OffsetSizeTrait>(list: &GenericListArray<O>) -> ArrayRef {
    let offsets = list.offsets();
    let first = offsets[0];
    if first == O::zero() {
        return Arc::new(list.clone());
    }
    let last = offsets[offsets.len() - 1];
    let values = list
        .values()
        .slice(first.as_usize(), (last - first).as_usize());
    let from_zero = OffsetBuffer::new(offsets.iter().map(|o| *o - first).collect());
    let field = match list.data_type() {
        DataType::List(field) | DataType::LargeList(field) => Arc::clone(field),
        _ => unreachable!("a list array has a list type"),
    };
    Arc::new(GenericListArray::<O>::new(
        field,
        from_zero,
        values,
        list.nulls().cloned(),
    ))
}

/// The logical optimizer rule that puts `unsliced_lists` under every cast to a fixed-size
/// list (once: a cast whose input already calls it is left).
#[derive(Debug, Default)]
pub struct UnslicedListCasts;

impl OptimizerRule for UnslicedListCasts {
    fn name(&self) -> &str {
        "unsliced_list_casts"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        plan.map_expressions(|expr| expr.transform_up(wrap_cast_input))
    }
}

/// `expr` with `unsliced_lists` around its input when it casts to a fixed-size list.
fn wrap_cast_input(expr: Expr) -> Result<Transformed<Expr>> {
    match expr {
        Expr::Cast(Cast { expr, field }) if needs_wrap(&expr, field.data_type()) => Ok(
            Transformed::yes(Expr::Cast(Cast::new_from_field(wrapped(*expr), field))),
        ),
        Expr::TryCast(TryCast { expr, field }) if needs_wrap(&expr, field.data_type()) => {
            Ok(Transformed::yes(Expr::TryCast(TryCast::new_from_field(
                wrapped(*expr),
                field,
            ))))
        }
        other => Ok(Transformed::no(other)),
    }
}

/// A cast of `input` to `to` gets the wrap: `to` is a fixed-size list and `input` does not
/// call `unsliced_lists` already.
fn needs_wrap(input: &Expr, to: &DataType) -> bool {
    let already = match input {
        Expr::ScalarFunction(f) => {
            let function: &dyn std::any::Any = f.func.inner().as_ref();
            function.is::<UnslicedLists>()
        }
        _ => false,
    };
    matches!(to, DataType::FixedSizeList(..)) && !already
}

/// `unsliced_lists(input)`.
fn wrapped(input: Expr) -> Box<Expr> {
    Box::new(Expr::ScalarFunction(ScalarFunction::new_udf(
        Arc::new(unsliced_lists_udf()),
        vec![input],
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int64Array, ListArray};
    use datafusion::arrow::compute::cast;
    use datafusion::arrow::datatypes::{Field, Int64Type};

    /// Four lists of three (`[10r, 10r + 1, 10r + 2]` for row r), rows 1 and 2 sliced out.
    fn sliced() -> ArrayRef {
        let list = ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..4).map(|row| Some((0..3).map(move |i| Some(row * 10 + i)))),
        );
        let list: ArrayRef = Arc::new(list);
        list.slice(1, 2)
    }

    fn fixed_size_list_of_three() -> DataType {
        DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Int64, true)), 3)
    }

    fn firsts(array: &ArrayRef) -> Vec<i64> {
        let fixed = array.as_fixed_size_list();
        (0..fixed.len())
            .map(|row| fixed.value(row).as_primitive::<Int64Type>().value(0))
            .collect()
    }

    #[test]
    fn a_sliced_list_casts_to_its_own_values() {
        let cast_unsliced = cast(&unsliced(&sliced()), &fixed_size_list_of_three()).unwrap();
        assert_eq!(firsts(&cast_unsliced), vec![10, 20]);
        let values = cast_unsliced.as_fixed_size_list().values().clone();
        let values = values.as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!(values.values().to_vec(), vec![10, 11, 12, 20, 21, 22]);
    }

    /// Why this module exists: once arrow's cast reads a sliced list right, this fails and
    /// the rule can go.
    #[test]
    fn arrows_own_cast_reads_a_sliced_list_from_the_start() {
        let cast_sliced = cast(&sliced(), &fixed_size_list_of_three()).unwrap();
        assert_eq!(
            firsts(&cast_sliced),
            vec![0, 10],
            "arrow-cast now casts a sliced list right: flumen's unsliced_list_casts can go"
        );
    }

    #[test]
    fn the_rule_wraps_each_cast_to_a_fixed_size_list_once() {
        let column = datafusion::prelude::col("v");
        let to = fixed_size_list_of_three();
        let once =
            wrap_cast_input(Expr::Cast(Cast::new(Box::new(column.clone()), to.clone()))).unwrap();
        assert!(once.transformed);
        let again = wrap_cast_input(once.data.clone()).unwrap();
        assert!(!again.transformed, "wrapped twice: {}", again.data);
        let other = Expr::Cast(Cast::new(Box::new(column), DataType::Utf8));
        assert!(!wrap_cast_input(other).unwrap().transformed);
    }
}
