//! A read of an aggregate's complete bounds, carried through a task plan whole.
//!
//! [`CompleteBounds`] ([`crate::plan::aggregate_bound_reads`]) is flumen's own expression,
//! which datafusion-proto does not know. It is sent as a flumen expression
//! ([`COMPLETE_BOUNDS`]) holding each aggregate's comparison, with the bounds and the
//! aggregates' columns as its inputs (a live filter among them decodes as the one the
//! worker's aggregate fills).

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::Operator;
use datafusion::physical_plan::PhysicalExpr;
use prost::Message;

use crate::plan::aggregate_bound_reads::CompleteBounds;

/// What a flumen expression in a task plan is: a read of complete bounds.
pub const COMPLETE_BOUNDS: &str = "flumen.complete_bounds";

/// A [`COMPLETE_BOUNDS`] expression: each aggregate's comparison, `true` for a `min`'s `<`
/// and `false` for a `max`'s `>`.
#[derive(Clone, PartialEq, prost::Message)]
struct CompleteBoundsNode {
    /// Always [`COMPLETE_BOUNDS`].
    #[prost(string, tag = "1")]
    kind: String,
    #[prost(bool, repeated, tag = "2")]
    less_than: Vec<bool>,
}

/// The bytes of `expr` as a [`COMPLETE_BOUNDS`] expression when it is one, else `None`.
/// Its inputs are its children.
pub(super) fn encode(expr: &Arc<dyn PhysicalExpr>) -> Option<Vec<u8>> {
    let read = expr.downcast_ref::<CompleteBounds>()?;
    let node = CompleteBoundsNode {
        kind: COMPLETE_BOUNDS.into(),
        less_than: (read.terms_of().iter())
            .map(|op| *op == Operator::Lt)
            .collect(),
    };
    Some(node.encode_to_vec())
}

/// The read a [`COMPLETE_BOUNDS`] expression holds, over `inputs` (the bounds, then the
/// aggregates' columns), or `None` when `bytes` are not one.
pub(super) fn decode(
    bytes: &[u8],
    inputs: &[Arc<dyn PhysicalExpr>],
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let Some(node) = CompleteBoundsNode::decode(bytes)
        .ok()
        .filter(|n| n.kind == COMPLETE_BOUNDS)
    else {
        return Ok(None);
    };
    let Some((bounds, columns)) = inputs.split_first() else {
        return Err(DataFusionError::Execution(
            "complete bounds with no inputs".into(),
        ));
    };
    let terms_of = (node.less_than.iter())
        .map(|&lt| if lt { Operator::Lt } else { Operator::Gt })
        .collect();
    let read = CompleteBounds::new(Arc::clone(bounds), columns.to_vec(), terms_of)?;
    Ok(Some(Arc::new(read)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_expr::expressions::{Column, lit};

    #[test]
    fn complete_bounds_come_back_with_their_comparisons() {
        let columns: Vec<Arc<dyn PhysicalExpr>> =
            vec![Arc::new(Column::new("x", 0)), Arc::new(Column::new("y", 1))];
        let read: Arc<dyn PhysicalExpr> = Arc::new(
            CompleteBounds::new(lit(true), columns.clone(), vec![Operator::Gt, Operator::Lt])
                .unwrap(),
        );
        let bytes = encode(&read).expect("complete bounds");
        let inputs: Vec<_> = read.children().into_iter().cloned().collect();
        let back = decode(&bytes, &inputs).unwrap().unwrap();
        assert_eq!(&back, &read);
        assert!(decode(b"not one", &inputs).unwrap().is_none());
    }
}
