//! DataFusion's per-partition TopK (`PartitionedTopKExec`: under a `ROW_NUMBER()` or
//! `RANK()` filter `rn <= K` when `datafusion.optimizer.enable_window_topn` is on) has no
//! datafusion-proto 55 encoding. In a task plan it travels as a flumen extension node
//! ([`PARTITIONED_TOPK`]): its ordering (partition keys first), how many of those keys
//! partition, its fetch and its window function; its input is the extension node's input.

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::sorts::partitioned_topk::{PartitionedTopKExec, WindowFnKind};
use datafusion_proto::physical_plan::from_proto::parse_physical_sort_exprs;
use datafusion_proto::physical_plan::to_proto::serialize_physical_sort_exprs;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;

/// The kind of a task plan's extension node that holds a `PartitionedTopKExec`.
pub(super) const PARTITIONED_TOPK: &str = "flumen.partitioned_topk";

/// A `PartitionedTopKExec` without its input.
#[derive(Clone, PartialEq, prost::Message)]
struct PartitionedTopKNode {
    /// [`PARTITIONED_TOPK`].
    #[prost(string, tag = "1")]
    kind: String,
    /// The ordering: the partition keys, then the window's `ORDER BY`.
    #[prost(message, repeated, tag = "2")]
    order: Vec<protobuf::PhysicalSortExprNode>,
    /// How many leading expressions of `order` are partition keys.
    #[prost(uint64, tag = "3")]
    partition_prefix_len: u64,
    /// Rows kept per partition (the `K` of `rn <= K`).
    #[prost(uint64, tag = "4")]
    fetch: u64,
    /// `RANK()` (ties at the boundary kept); otherwise `ROW_NUMBER()`.
    #[prost(bool, tag = "5")]
    rank: bool,
}

/// The encoding of `node` when it is a `PartitionedTopKExec`; `None` for any other node.
pub(super) fn encode(
    node: &Arc<dyn ExecutionPlan>,
    codec: &dyn PhysicalExtensionCodec,
    converter: &dyn PhysicalProtoConverterExtension,
) -> Result<Option<Vec<u8>>> {
    let Some(topk) = node.downcast_ref::<PartitionedTopKExec>() else {
        return Ok(None);
    };
    let order = serialize_physical_sort_exprs(topk.expr().iter().cloned(), codec, converter)?;
    let rank = match topk.fn_kind() {
        WindowFnKind::Rank => true,
        WindowFnKind::RowNumber => false,
    };
    let node = PartitionedTopKNode {
        kind: PARTITIONED_TOPK.into(),
        order,
        partition_prefix_len: topk.partition_prefix_len() as u64,
        fetch: topk.fetch() as u64,
        rank,
    };
    Ok(Some(node.encode_to_vec()))
}

/// The `PartitionedTopKExec` over `inputs` that `bytes` holds; `None` when `bytes` is
/// another kind of node.
pub(super) fn decode(
    bytes: &[u8],
    inputs: &[Arc<dyn ExecutionPlan>],
    ctx: &PhysicalPlanDecodeContext<'_>,
    converter: &dyn PhysicalProtoConverterExtension,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(node) = PartitionedTopKNode::decode(bytes)
        .ok()
        .filter(|n| n.kind == PARTITIONED_TOPK)
    else {
        return Ok(None);
    };
    let [input] = inputs else {
        return Err(DataFusionError::Execution(format!(
            "a per-partition TopK with {} inputs",
            inputs.len()
        )));
    };
    let order = parse_physical_sort_exprs(&node.order, ctx, &input.schema(), converter)?;
    let order = LexOrdering::new(order).ok_or_else(|| {
        DataFusionError::Execution("a per-partition TopK with no ordering".into())
    })?;
    let fn_kind = if node.rank {
        WindowFnKind::Rank
    } else {
        WindowFnKind::RowNumber
    };
    let topk = PartitionedTopKExec::try_new(
        Arc::clone(input),
        order,
        node.partition_prefix_len as usize,
        node.fetch as usize,
        fn_kind,
    )?;
    Ok(Some(Arc::new(topk)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::task_plan::{WorkerFunctions, check_round_trip, decode, encode};
    use crate::plan::test_plans::{node_named, physical_plan};
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::physical_plan::collect;
    use datafusion::prelude::*;

    /// A `ROW_NUMBER()` and a `RANK()` per-partition TopK come back from a task plan as
    /// they were planned (the round-trip check compares their text) and keep the rows the
    /// driver's keeps, ties at `RANK()`'s boundary included.
    #[tokio::test]
    async fn a_per_partition_topk_comes_back_from_a_task_plan_and_keeps_the_same_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let config = SessionConfig::new()
            .with_target_partitions(2)
            .set_bool("datafusion.optimizer.enable_window_topn", true);
        let ctx = SessionContext::new_with_config(config);
        let rows = "SELECT value % 3 AS k, value % 5 AS v, value AS id FROM range(30)";
        let copy = format!("COPY ({rows}) TO '{}' STORED AS PARQUET", path.display());
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        let ddl = format!(
            "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}'",
            path.display()
        );
        ctx.sql(&ddl).await.unwrap();
        for (function, kind) in [
            ("ROW_NUMBER", WindowFnKind::RowNumber),
            ("RANK", WindowFnKind::Rank),
        ] {
            let sql = format!(
                "SELECT * FROM (SELECT k, v, id, {function}() OVER (PARTITION BY k \
                 ORDER BY v DESC) AS r FROM t) WHERE r <= 2"
            );
            let plan = physical_plan(&ctx, &sql).await;
            let topk = node_named(&plan, "PartitionedTopKExec").expect("a per-partition TopK");
            let planned = topk.downcast_ref::<PartitionedTopKExec>().unwrap();
            assert_eq!((planned.fn_kind(), planned.fetch()), (kind, 2), "{sql}");

            let bytes = encode(&topk, Arc::new(WorkerFunctions::default())).unwrap();
            let task_ctx = ctx.task_ctx();
            check_round_trip(&topk, &bytes, &task_ctx).unwrap_or_else(|e| panic!("{e:?}"));
            let decoded = decode(&bytes, &task_ctx).unwrap();
            let back = decoded.downcast_ref::<PartitionedTopKExec>().unwrap();
            assert_eq!(back.fn_kind(), kind);
            assert_eq!(back.expr(), planned.expr());
            assert_eq!(back.partition_prefix_len(), planned.partition_prefix_len());
            let rows = |plan: Arc<dyn ExecutionPlan>| {
                let task_ctx = ctx.task_ctx();
                async move {
                    let mut batches = vec![];
                    for p in 0..plan.properties().output_partitioning().partition_count() {
                        let one = plan.execute(p, Arc::clone(&task_ctx)).unwrap();
                        batches.extend(
                            datafusion::physical_plan::common::collect(one)
                                .await
                                .unwrap(),
                        );
                    }
                    let text = pretty_format_batches(&batches).unwrap().to_string();
                    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
                    lines.sort();
                    lines
                }
            };
            assert_eq!(rows(topk).await, rows(decoded).await, "{sql}");
            let answer = collect(plan, ctx.task_ctx()).await.unwrap();
            let kept: usize = answer.iter().map(|b| b.num_rows()).sum();
            // Per k, two rows of the top v (v = 4: two of the 30 ids each), RANK's ties
            // included: every k keeps exactly 2.
            assert_eq!(kept, 6, "{sql}");
        }
    }
}
