//! The bounds a worker's task made, carried back to the driver with the task's end: the
//! values of its aggregates' and TopK sorts' dynamic filters, which the tasks launched after
//! it start from ([`crate::plan::task_bounds`]).
//!
//! A worker decodes an aggregate or a TopK with a filter of its own, so it names each
//! bound by its producer's place in the plan (the node's number in a walk from the root,
//! parents first), which the driver's plan of the task shares
//! ([`crate::plan::dynamic_filters::OwnFilter::node`]). A value is an expression over its
//! producer's input columns, encoded by datafusion-proto.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};
use datafusion_proto::physical_plan::DefaultPhysicalExtensionCodec;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::plan::dynamic_filters::OwnFilter;
use crate::plan::task_bounds::MadeBound;

/// A bound a worker's task made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentBound {
    /// Its producer's number in a walk of the task's plan from the root, parents first.
    pub node: usize,
    /// Its value, a datafusion-proto `PhysicalExprNode`.
    pub value: Vec<u8>,
}

/// The bounds `plan` (a task's, run) made: every aggregate's and TopK's filter that was
/// filled.
pub fn made_in(plan: &Arc<dyn ExecutionPlan>) -> Vec<SentBound> {
    let mut sent = vec![];
    let mut node_number = 0;
    let _ = plan.apply(|node| {
        let number = node_number;
        node_number += 1;
        if node.downcast_ref::<AggregateExec>().is_none()
            && node.downcast_ref::<SortExec>().is_none()
        {
            return Ok(TreeNodeRecursion::Continue);
        }
        let produced = node.dynamic_expressions_produced();
        let [filter] = produced.as_slice() else {
            return Ok(TreeNodeRecursion::Continue);
        };
        // Generation 1: never filled.
        if filter.snapshot_generation() > 1
            && let Ok(Some(value)) = filter.snapshot()
            && let Ok(value) = serialize_physical_expr(&value, &DefaultPhysicalExtensionCodec {})
        {
            sent.push(SentBound {
                node: number,
                value: value.encode_to_vec(),
            });
        }
        Ok(TreeNodeRecursion::Continue)
    });
    sent
}

/// The bounds a worker sent for a task whose own filters are `own`, as the driver keeps
/// them: each named by the operator's filter it is a bound of. A bound of a filter the
/// task did not make its own (one below a join) is left out.
pub fn received(
    sent: &[SentBound],
    own: &[OwnFilter],
    ctx: &TaskContext,
) -> Result<Vec<MadeBound>> {
    let mut made = vec![];
    for bound in sent {
        let Some(own) = own.iter().find(|own| own.node == Some(bound.node)) else {
            continue;
        };
        let node = PhysicalExprNode::decode(bound.value.as_slice()).map_err(|e| {
            DataFusionError::Execution(format!("a bound that does not decode: {e}"))
        })?;
        let value: Arc<dyn PhysicalExpr> =
            parse_physical_expr(&node, ctx, &own.input, &DefaultPhysicalExtensionCodec {})?;
        made.push(MadeBound {
            filter: own.replaces,
            columns: own.filter.children().into_iter().cloned().collect(),
            value,
        });
    }
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::common::tree_node::Transformed;
    use datafusion::physical_plan::repartition::RepartitionExec;
    use datafusion::prelude::SessionContext;

    use crate::plan::dynamic_filters::for_worker_task;
    use crate::plan::dynamic_filters::tests::plan_in_partitions;

    #[tokio::test]
    async fn a_workers_bound_comes_back_as_a_bound_of_the_operators_filter() {
        // `t(a)`, one Parquet file of 0..100.
        let sql = "SELECT min(a) FROM t WHERE a % 2 = 0";
        let (_dir, plan) = plan_in_partitions(sql, 2).await;
        let ctx = SessionContext::new();
        // The partial aggregate straight over its scan, as a worker's task plan has it.
        let plan = (plan.transform_up(|node| {
            Ok(match node.downcast_ref::<RepartitionExec>() {
                Some(repartition) => Transformed::yes(Arc::clone(repartition.input())),
                None => Transformed::no(node),
            })
        }))
        .unwrap()
        .data;
        let one = for_worker_task(&plan, &Default::default()).unwrap();
        assert_eq!(one.made.len(), 1);
        // Nothing ran: nothing to send.
        assert!(made_in(&one.plan).is_empty());
        datafusion::physical_plan::collect(Arc::clone(&one.plan), ctx.task_ctx())
            .await
            .unwrap();
        let sent = made_in(&one.plan);
        assert_eq!(sent.len(), 1);
        assert_eq!(Some(sent[0].node), one.made[0].node);
        let made = received(&sent, &one.made, &ctx.task_ctx()).unwrap();
        assert_eq!(made.len(), 1);
        assert_eq!(made[0].filter, one.made[0].replaces);
        assert_eq!(made[0].value.to_string(), "a@0 < 0");
        // A bound of a node the driver did not renew is left out.
        let elsewhere = SentBound {
            node: sent[0].node + 1,
            value: sent[0].value.clone(),
        };
        assert!(
            received(&[elsewhere], &one.made, &ctx.task_ctx())
                .unwrap()
                .is_empty()
        );
    }
}
