//! `percentile_cont` with every partial state merged: DataFusion 55's own (ungrouped,
//! not `DISTINCT`) accumulator merges only the **first row** of a batch of partial states
//! (`merge_batch` reads `states[0].value(0)`), so a final aggregate that receives several
//! partial states in one batch answers over the first one's rows only. DataFusion's executor
//! happens to hand each partial's one-row state over as its own batch; flumen's workers
//! gather a task's input blocks, so `SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY id)`
//! over 100,000 ids answered 14,744.7 (the 90th percentile of the first split's 16,384
//! ids) instead of 89,999.1.
//!
//! [`PercentileCont`] is DataFusion's function in everything but its row accumulator, which
//! [`MergeEachStateRow`] wraps to hand the stock one a batch of one state row at a time.
//! flumen's sessions register it under DataFusion's names, so the driver and every worker
//! plan and run the same function.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::{Result, ScalarValue};
use datafusion::functions_aggregate::percentile_cont::PercentileCont as StockPercentileCont;
use datafusion::logical_expr::function::{
    AccumulatorArgs, AggregateFunctionSimplification, StateFieldsArgs,
};
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, GroupsAccumulator, Signature,
};

/// The `percentile_cont` aggregate flumen's sessions register: DataFusion's, with its row
/// accumulator's merge fixed ([`MergeEachStateRow`]).
#[derive(Debug, Default, PartialEq, Eq, Hash)]
pub struct PercentileCont {
    /// DataFusion's function, which does all the work.
    stock: StockPercentileCont,
}

/// flumen's `percentile_cont` (alias `quantile_cont`) as an aggregate UDF.
pub fn percentile_cont_udaf() -> Arc<AggregateUDF> {
    Arc::new(AggregateUDF::new_from_impl(PercentileCont::default()))
}

impl AggregateUDFImpl for PercentileCont {
    fn name(&self) -> &str {
        self.stock.name()
    }

    fn aliases(&self) -> &[String] {
        self.stock.aliases()
    }

    fn signature(&self) -> &Signature {
        self.stock.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.stock.return_type(arg_types)
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.stock.state_fields(args)
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(MergeEachStateRow(self.stock.accumulator(args)?)))
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.stock.groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        // DataFusion's groups accumulator merges every row.
        self.stock.create_groups_accumulator(args)
    }

    fn simplify(&self) -> Option<AggregateFunctionSimplification> {
        self.stock.simplify()
    }

    fn supports_within_group_clause(&self) -> bool {
        self.stock.supports_within_group_clause()
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.stock.documentation()
    }
}

/// An accumulator whose `merge_batch` hands the wrapped one each row of the partial states
/// as a batch of its own (null rows, states of no rows, are skipped); everything else is
/// the wrapped accumulator's.
#[derive(Debug)]
pub struct MergeEachStateRow(pub Box<dyn Accumulator>);

impl Accumulator for MergeEachStateRow {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.0.update_batch(values)
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        self.0.evaluate()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        self.0.state()
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let Some(first) = states.first() else {
            return Ok(());
        };
        for row in (0..first.len()).filter(|&row| !first.is_null(row)) {
            let state: Vec<ArrayRef> = states.iter().map(|column| column.slice(row, 1)).collect();
            self.0.merge_batch(&state)?;
        }
        Ok(())
    }

    fn retract_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.0.retract_batch(values)
    }

    fn supports_retract_batch(&self) -> bool {
        self.0.supports_retract_batch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, RecordBatch};
    use datafusion::arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::PhysicalSortExpr;
    use datafusion::physical_expr::expressions::{Literal, col};

    /// The 90th percentile of the values `parts` hold (`distinct`: of their distinct values)
    /// by `function`'s accumulators: one partial per part, their states merged as one batch.
    fn percentile_of_parts(
        function: &dyn AggregateUDFImpl,
        parts: &[&[f64]],
        distinct: bool,
    ) -> f64 {
        let schema = Schema::new(vec![Field::new("v", DataType::Float64, true)]);
        let field: FieldRef = Arc::new(schema.field(0).clone());
        let return_field: FieldRef = Arc::new(Field::new("p", DataType::Float64, true));
        let exprs = [
            col("v", &schema).unwrap(),
            Arc::new(Literal::new(ScalarValue::Float64(Some(0.9)))) as _,
        ];
        let ordering = [PhysicalSortExpr::new_default(col("v", &schema).unwrap())];
        let args = || AccumulatorArgs {
            return_field: Arc::clone(&return_field),
            schema: &schema,
            ignore_nulls: false,
            order_bys: &ordering,
            is_reversed: false,
            name: "p",
            is_distinct: distinct,
            exprs: &exprs,
            expr_fields: std::slice::from_ref(&field),
        };
        // One partial accumulator per part, their one-row states as one batch.
        let mut state_rows: Vec<ArrayRef> = vec![];
        for part in parts {
            let mut partial = function.accumulator(args()).unwrap();
            partial
                .update_batch(&[Arc::new(Float64Array::from(part.to_vec()))])
                .unwrap();
            let [state] = partial.state().unwrap().try_into().unwrap();
            state_rows.push(state.to_array().unwrap());
        }
        let refs: Vec<&dyn Array> = state_rows.iter().map(|a| a.as_ref()).collect();
        let states = datafusion::arrow::compute::concat(&refs).unwrap();
        let batch = RecordBatch::try_from_iter([("s", Arc::clone(&states))]).unwrap();
        let mut last = function.accumulator(args()).unwrap();
        last.merge_batch(batch.columns()).unwrap();
        match last.evaluate().unwrap() {
            ScalarValue::Float64(Some(value)) => value,
            other => panic!("percentile_cont gave {other:?}"),
        }
    }

    /// 1..=10 in three parts: the 90th percentile of all of them is 9.1; of the first
    /// part's (1, 2, 3) alone it is 2.8.
    const PARTS: [&[f64]; 3] = [&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0, 7.0], &[8.0, 9.0, 10.0]];

    #[test]
    fn every_partial_state_of_a_batch_is_merged() {
        let ours = percentile_of_parts(&PercentileCont::default(), &PARTS, false);
        assert!(
            (ours - 9.1).abs() < 1e-5,
            "flumen's percentile_cont gave {ours}"
        );
        let distinct = percentile_of_parts(&PercentileCont::default(), &PARTS, true);
        assert!((distinct - 9.1).abs() < 1e-5, "DISTINCT gave {distinct}");
    }

    /// The reason this module exists: when DataFusion's own accumulator merges every row of
    /// a batch of states, this test fails, and flumen can register DataFusion's function
    /// again (and drop this module).
    #[test]
    fn datafusions_own_accumulator_merges_the_first_state_only() {
        let stock = percentile_of_parts(&StockPercentileCont::default(), &PARTS, false);
        assert!(
            (stock - 2.8).abs() < 1e-5,
            "DataFusion's percentile_cont now gave {stock} over three partial states: \
             if that is 9.1, its merge is fixed and flumen::functions::percentile_cont can go"
        );
    }
}
