//! The bounds a worker's task made, carried back to the driver as they tighten
//! ([`BoundWatch`]) and with the task's end: the values of its aggregates' and TopK sorts'
//! dynamic filters, which the tasks launched after it start from
//! ([`crate::plan::task_bounds`]).
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
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
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
use crate::plan::task_bounds::{MadeBound, TaskFilter};

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
    (producers(plan).iter())
        .filter_map(|(node, filter)| filled(*node, filter))
        .collect()
}

/// The filters `plan`'s aggregates and TopK sorts fill, by their producer's number in a walk
/// from the root, parents first.
fn producers(plan: &Arc<dyn ExecutionPlan>) -> Vec<(usize, Arc<dyn PhysicalExpr>)> {
    let mut found = vec![];
    let mut node_number = 0;
    let _ = plan.apply(|node| {
        let number = node_number;
        node_number += 1;
        if node.downcast_ref::<AggregateExec>().is_none()
            && node.downcast_ref::<SortExec>().is_none()
        {
            return Ok(TreeNodeRecursion::Continue);
        }
        if let [filter] = node.dynamic_expressions_produced().as_slice() {
            found.push((number, Arc::clone(filter)));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// `filter`'s value as a bound to send, `None` while it was never filled (generation 1).
fn filled(node: usize, filter: &Arc<dyn PhysicalExpr>) -> Option<SentBound> {
    if filter.snapshot_generation() <= 1 {
        return None;
    }
    let value = filter.snapshot().ok()??;
    let value = serialize_physical_expr(&value, &DefaultPhysicalExtensionCodec {}).ok()?;
    Some(SentBound {
        node,
        value: value.encode_to_vec(),
    })
}

/// A running task's filters, watched for bounds tighter than those already sent: the
/// driver counts them in the tasks it launches while this one runs, as it counts a running
/// local task's ([`crate::plan::task_bounds::BoundsMade::running`]). Without them a worker's
/// bounds reached the driver only at its task's end.
pub struct BoundWatch {
    /// Each producer's number, its filter, and the filter's generation last sent.
    producers: Vec<(usize, Arc<dyn PhysicalExpr>, u64)>,
}

impl BoundWatch {
    /// Watch the filters `plan`'s aggregates and TopK sorts fill.
    pub fn new(plan: &Arc<dyn ExecutionPlan>) -> Self {
        let producers = (producers(plan).into_iter())
            .map(|(node, filter)| (node, filter, 1))
            .collect();
        Self { producers }
    }

    /// Whether there is nothing to watch.
    pub fn is_empty(&self) -> bool {
        self.producers.is_empty()
    }

    /// The bounds that tightened since the last call (the first: since they were made).
    pub fn tightened(&mut self) -> Vec<SentBound> {
        let mut sent = vec![];
        for (node, filter, generation) in &mut self.producers {
            let now = filter.snapshot_generation();
            if now > *generation {
                *generation = now;
                sent.extend(filled(*node, filter));
            }
        }
        sent
    }
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

/// On the driver, a worker's running task's own filters as last heard from it
/// ([`BoundWatch`] sends them): one filter per own filter of the task, on its producer's
/// columns, which [`crate::plan::task_bounds::BoundsMade::running`] counts in the tasks
/// launched while it runs, as it does a local task's own filters.
pub struct HeardBounds {
    own: Vec<OwnFilter>,
    /// `(the operator's filter it stands for, the bound last heard)`, one per `own`.
    heard: Vec<(u64, Arc<DynamicFilterPhysicalExpr>)>,
}

impl HeardBounds {
    /// Nothing heard yet of a task whose own filters are `own`.
    pub fn new(own: &[OwnFilter]) -> Self {
        let heard = (own.iter())
            .map(|own| {
                let columns = own.filter.children().into_iter().cloned().collect();
                let filter = DynamicFilterPhysicalExpr::new(columns, lit(true));
                (own.replaces, Arc::new(filter))
            })
            .collect();
        Self {
            own: own.to_vec(),
            heard,
        }
    }

    /// `(the operator's filter, the bound last heard)` of each own filter, for
    /// [`crate::plan::task_bounds::BoundsMade::running`].
    pub fn filters(&self) -> Vec<TaskFilter> {
        (self.heard.iter())
            .map(|(id, filter)| (*id, Arc::clone(filter) as Arc<dyn PhysicalExpr>))
            .collect()
    }

    /// Take in the bounds the worker sent as they tightened.
    pub fn hear(&self, sent: &[SentBound], ctx: &TaskContext) -> Result<()> {
        for made in received(sent, &self.own, ctx)? {
            if let Some((_, filter)) = self.heard.iter().find(|(id, _)| *id == made.filter) {
                filter.update(made.value)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::compute::SortOptions;
    use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::common::tree_node::Transformed;
    use datafusion::execution::SendableRecordBatchStream;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::repartition::RepartitionExec;
    use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
    use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
    use datafusion::prelude::SessionContext;
    use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender};

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

    /// A partition whose batches come from a channel, so that a test holds its input
    /// midway.
    #[derive(Debug)]
    struct Fed {
        schema: SchemaRef,
        batches: std::sync::Mutex<Option<UnboundedReceiver<Result<RecordBatch>>>>,
    }

    impl PartitionStream for Fed {
        fn schema(&self) -> &SchemaRef {
            &self.schema
        }

        fn execute(&self, _: Arc<TaskContext>) -> SendableRecordBatchStream {
            let batches = self.batches.lock().unwrap().take().expect("executed once");
            Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.schema),
                batches,
            ))
        }
    }

    /// A one-partition scan of `schema` that puts out the batches sent to the sender it
    /// comes with, and ends when that is dropped.
    pub(crate) fn fed_input(
        schema: &SchemaRef,
    ) -> (UnboundedSender<Result<RecordBatch>>, Arc<dyn ExecutionPlan>) {
        let (feed, batches) = futures::channel::mpsc::unbounded();
        let fed = Fed {
            schema: Arc::clone(schema),
            batches: std::sync::Mutex::new(Some(batches)),
        };
        let input = StreamingTableExec::try_new(
            Arc::clone(schema),
            vec![Arc::new(fed)],
            None,
            vec![],
            false,
            None,
        )
        .unwrap();
        (feed, Arc::new(input))
    }

    #[tokio::test]
    async fn a_running_topks_bound_is_sent_as_it_tightens_and_heard_on_the_driver() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let (feed, input) = fed_input(&schema);
        let descending = SortOptions {
            descending: true,
            nulls_first: false,
        };
        let order = LexOrdering::new([PhysicalSortExpr::new(
            col("a", &schema).unwrap(),
            descending,
        )])
        .unwrap();
        // `ORDER BY a DESC LIMIT 2`, as a worker's task has it.
        let topk: Arc<dyn ExecutionPlan> =
            Arc::new(SortExec::new(order, input).with_fetch(Some(2)));
        let one = for_worker_task(&topk, &Default::default()).unwrap();
        assert_eq!(one.made.len(), 1);
        let batch = |values: Vec<i64>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(Int64Array::from(values))],
            )
            .unwrap()
        };
        let ctx = SessionContext::new();
        let mut watch = BoundWatch::new(&one.plan);
        assert!(!watch.is_empty());
        assert!(watch.tightened().is_empty(), "nothing ran: nothing to send");
        let stream = one.plan.execute(0, ctx.task_ctx()).unwrap();
        let run = tokio::spawn(datafusion::physical_plan::common::collect(stream));
        // The bound its rows so far make, sent while its input is held open.
        async fn next_bound(watch: &mut BoundWatch) -> Vec<SentBound> {
            let start = std::time::Instant::now();
            loop {
                let sent = watch.tightened();
                if !sent.is_empty() {
                    return sent;
                }
                assert!(start.elapsed().as_secs() < 30, "no bound was sent");
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
        let heard = HeardBounds::new(&one.made);
        let filters = heard.filters();
        assert_eq!(filters[0].0, one.made[0].replaces);
        let heard_now = || filters[0].1.snapshot().unwrap().unwrap().to_string();
        // The driver counts what it heard in the tasks it launches while this one runs.
        let made = crate::plan::task_bounds::BoundsMade::default();
        let running = made.running(heard.filters());
        let at_launch = || {
            let launch = made.at_launch();
            let bound = launch.get(&one.made[0].replaces).cloned();
            bound.map(|b| b.snapshot().unwrap().unwrap().to_string())
        };
        assert_eq!(at_launch(), None, "nothing heard yet");
        feed.unbounded_send(Ok(batch(vec![1, 5, 3]))).unwrap();
        heard
            .hear(&next_bound(&mut watch).await, &ctx.task_ctx())
            .unwrap();
        assert_eq!(heard_now(), "a@0 > 3");
        assert_eq!(at_launch().as_deref(), Some("a@0 > 3"));
        assert!(
            watch.tightened().is_empty(),
            "an unchanged bound is sent once"
        );
        feed.unbounded_send(Ok(batch(vec![9, 2]))).unwrap();
        let sent = next_bound(&mut watch).await;
        heard.hear(&sent, &ctx.task_ctx()).unwrap();
        assert_eq!(heard_now(), "a@0 > 5");
        assert_eq!(at_launch().as_deref(), Some("a@0 > 5"));
        // Ended, its last bound stays.
        drop(running);
        assert_eq!(at_launch().as_deref(), Some("a@0 > 5"));
        drop(feed);
        let rows: usize = (run.await.unwrap().unwrap().iter())
            .map(|b| b.num_rows())
            .sum();
        assert_eq!(rows, 2);
        // Its end carries the same bound.
        assert_eq!(made_in(&one.plan), sent);
    }
}
