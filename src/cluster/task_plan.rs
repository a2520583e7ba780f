//! A task's plan on its way to a worker: encoded with datafusion-proto, plus what that
//! encoding drops or gets wrong for flumen's plans, and the driver's check that a worker
//! decodes exactly the plan that was planned ([`check_round_trip`]).
//!
//! What datafusion-proto 55 does not carry as flumen plans it, and what is done about it:
//! - **Row selections.** A split of one large row group reads some of its rows through a
//!   `ParquetAccessPlan` in its file's `PartitionedFile::extensions`
//!   ([`crate::plan::split_source`]); proto drops extensions, so each piece of a row group
//!   read all of it and a model query wrote every row twice. A scan with row selections is
//!   sent as a flumen node ([`FILE_SCAN`]) holding the plain scan's encoding and each
//!   file's selection, which the worker puts back on the files. A file with any other
//!   extension cannot be sent: its task runs on the driver.
//! - **A scan's `preserve_order`** (its files read in the order given): carried the same way.
//! - **CSV and JSON scans' compression, CSV's line terminator, JSON's array format, an
//!   Arrow scan's stream format**: carried the same way ([`super::scan_formats`]).
//! - **Dynamic filters made outside the task** (by a join's build side or a TopK that run
//!   elsewhere): proto writes a filter's current expression against its producer's columns
//!   and decodes it against the scan's, so an `InList` of the build side's keys landed on
//!   another column (TPC-H q5: Int64 values against a Utf8View column). A worker's copy is
//!   never updated anyway, so each such filter is sent as its current snapshot, written
//!   against the scan's own columns; a hash-table lookup inside it (which proto cannot carry)
//!   becomes `true`, as proto itself would write it (the filter then only drops fewer rows).
//!   Filters produced by a node inside the task stay live, and decode as one filter
//!   shared by the node that fills it and the scan that prunes with it (decoded apart, a
//!   worker's scan kept `true` and pruned nothing).
//! - **Window functions' `IGNORE NULLS` and reversed calls**: carried or refused as
//!   [`super::window_calls`] says.
//! - **A cast to a field of its own** (a union's inputs made nullable): proto keeps only its
//!   type; sent whole as [`super::cast_fields`] says.
//! - **A read of an aggregate's complete bounds** (flumen's own expression): sent whole as
//!   [`super::bound_reads`] says.
//! - **A test of probe keys against a build side's key set** (flumen's own expression):
//!   sent whole as [`super::key_sets`] says.
//! - **A scan's row-group order hints** (`reverse_row_groups`, `sort_order_for_reorder`:
//!   DataFusion's inexact sort pushdown, under a sort that still sorts above the scan): the
//!   worker gives a TopK's scan them again as it decodes the plan
//!   ([`crate::plan::task_topk::topks_read_in_their_order`]); a full sort's scan reads its
//!   row groups in file order. The check allows these differences alone; a task recomputed
//!   on the driver runs the plan as a worker decoded it.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::datasource::physical_plan::parquet::{ParquetAccessPlan, RowGroupAccess};
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::{AggregateUDF, HigherOrderUDF, ScalarUDF, WindowUDF};
use datafusion::parquet::arrow::arrow_reader::{RowSelection, RowSelector};
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{CastExpr, Column, DynamicFilterPhysicalExpr, lit};
use datafusion::physical_expr_common::physical_expr::proto_decode::PhysicalExprDecodeCtx;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::joins::HashTableLookupExpr;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr, displayable};
use datafusion::prelude::SessionContext;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr_with_converter;
use datafusion_proto::physical_plan::{
    DefaultPhysicalExtensionCodec, PhysicalExtensionCodec, PhysicalPlanDecodeContext,
    PhysicalPlanNodeExt, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;

use crate::cluster::scan_formats::{ScanFormat, describe_format};
use crate::cluster::shipped_functions::{self, ShippedFunction};
use crate::cluster::topk_nodes;
use crate::cluster::window_calls::{carry_window_calls, describe_window_calls, lossy_window};
use crate::cluster::{bound_reads, cast_fields, key_sets};
use crate::plan::dynamic_filters::map_predicates;
use crate::plan::sample_keys;
use crate::plan::subquery_values::SubqueryValuesExec;
use crate::plan::task_topk::topks_read_in_their_order;

/// What a flumen node in a task plan is: a file scan with what datafusion-proto drops of it
/// (its files' row selections, whether it preserves its files' order, its format's settings).
pub const FILE_SCAN: &str = "flumen.file_scan";

/// What the workers of a pool can call: every worker's functions by name, and the runtimes
/// whose shipped functions every worker unpacks ([`crate::cluster::shipped_functions`]).
#[derive(Debug, Clone, Default)]
pub struct WorkerFunctions {
    /// Functions they have by name.
    pub names: HashSet<String>,
    /// Runtimes they unpack shipped functions of (e.g. `python3.12`).
    pub runtimes: HashSet<String>,
}

#[cfg(test)]
impl WorkerFunctions {
    /// Workers with every function of `ctx` (for tests).
    pub(crate) fn of(ctx: &SessionContext) -> Arc<Self> {
        let state = ctx.state();
        let names = (state.scalar_functions().keys())
            .chain(state.aggregate_functions().keys())
            .chain(state.window_functions().keys())
            .cloned()
            .collect();
        Arc::new(Self {
            names,
            runtimes: HashSet::new(),
        })
    }
}

/// Encode `plan` for workers that can call `functions` (a function they lack is an error,
/// so the task runs on the driver instead of failing in the worker). A function of a
/// runtime they host ships inside the plan.
pub fn encode(plan: &Arc<dyn ExecutionPlan>, functions: Arc<WorkerFunctions>) -> Result<Vec<u8>> {
    refuse_lossy(plan)?;
    let codec = TaskPlanCodec {
        functions: Some(functions),
        calls: None,
    };
    let converter = TaskPlanConverter::new(filters_produced_inside(plan));
    let node = converter.execution_plan_to_proto(plan, &codec)?;
    Ok(node.encode_to_vec())
}

/// Decode a task plan that [`encode`] made, under `ctx` (its functions and settings).
pub fn decode(bytes: &[u8], ctx: &TaskContext) -> Result<Arc<dyn ExecutionPlan>> {
    decode_calling(bytes, ctx, None)
}

/// [`decode`], finding the functions the plan calls that `ctx` does not hold in `session`,
/// each set to `ctx`'s settings as a `SessionState` built with them would set it (`now` and
/// `to_timestamp` take the time zone): a worker's task context then needs no copy of the
/// session's ~400 functions, of which a plan calls a few.
pub fn decode_calling(
    bytes: &[u8],
    ctx: &TaskContext,
    session: Option<&SessionContext>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let node = protobuf::PhysicalPlanNode::decode(bytes).map_err(|e| {
        DataFusionError::Execution(format!("a task plan that does not decode: {e}"))
    })?;
    let codec = TaskPlanCodec {
        functions: None,
        calls: session.map(|session| SessionCalls {
            session: session.clone(),
            options: Arc::clone(ctx.session_config().options()),
        }),
    };
    let converter = TaskPlanConverter::new(HashSet::new());
    let plan =
        converter.proto_to_execution_plan(&node, &PhysicalPlanDecodeContext::new(ctx, &codec))?;
    // A scan's row-group order hints do not travel: a TopK's scan gets them again.
    match ctx
        .session_config()
        .options()
        .optimizer
        .enable_sort_pushdown
    {
        true => topks_read_in_their_order(plan),
        false => Ok(plan),
    }
}

/// Why a task plan cannot go to a worker as it is ([`check_round_trip`]).
#[derive(Debug)]
pub enum RoundTrip {
    /// It does not decode (a plan datafusion-proto cannot carry, e.g. an aggregate over an
    /// async function's column): a worker would fail the task, so it runs on the driver.
    Undecodable(DataFusionError),
    /// It decodes to another plan than was planned: a worker would compute something else.
    Differs(DataFusionError),
}

/// Check that `bytes` (the encoding of `plan`) decodes under `ctx` to the plan a worker
/// should run: the same plan text (dynamic filters made outside it at their current value)
/// and the same files, byte ranges, row selections and scan settings. A difference's error
/// shows the first line that differs.
pub fn check_round_trip(
    plan: &Arc<dyn ExecutionPlan>,
    bytes: &[u8],
    ctx: &TaskContext,
) -> std::result::Result<(), RoundTrip> {
    let decoded = decode(bytes, ctx).map_err(RoundTrip::Undecodable)?;
    // A type proto loses shows in no node's text: a scan's table schema with a `LargeList`
    // decoded as `List` (schema_evolution_nested.slt) reads what the planned scan casts.
    if decoded.schema() != plan.schema() {
        return Err(RoundTrip::Undecodable(DataFusionError::NotImplemented(
            format!(
                "the task plan decodes with another output schema: planned {}, decoded {}",
                plan.schema(),
                decoded.schema()
            ),
        )));
    }
    let planned = as_sent(plan).map_err(RoundTrip::Differs)?;
    let planned = without_subquery_values(&without_read_order_hints(&describe(&planned)));
    let got = without_subquery_values(&without_read_order_hints(&describe(&decoded)));
    if planned == got {
        return Ok(());
    }
    let (at, (want, have)) = planned
        .lines()
        .chain(std::iter::repeat(""))
        .zip(got.lines().chain(std::iter::repeat("")))
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .unwrap_or((0, ("", "")));
    Err(RoundTrip::Differs(DataFusionError::Internal(format!(
        "a task plan does not decode as it was planned (line {}):\n  planned: {want}\n  \
         decoded: {have}\nplanned plan:\n{planned}decoded plan:\n{got}",
        at + 1
    ))))
}

/// An error naming the first node of `plan` that datafusion-proto would decode to another
/// node, with no error on either side (the round-trip check finds these too; refusing them
/// first sends their tasks to the driver in every build).
fn refuse_lossy(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    plan.apply(|node| {
        if let Some(aggregate) = node.downcast_ref::<AggregateExec>() {
            let group_by = aggregate.group_expr();
            // `GROUPING SETS (())`: its one empty set is written as no set at all.
            if group_by.has_grouping_set() && group_by.expr().is_empty() {
                return Err(DataFusionError::NotImplemented(
                    "datafusion-proto drops an aggregate's empty grouping set".into(),
                ));
            }
        }
        if let Some(why) = lossy_window(node) {
            return Err(DataFusionError::NotImplemented(why.into()));
        }
        // A scan's expression adapter (deltalake's, mapping files of older schemas onto the
        // table's) is not encoded: a worker would read those files unadapted.
        if file_scan(node).is_some_and(|config| config.expr_adapter_factory.is_some()) {
            return Err(DataFusionError::NotImplemented(
                "datafusion-proto drops a scan's expression adapter".into(),
            ));
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .map(|_| ())
}

/// What a plan is, as the round-trip check compares it: its text, then for every file scan
/// (in plan order) the settings and files its text does not show.
fn describe(plan: &Arc<dyn ExecutionPlan>) -> String {
    let mut text = displayable(plan.as_ref()).indent(true).to_string();
    let _ = plan.apply(|node| {
        text.push_str(&describe_window_calls(node));
        if let Some(config) = file_scan(node) {
            text.push_str(&format!(
                "scan: batch_size={:?} limit={:?} preserve_order={} expression_adapter={}\n",
                config.batch_size,
                config.limit,
                config.preserve_order,
                config.expr_adapter_factory.is_some(),
            ));
            text.push_str(&describe_format(config));
            for (g, group) in config.file_groups.iter().enumerate() {
                for file in group.iter() {
                    text.push_str(&format!(
                        "  group {g}: {} {:?} rows={:?} extensions={}\n",
                        file.object_meta.location,
                        file.range.as_ref().map(|r| (r.start, r.end)),
                        file.extensions.get::<ParquetAccessPlan>(),
                        file.extensions.len(),
                    ));
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    text
}

/// `text` without the row-group order hints of Parquet scans that a worker does not get
/// (see the module's list): `, reverse_row_groups=true` and `, sort_order_for_reorder=[..]`.
fn without_read_order_hints(text: &str) -> String {
    let mut text = text.replace(", reverse_row_groups=true", "");
    const REORDER: &str = ", sort_order_for_reorder=[";
    while let Some(start) = text.find(REORDER) {
        let after = start + REORDER.len();
        let end =
            after + closing_bracket(&text[after..], '[', ']').map_or(text.len() - after, |i| i + 1);
        text.replace_range(start..end, "");
    }
    text
}

/// The byte index in `text` (which follows an `open` bracket) of the `close` bracket that
/// closes it, if any.
fn closing_bracket(text: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 1;
    text.char_indices().find_map(|(i, c)| {
        depth += i32::from(c == open) - i32::from(c == close);
        (depth == 0).then_some(i)
    })
}

/// `text` with every scalar subquery's value left out (`scalar_subquery(42)` and
/// `scalar_subquery(<pending>)` both read `scalar_subquery(..)`): the driver's plan shows
/// the value once a task there has read it, a worker's decodes with its own empty slot,
/// which its task fills from the same input block.
fn without_subquery_values(text: &str) -> String {
    const VALUE: &str = "scalar_subquery(";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(VALUE) {
        out.push_str(&rest[..start + VALUE.len()]);
        let after = &rest[start + VALUE.len()..];
        let end = closing_bracket(after, '(', ')').unwrap_or(after.len());
        out.push_str("..");
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The file scan configuration of `node`, when it is a file scan.
fn file_scan(node: &Arc<dyn ExecutionPlan>) -> Option<&FileScanConfig> {
    node.downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<FileScanConfig>()
}

/// The ids of the dynamic filters that nodes of `plan` produce: those stay live in the task.
fn filters_produced_inside(plan: &Arc<dyn ExecutionPlan>) -> HashSet<u64> {
    let mut ids = HashSet::new();
    let _ = plan.apply(|node| {
        ids.extend(
            node.dynamic_expressions_produced()
                .iter()
                .filter_map(|e| e.expression_id()),
        );
        Ok(TreeNodeRecursion::Continue)
    });
    ids
}

/// `expr` as a worker gets it: every dynamic filter not in `live` replaced by its current
/// value, and any hash-table lookup in that value by `true`.
fn as_sent_expr(
    expr: &Arc<dyn PhysicalExpr>,
    live: &HashSet<u64>,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    Arc::clone(expr).transform_down(|e| {
        let frozen = e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some()
            && e.expression_id().is_none_or(|id| !live.contains(&id));
        if frozen {
            let current = e.snapshot()?.unwrap_or_else(|| Arc::clone(&e));
            let current = current
                .transform_up(|inner| {
                    Ok(if inner.downcast_ref::<HashTableLookupExpr>().is_some() {
                        Transformed::yes(lit(true))
                    } else {
                        Transformed::no(inner)
                    })
                })?
                .data;
            // Its value may hold other dynamic filters: they are frozen on the way down.
            return Ok(Transformed::yes(current));
        }
        Ok(Transformed::no(e))
    })
}

/// `plan` as a worker should decode it: the dynamic filters in its scans' and filters'
/// predicates that it does not produce itself, at their current value.
fn as_sent(plan: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    with_outside_filters_frozen(plan)?
        .transform_up(|node| match node.downcast_ref::<SubqueryValuesExec>() {
            Some(values) => Ok(Transformed::yes(values.as_scalar_subquery())),
            None => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
}

/// `plan` with the dynamic filters of its scans' and filters' predicates that it does not
/// produce itself fixed at their current value, as [`encode`] sends them. A plan encoded for
/// [`check_round_trip`] is frozen first: a join elsewhere may tighten a filter between the
/// encoding and the check, which would then see two values of it.
pub fn with_outside_filters_frozen(
    plan: &Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let live = filters_produced_inside(plan);
    Arc::clone(plan)
        .transform_up(|node| map_predicates(node, &mut |predicate| as_sent_expr(predicate, &live)))
        .map(|t| t.data)
}

/// Encodes and decodes the plan's nodes as datafusion-proto does, except as the module
/// says: a scan with row selections, `preserve_order` or format settings proto drops
/// becomes a [`FILE_SCAN`] node, and dynamic filters not in `live_filters` are sent at
/// their current value. Decoding, an expression met twice (a live dynamic filter: in the
/// join that fills it and in the scan it prunes) becomes one shared expression again.
struct TaskPlanConverter {
    live_filters: HashSet<u64>,
    /// The expressions decoded so far that have an identity, by it.
    decoded: RefCell<HashMap<u64, Arc<dyn PhysicalExpr>>>,
}

impl TaskPlanConverter {
    /// A converter for encoding a plan whose own nodes produce `live_filters`.
    fn new(live_filters: HashSet<u64>) -> Self {
        Self {
            live_filters,
            decoded: RefCell::default(),
        }
    }
}

impl PhysicalProtoConverterExtension for TaskPlanConverter {
    fn proto_to_execution_plan(
        &self,
        proto: &protobuf::PhysicalPlanNode,
        ctx: &PhysicalPlanDecodeContext<'_>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        proto.try_into_physical_plan_with_context(ctx, self)
    }

    fn execution_plan_to_proto(
        &self,
        plan: &Arc<dyn ExecutionPlan>,
        codec: &dyn PhysicalExtensionCodec,
    ) -> Result<protobuf::PhysicalPlanNode> {
        if let Some(values) = plan.downcast_ref::<SubqueryValuesExec>() {
            return protobuf::PhysicalPlanNode::try_from_physical_plan_with_converter(
                values.as_scalar_subquery(),
                codec,
                self,
            );
        }
        if let Some(config) = file_scan(plan)
            && let files = row_selections(config)?
            && let format = ScanFormat::lost_by_proto(config)?
            && (!files.is_empty() || config.preserve_order || format.is_some())
        {
            let scan = protobuf::PhysicalPlanNode::try_from_physical_plan_with_converter(
                Arc::clone(plan),
                codec,
                self,
            )?;
            let node = FileScanNode {
                kind: FILE_SCAN.into(),
                scan: scan.encode_to_vec(),
                files,
                preserve_order: config.preserve_order,
                format,
            };
            return Ok(protobuf::PhysicalPlanNode {
                physical_plan_type: Some(
                    protobuf::physical_plan_node::PhysicalPlanType::Extension(
                        protobuf::PhysicalExtensionNode {
                            node: node.encode_to_vec(),
                            inputs: vec![],
                        },
                    ),
                ),
            });
        }
        let mut node = protobuf::PhysicalPlanNode::try_from_physical_plan_with_converter(
            Arc::clone(plan),
            codec,
            self,
        )?;
        carry_window_calls(plan, &mut node);
        Ok(node)
    }

    fn proto_to_physical_expr(
        &self,
        proto: &protobuf::PhysicalExprNode,
        input_schema: &Schema,
        ctx: &PhysicalPlanDecodeContext<'_>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let parsed =
            datafusion_proto::physical_plan::from_proto::parse_physical_expr_with_converter(
                proto,
                input_schema,
                ctx,
                self,
            )?;
        // Decoded apart, a join's dynamic filter and the scan's copy of it were two: the
        // join filled its own and the worker's scan pruned nothing
        // (push_down_filter_parquet.slt). As DataFusion's `DeduplicatingProtoConverter`
        // does: the second occurrence is the first with its own children.
        let Some(id) = proto.expr_id else {
            return Ok(parsed);
        };
        let mut decoded = self.decoded.borrow_mut();
        if let Some(first) = decoded.get(&id) {
            let children = parsed.children().into_iter().cloned().collect();
            return Arc::clone(first).with_new_children(children);
        }
        decoded.insert(id, Arc::clone(&parsed));
        Ok(parsed)
    }

    fn physical_expr_to_proto(
        &self,
        expr: &Arc<dyn PhysicalExpr>,
        codec: &dyn PhysicalExtensionCodec,
    ) -> Result<protobuf::PhysicalExprNode> {
        let sent = as_sent_expr(expr, &self.live_filters)?.data;
        if let Some(call) = file_row_index_call(&sent) {
            return serialize_physical_expr_with_converter(&call, codec, self);
        }
        if let Some(expr) = (cast_fields::encode(&sent)?)
            .or_else(|| bound_reads::encode(&sent))
            .or_else(|| key_sets::encode(&sent))
        {
            let inputs = (sent.children().into_iter())
                .map(|input| self.physical_expr_to_proto(input, codec))
                .collect::<Result<_>>()?;
            return Ok(protobuf::PhysicalExprNode {
                expr_id: None,
                expr_type: Some(protobuf::physical_expr_node::ExprType::Extension(
                    protobuf::PhysicalExtensionExprNode { expr, inputs },
                )),
            });
        }
        serialize_physical_expr_with_converter(&sent, codec, self)
    }
}

/// A Parquet scan's read of a row's index in its file (`CAST(__datafusion_file_row_index@N
/// AS Int64)`, what DataFusion makes of `file_row_index()` pushed into the scan) as the call
/// `file_row_index()` again. Proto drops a scan's virtual columns, so the worker's decode of
/// the column read failed ("Column index 4 out of bounds"), and every task of a
/// `TABLESAMPLE` of a Parquet table ran on the driver; the call, pushed into the decoded
/// scan as its projection is, makes the same virtual column there.
fn file_row_index_call(expr: &Arc<dyn PhysicalExpr>) -> Option<Arc<dyn PhysicalExpr>> {
    let cast = expr.downcast_ref::<CastExpr>()?;
    let column = cast.expr().downcast_ref::<Column>()?;
    if !column.name().starts_with(FILE_ROW_INDEX_COLUMN) || cast.cast_type() != &DataType::Int64 {
        return None;
    }
    let function = datafusion::functions::core::file_row_index();
    let name = function.name().to_string();
    let field = Arc::new(Field::new(&name, DataType::Int64, true));
    let options = Arc::new(datafusion::config::ConfigOptions::default());
    Some(Arc::new(ScalarFunctionExpr::new(
        &name,
        function,
        vec![],
        field,
        options,
    )))
}

/// The name DataFusion gives a Parquet scan's row-index virtual column (a suffix `_N`
/// follows where a table has a column of that name).
const FILE_ROW_INDEX_COLUMN: &str = "__datafusion_file_row_index";

/// Each file's row selection of the scan `config`, keyed by group and file. A file
/// extension other than a row selection is an error: proto would drop it and the worker
/// would read what the driver did not plan.
fn row_selections(config: &FileScanConfig) -> Result<Vec<FileRows>> {
    let mut files = vec![];
    for (g, group) in config.file_groups.iter().enumerate() {
        for (f, file) in group.iter().enumerate() {
            let selection = file.extensions.get::<ParquetAccessPlan>();
            let others = file.extensions.len() - usize::from(selection.is_some());
            if others > 0 {
                return Err(DataFusionError::NotImplemented(format!(
                    "{} carries {others} file extension(s) a task plan cannot carry",
                    file.object_meta.location
                )));
            }
            if let Some(plan) = selection {
                files.push(FileRows {
                    group: g as u32,
                    file: f as u32,
                    row_groups: plan.inner().iter().map(RowGroupRows::from).collect(),
                });
            }
        }
    }
    Ok(files)
}

/// Encodes and decodes flumen's [`FILE_SCAN`] nodes and DataFusion's per-partition TopK
/// ([`topk_nodes`]), and checks that the workers have each function the plan calls;
/// everything else is datafusion-proto's.
#[derive(Debug)]
struct TaskPlanCodec {
    /// The functions the workers can call (`None` when decoding).
    functions: Option<Arc<WorkerFunctions>>,
    /// Where a decode finds the functions its task context does not hold.
    calls: Option<SessionCalls>,
}

/// A session's functions by name, set to a task's settings as they are looked up
/// ([`decode_calling`]).
struct SessionCalls {
    session: SessionContext,
    options: Arc<ConfigOptions>,
}

impl std::fmt::Debug for SessionCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionCalls")
            .field("session", &self.session.session_id())
            .finish_non_exhaustive()
    }
}

impl SessionCalls {
    /// Scalar function `name`, with the task's settings.
    fn scalar(&self, name: &str) -> Option<Arc<ScalarUDF>> {
        let state = self.session.state_ref();
        let udf = Arc::clone(state.read().scalar_functions().get(name)?);
        Some(match udf.inner().with_updated_config(&self.options) {
            Some(updated) => Arc::new(updated),
            None => udf,
        })
    }
}

/// The error of a task plan that calls a function this worker does not have.
fn no_function(name: &str) -> DataFusionError {
    DataFusionError::NotImplemented(format!(
        "a task plan calls function {name}, which this worker does not have"
    ))
}

impl TaskPlanCodec {
    /// Whether the workers have function `name` (of `kind`) as this session has it:
    /// by name, and, for a function a stock worker has, the same implementation (a session
    /// may register another one under a built-in's name, as Spark's `avg`, whose state a
    /// worker's `avg` would misread).
    fn known(&self, kind: FunctionKind, name: &str, implementation: TypeId) -> Result<()> {
        let Some(functions) = &self.functions else {
            return Ok(());
        };
        if !functions.names.contains(name) {
            return Err(DataFusionError::NotImplemented(format!(
                "workers have no function {name}"
            )));
        }
        match stock_functions().get(&(kind, name.to_string())) {
            Some(stock) if *stock != implementation => Err(DataFusionError::NotImplemented(
                format!("workers have another function {name} than this session's"),
            )),
            _ => Ok(()),
        }
    }
}

/// The kinds of functions a plan calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum FunctionKind {
    Scalar,
    Aggregate,
    Window,
}

/// The implementation (its Rust type) of each function of a stock worker's session (what
/// `flumen worker` runs), by kind and name.
fn stock_functions() -> &'static HashMap<(FunctionKind, String), TypeId> {
    static STOCK: OnceLock<HashMap<(FunctionKind, String), TypeId>> = OnceLock::new();
    STOCK.get_or_init(|| {
        let state = crate::session(crate::FlumenConfig::default()).state();
        let mut stock = HashMap::new();
        for (name, f) in state.scalar_functions() {
            let any: &dyn Any = f.inner().as_ref();
            stock.insert((FunctionKind::Scalar, name.clone()), any.type_id());
        }
        for (name, f) in state.aggregate_functions() {
            let any: &dyn Any = f.inner().as_ref();
            stock.insert((FunctionKind::Aggregate, name.clone()), any.type_id());
        }
        for (name, f) in state.window_functions() {
            let any: &dyn Any = f.inner().as_ref();
            stock.insert((FunctionKind::Window, name.clone()), any.type_id());
        }
        stock
    })
}

impl PhysicalExtensionCodec for TaskPlanCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let decode_ctx = PhysicalPlanDecodeContext::new(ctx, self);
        if let Some(topk) = topk_nodes::decode(buf, inputs, &decode_ctx, proto_converter)? {
            return Ok(topk);
        }
        if let Some(keys) = sample_keys::decode(buf, inputs)? {
            return Ok(keys);
        }
        let node = FileScanNode::decode(buf)
            .ok()
            .filter(|n| n.kind == FILE_SCAN)
            .ok_or_else(|| {
                DataFusionError::Execution("a task plan holds an unknown extension node".into())
            })?;
        let scan = protobuf::PhysicalPlanNode::decode(node.scan.as_slice())
            .map_err(|e| DataFusionError::Execution(format!("a bad scan in a task plan: {e}")))?;
        let scan = proto_converter.proto_to_execution_plan(&scan, &decode_ctx)?;
        let config = file_scan(&scan).ok_or_else(|| {
            DataFusionError::Execution(
                "a task plan's row selections are not over a file scan".into(),
            )
        })?;
        let mut groups: Vec<Vec<_>> = config
            .file_groups
            .iter()
            .map(|g| g.iter().cloned().collect())
            .collect();
        for rows in node.files {
            let file = groups
                .get_mut(rows.group as usize)
                .and_then(|g| g.get_mut(rows.file as usize))
                .ok_or_else(|| {
                    DataFusionError::Execution(format!(
                        "a task plan's row selection names file {} of group {}, which its scan \
                         does not have",
                        rows.file, rows.group
                    ))
                })?;
            let accesses = rows
                .row_groups
                .iter()
                .map(RowGroupAccess::try_from)
                .collect::<Result<_>>()?;
            *file = file
                .clone()
                .with_extension(ParquetAccessPlan::new(accesses));
        }
        let mut builder = FileScanConfigBuilder::from(config.clone())
            .with_file_groups(groups.into_iter().map(FileGroup::new).collect())
            .with_preserve_order(node.preserve_order);
        if let Some(format) = &node.format {
            builder = format.put_back(builder, config.file_source())?;
        }
        Ok(DataSourceExec::from_data_source(builder.build()))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(topk) = topk_nodes::encode(&node, self, proto_converter)? {
            buf.extend(topk);
            return Ok(());
        }
        if let Some(keys) = sample_keys::encode(&node) {
            buf.extend(keys);
            return Ok(());
        }
        DefaultPhysicalExtensionCodec {}.try_encode(node, buf, proto_converter)
    }

    fn try_decode_expr(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn PhysicalExpr>],
        _ctx: &PhysicalExprDecodeCtx<'_>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let decoded = match cast_fields::decode(buf, inputs)? {
            Some(cast) => Some(cast),
            None => match bound_reads::decode(buf, inputs)? {
                Some(read) => Some(read),
                None => key_sets::decode(buf, inputs)?,
            },
        };
        decoded.ok_or_else(|| {
            DataFusionError::Execution("a task plan holds an unknown extension expression".into())
        })
    }

    fn try_encode_udf(&self, node: &ScalarUDF, buf: &mut Vec<u8>) -> Result<()> {
        if let Some(shipped) = shipped_functions::pack(node) {
            if let Some(functions) = &self.functions
                && !functions.runtimes.contains(&shipped.runtime)
            {
                return Err(DataFusionError::NotImplemented(format!(
                    "workers do not run {} functions such as {}",
                    shipped.runtime,
                    node.name()
                )));
            }
            buf.extend(shipped.to_bytes());
            return Ok(());
        }
        let any: &dyn Any = node.inner().as_ref();
        self.known(FunctionKind::Scalar, node.name(), any.type_id())
    }

    fn try_decode_udf(&self, name: &str, buf: &[u8]) -> Result<Arc<ScalarUDF>> {
        match ShippedFunction::from_bytes(buf) {
            Some(shipped) => shipped_functions::unpack(name, &shipped),
            None => (self.calls.as_ref())
                .and_then(|calls| calls.scalar(name))
                .ok_or_else(|| no_function(name)),
        }
    }

    fn try_decode_higher_order_function(
        &self,
        name: &str,
        _buf: &[u8],
    ) -> Result<Arc<HigherOrderUDF>> {
        let calls = self.calls.as_ref().ok_or_else(|| no_function(name))?;
        let state = calls.session.state_ref();
        let found = state.read().higher_order_functions().get(name).cloned();
        found.ok_or_else(|| no_function(name))
    }

    fn try_decode_udaf(&self, name: &str, _buf: &[u8]) -> Result<Arc<AggregateUDF>> {
        let calls = self.calls.as_ref().ok_or_else(|| no_function(name))?;
        let state = calls.session.state_ref();
        let found = state.read().aggregate_functions().get(name).cloned();
        found.ok_or_else(|| no_function(name))
    }

    fn try_decode_udwf(&self, name: &str, _buf: &[u8]) -> Result<Arc<WindowUDF>> {
        let calls = self.calls.as_ref().ok_or_else(|| no_function(name))?;
        let state = calls.session.state_ref();
        let found = state.read().window_functions().get(name).cloned();
        found.ok_or_else(|| no_function(name))
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, _buf: &mut Vec<u8>) -> Result<()> {
        let any: &dyn Any = node.inner().as_ref();
        self.known(FunctionKind::Aggregate, node.name(), any.type_id())
    }

    fn try_encode_udwf(&self, node: &WindowUDF, _buf: &mut Vec<u8>) -> Result<()> {
        let any: &dyn Any = node.inner().as_ref();
        self.known(FunctionKind::Window, node.name(), any.type_id())
    }
}

/// A [`FILE_SCAN`] node: a file scan encoded by datafusion-proto, and what that encoding
/// drops of it.
#[derive(Clone, PartialEq, prost::Message)]
struct FileScanNode {
    /// Always [`FILE_SCAN`].
    #[prost(string, tag = "1")]
    kind: String,
    /// The scan (a `PhysicalPlanNode`), without its files' row selections.
    #[prost(bytes = "vec", tag = "2")]
    scan: Vec<u8>,
    /// The files that read a row selection.
    #[prost(message, repeated, tag = "3")]
    files: Vec<FileRows>,
    /// The scan reads its files in the order given (`FileScanConfig::preserve_order`).
    #[prost(bool, tag = "4")]
    preserve_order: bool,
    /// A CSV, JSON or Arrow-stream scan's settings that proto drops.
    #[prost(message, optional, tag = "5")]
    format: Option<ScanFormat>,
}

/// The row selection of file `file` of file group `group` of a scan.
#[derive(Clone, PartialEq, prost::Message)]
struct FileRows {
    #[prost(uint32, tag = "1")]
    group: u32,
    #[prost(uint32, tag = "2")]
    file: u32,
    /// What it reads of each of its row groups, in file order.
    #[prost(message, repeated, tag = "3")]
    row_groups: Vec<RowGroupRows>,
}

/// What a scan reads of one row group.
#[derive(Clone, PartialEq, prost::Message)]
struct RowGroupRows {
    /// 0: nothing; 1: every row; 2: the rows `selectors` select.
    #[prost(uint32, tag = "1")]
    access: u32,
    #[prost(message, repeated, tag = "2")]
    selectors: Vec<Selector>,
}

/// A run of consecutive rows, read or skipped.
#[derive(Clone, PartialEq, prost::Message)]
struct Selector {
    #[prost(bool, tag = "1")]
    skip: bool,
    #[prost(uint64, tag = "2")]
    rows: u64,
}

impl From<&RowGroupAccess> for RowGroupRows {
    fn from(access: &RowGroupAccess) -> Self {
        match access {
            RowGroupAccess::Skip => Self {
                access: 0,
                selectors: vec![],
            },
            RowGroupAccess::Scan => Self {
                access: 1,
                selectors: vec![],
            },
            RowGroupAccess::Selection(selection) => Self {
                access: 2,
                selectors: selection
                    .iter()
                    .map(|s| Selector {
                        skip: s.skip,
                        rows: s.row_count as u64,
                    })
                    .collect(),
            },
        }
    }
}

impl TryFrom<&RowGroupRows> for RowGroupAccess {
    type Error = DataFusionError;

    fn try_from(rows: &RowGroupRows) -> Result<Self> {
        Ok(match rows.access {
            0 => RowGroupAccess::Skip,
            1 => RowGroupAccess::Scan,
            2 => RowGroupAccess::Selection(RowSelection::from(
                rows.selectors
                    .iter()
                    .map(|s| match s.skip {
                        true => RowSelector::skip(s.rows as usize),
                        false => RowSelector::select(s.rows as usize),
                    })
                    .collect::<Vec<_>>(),
            )),
            other => {
                return Err(DataFusionError::Execution(format!(
                    "a task plan's row group access {other} is none flumen sends"
                )));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::datasource::listing::PartitionedFile;
    use datafusion::datasource::physical_plan::{FileSource, ParquetSource};
    use datafusion::execution::object_store::ObjectStoreUrl;
    use datafusion::physical_expr::expressions::{Column, in_list};

    /// The scan's table: `a` (Int64) then `b` (Utf8View).
    fn table() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Utf8View, false),
        ]))
    }

    /// A Parquet scan of `files` (nothing is read: plans are only encoded and decoded).
    fn scan(
        files: Vec<PartitionedFile>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
    ) -> Arc<dyn ExecutionPlan> {
        let mut source = ParquetSource::new(table());
        if let Some(predicate) = predicate {
            source = source.with_predicate(predicate);
        }
        let config =
            FileScanConfigBuilder::new(ObjectStoreUrl::local_filesystem(), Arc::new(source))
                .with_file_groups(vec![FileGroup::new(files)])
                .build();
        DataSourceExec::from_data_source(config)
    }

    fn task_ctx() -> TaskContext {
        TaskContext::default()
    }

    fn round_trip(plan: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        let bytes = encode(plan, Arc::new(WorkerFunctions::default())).unwrap();
        check_round_trip(plan, &bytes, &task_ctx()).unwrap_or_else(|e| panic!("{e:?}"));
        decode(&bytes, &task_ctx()).unwrap()
    }

    /// The access plan of each file of a decoded scan.
    fn selections(plan: &Arc<dyn ExecutionPlan>) -> Vec<Option<ParquetAccessPlan>> {
        file_scan(plan)
            .unwrap()
            .file_groups
            .iter()
            .flat_map(|g| g.iter())
            .map(|f| f.extensions.get::<ParquetAccessPlan>().cloned())
            .collect()
    }

    #[test]
    fn a_row_group_piece_reaches_the_worker_with_its_row_selection() {
        let mut piece = ParquetAccessPlan::new_none(3);
        piece.set(
            1,
            RowGroupAccess::Selection(RowSelection::from(vec![
                RowSelector::skip(1000),
                RowSelector::select(1000),
                RowSelector::skip(3000),
            ])),
        );
        let mut all_but_one = ParquetAccessPlan::new_all(3);
        all_but_one.skip(0);
        let files = vec![
            PartitionedFile::new("data/f.parquet", 50_000)
                .with_range(100, 20_000)
                .with_extension(piece.clone()),
            PartitionedFile::new("data/g.parquet", 50_000),
            PartitionedFile::new("data/h.parquet", 50_000).with_extension(all_but_one.clone()),
        ];
        let plan = scan(files, None);
        let decoded = round_trip(&plan);
        assert_eq!(
            selections(&decoded),
            vec![Some(piece), None, Some(all_but_one)]
        );
        assert!(!file_scan(&decoded).unwrap().preserve_order);
        // A scan that reads its files in order is sent so, selections or not.
        let config = file_scan(&plan).unwrap().clone();
        let in_order: Arc<dyn ExecutionPlan> = DataSourceExec::from_data_source(
            FileScanConfigBuilder::from(config)
                .with_preserve_order(true)
                .build(),
        );
        assert!(file_scan(&round_trip(&in_order)).unwrap().preserve_order);
        // datafusion-proto alone drops them: each piece would read its whole row group.
        let plain = datafusion_proto::bytes::physical_plan_to_bytes(Arc::clone(&plan)).unwrap();
        let plain = datafusion_proto::bytes::physical_plan_from_bytes(&plain, &task_ctx()).unwrap();
        assert_eq!(selections(&plain), vec![None, None, None]);
    }

    #[test]
    fn a_file_extension_the_plan_cannot_carry_is_refused() {
        #[derive(Debug)]
        struct Other;
        let file = PartitionedFile::new("data/f.parquet", 10).with_extension(Other);
        let err = encode(
            &scan(vec![file], None),
            Arc::new(WorkerFunctions::default()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("file extension"), "{err}");
    }

    #[test]
    fn a_join_filter_made_on_the_driver_reaches_the_scan_on_its_own_columns() {
        // The join's probe side has its key at column 1 (`k`); in the scan it is `a`, at 0,
        // where column 1 is a Utf8View column.
        let filter = Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::new(Column::new("k", 1))],
            lit(true),
        ));
        let on_scan = Arc::clone(&filter)
            .with_new_children(vec![Arc::new(Column::new("a", 0))])
            .unwrap();
        let probe = Schema::new(vec![
            Field::new("x", DataType::Utf8View, false),
            Field::new("k", DataType::Int64, false),
        ]);
        let keys = (1..=3).map(|i| lit(i as i64)).collect();
        filter
            .update(in_list(Arc::new(Column::new("k", 1)), keys, &false, &probe).unwrap())
            .unwrap();
        let plan = scan(
            vec![PartitionedFile::new("data/f.parquet", 10)],
            Some(on_scan),
        );
        let decoded = round_trip(&plan);
        let text = displayable(decoded.as_ref()).one_line().to_string();
        assert!(
            text.contains("predicate=a@0 IN (SET) ([1, 2, 3])"),
            "{text}"
        );
        // datafusion-proto alone decodes the filter's value against the scan's columns
        // (DataFusion 55.2): `k@1` becomes the Utf8View column `b`.
        let plain = datafusion_proto::bytes::physical_plan_to_bytes(Arc::clone(&plan)).unwrap();
        let err =
            datafusion_proto::bytes::physical_plan_from_bytes(&plain, &task_ctx()).unwrap_err();
        assert!(err.to_string().contains("Utf8View"), "{err}");
    }

    /// A probe scan's filter tightened by its join between the encoding and the check (seed
    /// 124004's query 69 under `FLUMEN_FUZZ_ALSO`, batch mode with two workers): the check
    /// compared the plan's new value with the encoded old one and failed the query. Frozen
    /// first, the plan is checked at the value it was encoded with.
    #[test]
    fn a_filter_tightened_after_the_encoding_does_not_fail_the_check() {
        let filter = Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::new(Column::new("a", 0))],
            lit(true),
        ));
        let plan = scan(
            vec![PartitionedFile::new("data/f.parquet", 10)],
            Some(Arc::clone(&filter) as Arc<dyn PhysicalExpr>),
        );
        let tighten = || {
            let bound = in_list(
                Arc::new(Column::new("a", 0)),
                vec![lit(1i64), lit(2i64)],
                &false,
                &table(),
            );
            filter.update(bound.unwrap()).unwrap();
        };
        let functions = || Arc::new(WorkerFunctions::default());
        // As the check was made: the live plan encoded, then compared after the update.
        let bytes = encode(&plan, functions()).unwrap();
        tighten();
        assert!(matches!(
            check_round_trip(&plan, &bytes, &task_ctx()),
            Err(RoundTrip::Differs(_))
        ));
        // Frozen first: the same value on both sides, whatever the filter does next.
        let frozen = with_outside_filters_frozen(&plan).unwrap();
        let bytes = encode(&frozen, functions()).unwrap();
        filter.update(lit(false)).unwrap();
        check_round_trip(&frozen, &bytes, &task_ctx()).unwrap_or_else(|e| panic!("{e:?}"));
        let text = displayable(decode(&bytes, &task_ctx()).unwrap().as_ref())
            .one_line()
            .to_string();
        assert!(text.contains("a@0 IN (SET) ([1, 2])"), "{text}");
    }

    #[test]
    fn row_group_order_hints_are_left_out_of_the_comparison() {
        let text = "DataSourceExec: a, sort_order_for_reorder=[tag@2 DESC, f([x])@1 ASC], \
                    reverse_row_groups=true, b\n";
        assert_eq!(without_read_order_hints(text), "DataSourceExec: a, b\n");
    }

    #[test]
    fn the_check_names_what_a_worker_would_decode_differently() {
        let planned = scan(
            vec![
                PartitionedFile::new("data/f.parquet", 10)
                    .with_extension(ParquetAccessPlan::new_none(1)),
            ],
            None,
        );
        let other = scan(vec![PartitionedFile::new("data/f.parquet", 10)], None);
        let bytes = encode(&other, Arc::new(WorkerFunctions::default())).unwrap();
        let Err(RoundTrip::Differs(err)) = check_round_trip(&planned, &bytes, &task_ctx()) else {
            panic!("a plan without its row selection passed the check");
        };
        assert!(
            err.to_string()
                .contains("does not decode as it was planned"),
            "{err}"
        );
        assert!(err.to_string().contains("rows=None"), "{err}");
    }

    /// The task plan of `sql`'s one operator, as planned by `ctx`.
    async fn task_plan_of(
        ctx: &datafusion::prelude::SessionContext,
        sql: &str,
    ) -> Arc<dyn ExecutionPlan> {
        let plan = ctx.sql(sql).await.unwrap().create_physical_plan().await;
        let plan = plan.unwrap();
        let exec = plan.downcast_ref::<crate::exec::FlumenExec>().unwrap();
        Arc::clone(&exec.graph().operators[0].fragment)
    }

    /// A function the session registered under a stock worker function's name with another
    /// implementation is refused (a worker would run its own, as Spark's `avg` made a
    /// worker misread the state of DataFusion's); the stock one goes.
    #[tokio::test]
    async fn a_function_shadowing_a_workers_own_is_refused() {
        use datafusion::arrow::array::{ArrayRef, Int64Array};
        use datafusion::logical_expr::{ColumnarValue, Volatility, create_udf};
        let ctx = crate::session(crate::FlumenConfig::default());
        let sql = "SELECT abs(x) FROM (VALUES (CAST(-1 AS BIGINT))) AS t(x)";
        let functions = Arc::new(WorkerFunctions {
            names: ["abs".to_string()].into(),
            runtimes: HashSet::new(),
        });
        encode(&task_plan_of(&ctx, sql).await, Arc::clone(&functions)).unwrap();
        let negate = Arc::new(|args: &[ColumnarValue]| {
            let values = ColumnarValue::values_to_arrays(args)?;
            let values = values[0].as_any().downcast_ref::<Int64Array>().unwrap();
            let negated: Int64Array = values.iter().map(|v| v.map(|v| -v)).collect();
            Ok(ColumnarValue::Array(Arc::new(negated) as ArrayRef))
        });
        ctx.register_udf(create_udf(
            "abs",
            vec![DataType::Int64],
            DataType::Int64,
            Volatility::Immutable,
            negate,
        ));
        let err = encode(&task_plan_of(&ctx, sql).await, functions).unwrap_err();
        assert!(
            err.to_string()
                .contains("workers have another function abs than this session's"),
            "{err}"
        );
    }

    /// A join's dynamic filter that its task's own scan reads is one filter after the trip:
    /// the decoded join fills the filter the decoded scan prunes with. Decoded apart (the
    /// join's copy and the scan's), the scan's stayed `true` and a worker pruned nothing.
    #[tokio::test]
    async fn a_dynamic_filter_made_inside_the_task_stays_one_filter() {
        use crate::plan::test_plans::{node_named, physical_plan};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let ctx = datafusion::prelude::SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_target_partitions(1),
        );
        for copy in [
            format!("COPY (SELECT value AS k FROM range(0, 1000)) TO '{d}/fact.parquet'"),
            format!("COPY (SELECT value + 500 AS k FROM range(0, 3)) TO '{d}/dim.parquet'"),
            format!("CREATE EXTERNAL TABLE fact STORED AS PARQUET LOCATION '{d}/fact.parquet'"),
            format!("CREATE EXTERNAL TABLE dim STORED AS PARQUET LOCATION '{d}/dim.parquet'"),
        ] {
            ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        }
        let plan = physical_plan(&ctx, "SELECT f.k FROM dim d JOIN fact f ON d.k = f.k").await;
        assert!(
            node_named(&plan, "HashJoinExec").is_some(),
            "{}",
            displayable(plan.as_ref()).indent(true)
        );
        let bytes = encode(&plan, Arc::new(WorkerFunctions::default())).unwrap();
        let decoded = decode(&bytes, &ctx.task_ctx()).unwrap();
        let rows = datafusion::physical_plan::collect(Arc::clone(&decoded), ctx.task_ctx())
            .await
            .unwrap();
        assert_eq!(rows.iter().map(|b| b.num_rows()).sum::<usize>(), 3);
        // The probe side's scan (the last one, top down) and its copy of the filter.
        let mut scans = vec![];
        let _ = decoded.apply(|node| {
            if let Some(config) = file_scan(node) {
                scans.push(config.clone());
            }
            Ok(TreeNodeRecursion::Continue)
        });
        let probe = scans.last().unwrap();
        let predicate = probe
            .file_source()
            .downcast_ref::<ParquetSource>()
            .and_then(|p| p.filter())
            .expect("the probe scan has the join's filter");
        let mut filters = vec![];
        let _ = predicate.apply(|e| {
            if let Some(filter) = e.downcast_ref::<DynamicFilterPhysicalExpr>() {
                filters.push(filter.current().unwrap().to_string());
            }
            Ok(TreeNodeRecursion::Continue)
        });
        assert_eq!(filters.len(), 1, "{predicate}");
        assert_ne!(filters[0], "true", "the scan's filter was never filled");
    }

    /// A scan reading `file_row_index()` (a virtual column proto drops) decodes on a
    /// worker into the same scan, which reads the same row indexes.
    #[tokio::test]
    async fn a_scans_file_row_index_comes_back_from_a_task_plan() {
        use crate::plan::test_plans::physical_plan;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let ctx = datafusion::prelude::SessionContext::new();
        let copy = format!(
            "COPY (SELECT value AS v FROM range(10)) TO '{}' STORED AS PARQUET",
            path.display()
        );
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        ctx.register_parquet("t", path.to_str().unwrap(), Default::default())
            .await
            .unwrap();
        let plan = physical_plan(&ctx, "SELECT v, file_row_index() AS r FROM t WHERE v > 6").await;
        let shown =
            |plan: &Arc<dyn ExecutionPlan>| displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown(&plan).contains(FILE_ROW_INDEX_COLUMN),
            "{}",
            shown(&plan)
        );
        let functions = WorkerFunctions {
            names: ["file_row_index".to_string()].into(),
            runtimes: Default::default(),
        };
        let bytes = encode(&plan, Arc::new(functions)).unwrap();
        check_round_trip(&plan, &bytes, &ctx.task_ctx()).unwrap_or_else(|e| panic!("{e:?}"));
        let decoded = decode(&bytes, &ctx.task_ctx()).unwrap();
        let rows = datafusion::physical_plan::collect(decoded, ctx.task_ctx())
            .await
            .unwrap();
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&rows)
            .unwrap()
            .to_string();
        for (v, r) in [(7, 7), (8, 8), (9, 9)] {
            assert!(text.contains(&format!("| {v} | {r} |")), "{text}");
        }
    }

    /// A worker's task context holds none of the session's functions: its decode finds
    /// the scalar, aggregate and window functions the plan calls in the worker's session,
    /// each scalar one set to the task's settings (`to_timestamp` reads its string in the
    /// driver's time zone, Asia/Tokyo, not the worker's UTC); without the session the same
    /// bytes name a function the worker does not have.
    #[tokio::test]
    async fn a_decode_finds_the_functions_its_context_lacks_in_the_session() {
        use datafusion::physical_plan::collect;
        // DataFusion's own planner (a task plan is a fragment of its plan), with flumen's
        // functions, as a worker has them.
        let driver = SessionContext::new();
        crate::session::register_functions(&driver);
        let set = "SET datafusion.execution.time_zone = 'Asia/Tokyo'";
        driver.sql(set).await.unwrap().collect().await.unwrap();
        let functions = WorkerFunctions::of(&driver);
        let sql = "SELECT CAST(to_timestamp(s) AS BIGINT) AS t, min(n) AS m, \
                   row_number() OVER (ORDER BY s) AS r \
                   FROM (VALUES ('2024-01-01 03:00:00', 1), ('2024-01-02 03:00:00', 2)) v(s, n) \
                   GROUP BY s ORDER BY s";
        let plan = driver.sql(sql).await.unwrap().create_physical_plan().await;
        let plan = plan.unwrap();
        let bytes = encode(&plan, functions).unwrap();
        let worker = crate::session(crate::FlumenConfig::default());
        let bare = Arc::new(TaskContext::new(
            None,
            worker.session_id(),
            driver.copied_config(),
            HashMap::new(),
            HashMap::new(),
            HashMap::new(),
            HashMap::new(),
            worker.runtime_env(),
        ));
        let decoded = decode_calling(&bytes, &bare, Some(&worker)).unwrap();
        let got = collect(decoded, Arc::clone(&bare)).await.unwrap();
        let text = |batches: &[datafusion::arrow::record_batch::RecordBatch]| {
            datafusion::arrow::util::pretty::pretty_format_batches(batches)
                .unwrap()
                .to_string()
        };
        // 03:00 in Tokyo is 18:00 UTC the day before.
        let want = [
            "| 1704045600000000000 | 1 | 1 |",
            "| 1704132000000000000 | 2 | 2 |",
        ];
        for row in want {
            assert!(text(&got).contains(row), "{}", text(&got));
        }
        let error = decode(&bytes, &bare).unwrap_err().to_string();
        assert!(error.contains("which this worker does not have"), "{error}");
    }
}
