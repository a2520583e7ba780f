//! `to_timestamp` and its `_seconds`, `_millis`, `_micros`, `_nanos` forms, whose column
//! results carry the session's time zone.
//!
//! With `datafusion.execution.time_zone` set, DataFusion 55's functions declare
//! `Timestamp(unit, tz)` and parse strings in that zone, but build an array of a string
//! column as `Timestamp(unit)`: every query that reads the column fails at run time with
//! "returned value of type 'Timestamp(ns)' while ... 'Timestamp(ns, \"+05:00\")' was
//! promised" (apache/datafusion#24632, fixed upstream after 55). [`with_time_zone`] wraps
//! each function so that an array result without a zone gets the declared one; the values
//! are already right, only the array's type is.

use std::sync::Arc;

use datafusion::arrow::array::{Array, make_array};
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::{ExprSchema, Result, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::udf_eq::UdfEq;
use datafusion::logical_expr::{
    ColumnarValue, Documentation, Expr, ExpressionPlacement, ReturnFieldArgs, ScalarFunctionArgs,
    ScalarUDF, ScalarUDFImpl, Signature, StructFieldMapping,
};

/// The functions [`with_time_zone`] wraps.
pub const TIMESTAMP_FUNCTIONS: &[&str] = &[
    "to_timestamp",
    "to_timestamp_seconds",
    "to_timestamp_millis",
    "to_timestamp_micros",
    "to_timestamp_nanos",
];

/// A timestamp function whose array results carry the time zone its return type declares.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct TimeZoneAnnotated {
    inner: UdfEq<Arc<dyn ScalarUDFImpl>>,
}

/// `udf` wrapped so that its array results carry its declared time zone (itself when it is
/// already wrapped).
pub fn with_time_zone(udf: &ScalarUDF) -> ScalarUDF {
    if udf.inner().downcast_ref::<TimeZoneAnnotated>().is_some() {
        return udf.clone();
    }
    ScalarUDF::new_from_impl(TimeZoneAnnotated {
        inner: Arc::clone(udf.inner()).into(),
    })
}

/// `value` with the time zone of `declared` where it is an array of the same timestamp
/// unit without one: its type changes, not its values (which already count from the UTC
/// epoch; Arrow's cast would read them as wall-clock times in that zone and shift them).
fn annotated(value: ColumnarValue, declared: &DataType) -> Result<ColumnarValue> {
    let ColumnarValue::Array(array) = value else {
        return Ok(value);
    };
    match (array.data_type(), declared) {
        (DataType::Timestamp(unit, None), DataType::Timestamp(declared_unit, Some(_)))
            if unit == declared_unit =>
        {
            let data = array.to_data().into_builder().data_type(declared.clone());
            Ok(ColumnarValue::Array(make_array(data.build()?)))
        }
        _ => Ok(ColumnarValue::Array(array)),
    }
}

// Every method but the two changed ones delegates: a method left to its default would drop
// what the wrapped function does there (as DataFusion's own alias wrapper does).
#[warn(clippy::missing_trait_methods)]
impl ScalarUDFImpl for TimeZoneAnnotated {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn display_name(&self, args: &[Expr]) -> Result<String> {
        #[expect(deprecated)]
        self.inner.display_name(args)
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        self.inner.schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn is_nullable(&self, args: &[Expr], schema: &dyn ExprSchema) -> bool {
        #[expect(deprecated)]
        self.inner.is_nullable(args, schema)
    }

    fn is_strict(&self) -> bool {
        self.inner.is_strict()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let declared = args.return_field.data_type().clone();
        annotated(self.inner.invoke_with_args(args)?, &declared)
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        let updated = self.inner.with_updated_config(config)?;
        Some(with_time_zone(&updated))
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        self.inner.simplify(args, info)
    }

    fn preimage(
        &self,
        args: &[Expr],
        lit_expr: &Expr,
        info: &SimplifyContext,
    ) -> Result<PreimageResult> {
        self.inner.preimage(args, lit_expr, info)
    }

    fn short_circuits(&self) -> bool {
        self.inner.short_circuits()
    }

    fn conditional_arguments<'a>(
        &self,
        args: &'a [Expr],
    ) -> Option<(Vec<&'a Expr>, Vec<&'a Expr>)> {
        self.inner.conditional_arguments(args)
    }

    fn evaluate_bounds(&self, input: &[&Interval]) -> Result<Interval> {
        self.inner.evaluate_bounds(input)
    }

    fn propagate_constraints(
        &self,
        interval: &Interval,
        inputs: &[&Interval],
    ) -> Result<Option<Vec<Interval>>> {
        self.inner.propagate_constraints(interval, inputs)
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(inputs)
    }

    fn preserves_lex_ordering(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.preserves_lex_ordering(inputs)
    }

    fn strictly_order_preserving(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.strictly_order_preserving(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn struct_field_mapping(
        &self,
        literal_args: &[Option<ScalarValue>],
    ) -> Option<StructFieldMapping> {
        self.inner.struct_field_mapping(literal_args)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner.placement(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::TimestampNanosecondArray;
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::prelude::SessionContext;

    /// The five functions over a string column, under a session time zone, as a flumen
    /// session answers them (DataFusion 55's own session fails each with an internal error).
    #[tokio::test]
    async fn string_columns_parse_into_the_session_time_zone() {
        let ctx = crate::session(crate::FlumenConfig::default());
        ctx.sql("SET datafusion.execution.time_zone = '+05:00'")
            .await
            .unwrap();
        let sql = "SELECT to_timestamp(s) a, to_timestamp_seconds(s) b, \
                   to_timestamp_millis(s) c, to_timestamp_micros(s) d, to_timestamp_nanos(s) e, \
                   to_timestamp(s, '%Y-%m-%dT%H:%M:%S') f \
                   FROM (VALUES ('2024-01-01T10:00:00')) v(s)";
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let text = pretty_format_batches(&batches).unwrap().to_string();
        // A naive string is a wall-clock time in the session's zone, as in a constant's
        // (folded at planning, where upstream keeps the zone).
        assert_eq!(
            text.matches("2024-01-01T10:00:00+05:00").count(),
            6,
            "{text}"
        );
        let folded = ctx
            .sql("SELECT to_timestamp('2024-01-01T10:00:00') a")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let folded = pretty_format_batches(&folded).unwrap().to_string();
        assert!(folded.contains("2024-01-01T10:00:00+05:00"), "{folded}");
        let schema = batches[0].schema();
        for field in schema.fields() {
            assert!(
                matches!(field.data_type(), DataType::Timestamp(_, Some(tz)) if &**tz == "+05:00"),
                "{field:?}"
            );
        }
        // The same query in DataFusion 55's own session still fails: when it does not, the
        // upstream fix has landed and this module can go.
        let vanilla = SessionContext::new();
        vanilla
            .sql("SET datafusion.execution.time_zone = '+05:00'")
            .await
            .unwrap();
        let upstream = vanilla.sql(sql).await.unwrap().collect().await;
        assert!(
            upstream.is_err(),
            "DataFusion answers it now: drop this module"
        );
    }

    /// Without a session time zone the functions return naive timestamps, as upstream.
    #[tokio::test]
    async fn without_a_time_zone_results_stay_naive() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let batches = ctx
            .sql("SELECT to_timestamp(s) FROM (VALUES ('2024-01-01T10:00:00')) v(s)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let column = batches[0].column(0);
        let naive = column
            .as_any()
            .downcast_ref::<TimestampNanosecondArray>()
            .unwrap();
        assert_eq!(naive.timezone(), None);
    }

    #[test]
    fn wrapping_twice_wraps_once() {
        let udf = datafusion::functions::datetime::to_timestamp(&ConfigOptions::default());
        let once = with_time_zone(&udf);
        let twice = with_time_zone(&once);
        let inner = twice.inner().downcast_ref::<TimeZoneAnnotated>().unwrap();
        assert!(inner.inner.downcast_ref::<TimeZoneAnnotated>().is_none());
    }
}
