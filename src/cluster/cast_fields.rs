//! A cast to a field of its own, carried through a task plan whole.
//!
//! DataFusion's union makes each input's columns the union's fields with a cast to that
//! field (`CAST(k@0 AS Int64)`, of the same type, only to make `k` nullable where another
//! input's `k` is). datafusion-proto 55 writes only a cast's type, and decodes one whose
//! nullability is its input's, so a worker's copy of such a plan had another output schema
//! and the driver ran the task itself (`undecodable`). A cast given its own field is sent
//! as a flumen expression ([`CAST_TO_FIELD`]) holding the field, and its one input as the
//! expression's input.

use std::sync::Arc;

use datafusion::arrow::compute::CastOptions;
use datafusion::arrow::datatypes::Field;
use datafusion::common::format::DEFAULT_FORMAT_OPTIONS;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::expressions::CastExpr;
use datafusion::physical_plan::PhysicalExpr;
use datafusion_proto::protobuf;
use prost::Message;

/// What a flumen expression in a task plan is: a cast to a field of its own.
pub const CAST_TO_FIELD: &str = "flumen.cast_to_field";

/// A [`CAST_TO_FIELD`] expression: the field a cast makes (name, type, nullability,
/// metadata) and whether a value that does not cast becomes null.
#[derive(Clone, PartialEq, prost::Message)]
struct CastToFieldNode {
    /// Always [`CAST_TO_FIELD`].
    #[prost(string, tag = "1")]
    kind: String,
    #[prost(message, optional, tag = "2")]
    field: Option<protobuf::Field>,
    /// The cast's `safe` option (a value that does not cast is null, not an error).
    #[prost(bool, tag = "3")]
    safe: bool,
}

/// The bytes of `expr` as a [`CAST_TO_FIELD`] expression when it is a cast that was given
/// a field of its own (which datafusion-proto would drop), else `None`. Only a cast with
/// DataFusion's own value formatting (how a cast to text writes durations, dates) is
/// carried: the field and `safe` are all that travel, and the worker's cast formats as
/// DataFusion's default does.
pub(super) fn encode(expr: &Arc<dyn PhysicalExpr>) -> Result<Option<Vec<u8>>> {
    let Some(cast) = expr.downcast_ref::<CastExpr>() else {
        return Ok(None);
    };
    if (cast.target_nullable().is_none() && cast.target_metadata().is_none())
        || cast.cast_options().format_options != DEFAULT_FORMAT_OPTIONS
    {
        return Ok(None);
    }
    let field = protobuf::Field::try_from(cast.target_field().as_ref())
        .map_err(|e| DataFusionError::Internal(format!("a cast's field: {e}")))?;
    let node = CastToFieldNode {
        kind: CAST_TO_FIELD.into(),
        field: Some(field),
        safe: cast.cast_options().safe,
    };
    Ok(Some(node.encode_to_vec()))
}

/// The cast a [`CAST_TO_FIELD`] expression holds, over `inputs` (its one input), or `None`
/// when `bytes` are not one.
pub(super) fn decode(
    bytes: &[u8],
    inputs: &[Arc<dyn PhysicalExpr>],
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let Some(node) = CastToFieldNode::decode(bytes)
        .ok()
        .filter(|n| n.kind == CAST_TO_FIELD)
    else {
        return Ok(None);
    };
    let field = node
        .field
        .as_ref()
        .ok_or_else(|| DataFusionError::Execution("a cast with no field".into()))
        .and_then(|f| {
            Field::try_from(f)
                .map_err(|e| DataFusionError::Execution(format!("a cast's field: {e}")))
        })?;
    let [input] = inputs else {
        return Err(DataFusionError::Execution(format!(
            "a cast with {} inputs",
            inputs.len()
        )));
    };
    let options = CastOptions {
        safe: node.safe,
        format_options: DEFAULT_FORMAT_OPTIONS,
    };
    Ok(Some(Arc::new(CastExpr::new_with_target_field(
        Arc::clone(input),
        Arc::new(field),
        Some(options),
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::DataType;
    use datafusion::physical_expr::expressions::Column;

    #[test]
    fn a_cast_to_a_nullable_field_comes_back_with_it() {
        let field = Arc::new(Field::new("k", DataType::Int64, true));
        let cast: Arc<dyn PhysicalExpr> = Arc::new(CastExpr::new_with_target_field(
            Arc::new(Column::new("k", 0)),
            Arc::clone(&field),
            None,
        ));
        let bytes = encode(&cast)
            .unwrap()
            .expect("a cast with a field of its own");
        let input: Arc<dyn PhysicalExpr> = Arc::new(Column::new("k", 0));
        let back = decode(&bytes, &[input]).unwrap().unwrap();
        let back = back.downcast_ref::<CastExpr>().unwrap();
        assert_eq!(back.target_field(), &field);
        assert_eq!(back.target_nullable(), Some(true));
        assert_eq!(
            back.cast_options(),
            cast.downcast_ref::<CastExpr>().unwrap().cast_options()
        );
        // A plain cast is left to datafusion-proto.
        let plain: Arc<dyn PhysicalExpr> = Arc::new(CastExpr::new(
            Arc::new(Column::new("k", 0)),
            DataType::Utf8,
            None,
        ));
        assert!(encode(&plain).unwrap().is_none());
    }
}
