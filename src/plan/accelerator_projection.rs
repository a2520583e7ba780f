//! Keeping model calls in a projection of their own.
//!
//! DataFusion's `ProjectionPushdown` merges projections into the nodes below them, Parquet
//! scans included: `SELECT embed(body) FROM docs` would evaluate the model inside the scan's
//! source tasks, on the CPU pool. [`KeepAcceleratorProjections`], the first physical optimizer
//! rule of a flumen session, wraps every `ProjectionExec` that calls an accelerator UDF in an
//! [`AcceleratorProjectionExec`], which no DataFusion rule merges or moves, so the planner can
//! cut it out as an accelerator operator.
//!
//! CPU work in such a projection — the arguments of a model call (`embed(clean_text(body))`)
//! and expressions that call no model — is first moved into a plain `ProjectionExec` below
//! it ([`split_cpu_work`]), and CPU work over a model's output (`cosine_similarity(embed(a),
//! embed(b))`) into a plain `ProjectionExec` above it ([`split_model_consumers`]), so it runs
//! in CPU tasks and the accelerator workers only run models.
//!
//! Models over models (`model_b(post(model_a(x)))`) are first cut into levels
//! ([`split_nested_models`]): each level's model calls get an accelerator projection of
//! their own, and the CPU work between two levels a plain projection between them, so each
//! model runs in its own operator, fed by CPU tasks.
//!
//! A model that declares a CPU step ([`AcceleratorFunction::cpu_step`], e.g. `embed`'s
//! tokenizer) is first rewritten to take the step's result ([`with_cpu_steps`]: `embed(x)` →
//! `embed(embed_tokens(x))`), so the step is CPU work like any other argument and runs in the
//! CPU operator below the model (`flumen.preprocess_on_cpu`: by default when the model
//! computes on an accelerator; a model on the CPU would only contend with its own step).
//!
//! A model called in `WHERE` gets the same treatment ([`plan_model_filter`]): the conditions
//! that call no model filter first, a projection computes the model calls (planned as
//! above), the conditions over their results filter next, and the model columns are dropped.
//! Without it the `FilterExec` ran the model in CPU tasks, and the predicate reached the
//! Parquet scan. So does one in `ORDER BY` ([`plan_model_sort`]; a sort's merge evaluated the
//! model a second time) and one in an aggregate's arguments or `GROUP BY`
//! ([`plan_model_aggregate`]: `count(embed(body))` ran the model in the aggregate's CPU
//! tasks).
//!
//! A TopK over a projection calling models (`ORDER BY id LIMIT 3`) is first put below it
//! where its keys read no model ([`topk_before_models`]): the models see the rows it keeps.
//!
//! With `flumen.model_cache` set, the cache's lookup goes into the CPU work below each
//! cacheable model and its fill around the model call ([`with_cache_lookups`]).
//!
//! [`AcceleratorFunction::cpu_step`]: crate::functions::accelerator::AcceleratorFunction::cpu_step

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::aggregate::{AggregateExprBuilder, AggregateFunctionExpr};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_expr::{conjunction, split_conjunction};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use crate::config::{FlumenConfig, PreprocessOnCpu};
use crate::functions::accelerator::{
    AcceleratorFunction, called_accelerator_function, calls_accelerator_udf,
};
use crate::plan::model_cache_lookup::with_cache_lookups;
use crate::plan::queued_model_calls::{ModelCalls, QueuedModelStream};
use crate::plan::topk_before_models::topk_before_models;

/// A `ProjectionExec` that calls an accelerator UDF, held where the query put it.
#[derive(Debug, Clone)]
pub struct AcceleratorProjectionExec {
    projection: Arc<ProjectionExec>,
}

impl AcceleratorProjectionExec {
    /// Wrap a projection.
    pub fn new(projection: Arc<ProjectionExec>) -> Self {
        Self { projection }
    }

    /// The projection it holds.
    pub fn projection(&self) -> &ProjectionExec {
        &self.projection
    }
}

impl DisplayAs for AcceleratorProjectionExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Accelerator")?;
        self.projection.fmt_as(t, f)
    }
}

impl ExecutionPlan for AcceleratorProjectionExec {
    fn name(&self) -> &str {
        "AcceleratorProjectionExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.projection.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.projection.input()]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.projection.apply_expressions(f)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        self.projection.maintains_input_order()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        self.projection.benefits_from_input_partitioning()
    }

    fn supports_limit_pushdown(&self) -> bool {
        self.projection.supports_limit_pushdown()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let rebuilt = Arc::clone(&self.projection).replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )?;
        let projection = rebuilt
            .downcast_ref::<ProjectionExec>()
            .cloned()
            .ok_or_else(|| {
                DataFusionError::Internal("ProjectionExec rebuilt as another node".into())
            })?;
        Ok(Arc::new(Self::new(Arc::new(projection))))
    }

    /// The projection's output, queuing each next piece on the device before waiting for
    /// the current one ([`QueuedModelStream`]) when its model calls allow it.
    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        match ModelCalls::of(&self.projection) {
            Some(calls) => {
                let input = self.projection.input().execute(partition, context)?;
                Ok(Box::pin(QueuedModelStream::new(
                    self.projection.schema(),
                    input,
                    calls,
                )))
            }
            None => self.projection.execute(partition, context),
        }
    }
}

/// Physical optimizer rule: wrap projections that call accelerator UDFs (see module docs).
#[derive(Debug, Default)]
pub struct KeepAcceleratorProjections;

impl PhysicalOptimizerRule for KeepAcceleratorProjections {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let steps_on_cpu = config
            .extensions
            .get::<FlumenConfig>()
            .map(|flumen| flumen.preprocess_on_cpu)
            .unwrap_or_default();
        // First, so that the models below a TopK see only the rows it keeps.
        let plan = topk_before_models(plan)?;
        plan.transform_up(|node| {
            if let Some(filter) = node.downcast_ref::<FilterExec>()
                && calls_accelerator_udf(filter.predicate())
            {
                return Ok(Transformed::yes(plan_model_filter(
                    filter,
                    steps_on_cpu,
                    config,
                )?));
            }
            if let Some(aggregate) = node.downcast_ref::<AggregateExec>()
                && let Some(planned) = plan_model_aggregate(aggregate, steps_on_cpu, config)?
            {
                return Ok(Transformed::yes(planned));
            }
            if let Some(sort) = node.downcast_ref::<SortExec>()
                && sort.expr().iter().any(|e| calls_accelerator_udf(&e.expr))
            {
                return Ok(Transformed::yes(plan_model_sort(
                    sort,
                    steps_on_cpu,
                    config,
                )?));
            }
            if let Some(projection) = node.downcast_ref::<ProjectionExec>()
                && projection
                    .expr()
                    .iter()
                    .any(|e| calls_accelerator_udf(&e.expr))
            {
                return Ok(Transformed::yes(plan_model_projection(
                    projection,
                    steps_on_cpu,
                    config,
                )?));
            }
            Ok(Transformed::no(node))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "keep_accelerator_projections"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// A projection calling models, planned as operators: models whose arguments call models
/// first ([`split_nested_models`], one accelerator projection per level), then, per level,
/// the models' CPU steps, the CPU work below the models and the CPU work over their outputs
/// above them.
fn plan_model_projection(
    projection: &ProjectionExec,
    steps_on_cpu: PreprocessOnCpu,
    config: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    if let Some((inner, outer)) = split_nested_models(projection)? {
        let below = plan_model_projection(&inner, steps_on_cpu, config)?;
        let outer = ProjectionExec::try_new(outer, below)?;
        return plan_model_projection(&outer, steps_on_cpu, config);
    }
    let projection = match steps_on_cpu {
        PreprocessOnCpu::Never => projection.clone(),
        PreprocessOnCpu::Always => with_cpu_steps(projection, |_| true)?,
        // A model computing on the CPU shares its cores with the step anyway.
        PreprocessOnCpu::Auto => with_cpu_steps(projection, |function| {
            function.resources(config).accelerators > 0
        })?,
    };
    let projection = split_cpu_work(&projection)?;
    let (models, above) = split_model_consumers(&projection)?;
    let models = with_cache_lookups(&models, config)?;
    let wrapped: Arc<dyn ExecutionPlan> =
        Arc::new(AcceleratorProjectionExec::new(Arc::new(models)));
    Ok(match above {
        Some(exprs) => Arc::new(ProjectionExec::try_new(exprs, wrapped)?),
        None => wrapped,
    })
}

/// A filter whose predicate calls models, planned as operators: the conjuncts that call no
/// model filter first (the model never sees the rows they drop), a projection passes the
/// input's columns on and computes each model call once (an accelerator operator, planned by
/// [`plan_model_projection`]), the conjuncts over the models' results filter above it, and
/// that filter's projection keeps only the input's columns, so the output is the filter's.
fn plan_model_filter(
    filter: &FilterExec,
    steps_on_cpu: PreprocessOnCpu,
    config: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    let (over_models, plain): (Vec<_>, Vec<_>) = split_conjunction(filter.predicate())
        .into_iter()
        .cloned()
        .partition(calls_accelerator_udf);
    let input = Arc::clone(filter.input());
    let below: Arc<dyn ExecutionPlan> = if plain.is_empty() {
        input
    } else {
        Arc::new(
            FilterExecBuilder::new(conjunction(plain), input)
                .with_batch_size(filter.batch_size())
                .build()?,
        )
    };
    let input_schema = below.schema();
    // The columns the filter outputs first (the filter above keeps just those), then each
    // model call once and the columns its conditions read besides.
    let outputs: Vec<usize> = match filter.projection() {
        Some(projection) => projection.to_vec(),
        None => (0..input_schema.fields().len()).collect(),
    };
    let mut models = pass_through(&input_schema, outputs.iter().copied());
    let conditions = over_models
        .iter()
        .map(|c| lift_model_calls(c, &input_schema, &mut models))
        .collect::<Result<Vec<_>>>()?;
    let projection = ProjectionExec::try_new(models, below)?;
    let computed = plan_model_projection(&projection, steps_on_cpu, config)?;
    let above = FilterExecBuilder::from(filter)
        .with_predicate(conjunction(conditions))
        .with_input(computed)
        .apply_projection(None)?
        .apply_projection(Some((0..outputs.len()).collect()))?;
    Ok(Arc::new(above.build()?))
}

/// A sort whose keys call models, planned as operators: a projection passes the input's
/// columns on and computes each model call once (an accelerator operator), the sort orders
/// by the computed columns, and a projection above drops them.
fn plan_model_sort(
    sort: &SortExec,
    steps_on_cpu: PreprocessOnCpu,
    config: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    let input_schema = sort.input().schema();
    let columns = pass_through(&input_schema, 0..input_schema.fields().len());
    let mut models = columns.clone();
    let keys = sort
        .expr()
        .iter()
        .map(|key| {
            Ok(PhysicalSortExpr::new(
                lift_model_calls(&key.expr, &input_schema, &mut models)?,
                key.options,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let projection = ProjectionExec::try_new(models, Arc::clone(sort.input()))?;
    let computed = plan_model_projection(&projection, steps_on_cpu, config)?;
    let keys = LexOrdering::new(keys)
        .ok_or_else(|| DataFusionError::Internal("a sort without keys".into()))?;
    let sorted = SortExec::new(keys, computed)
        .with_fetch(sort.fetch())
        .with_preserve_partitioning(sort.preserve_partitioning());
    Ok(Arc::new(ProjectionExec::try_new(
        columns,
        Arc::new(sorted),
    )?))
}

/// An aggregate that evaluates model calls (in its arguments or grouping expressions; the
/// first phase, or the only one), planned as operators: a projection below computes each
/// model call once (an accelerator operator) and the aggregate reads its columns. The
/// aggregate's output (names, types, state fields) is unchanged. `None` when it calls no
/// model, or calls one where this does not reach (grouping sets, `FILTER`, an aggregate's
/// `ORDER BY`): those run as before.
fn plan_model_aggregate(
    aggregate: &AggregateExec,
    steps_on_cpu: PreprocessOnCpu,
    config: &ConfigOptions,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let evaluates_input = matches!(
        aggregate.mode(),
        AggregateMode::Partial | AggregateMode::Single | AggregateMode::SinglePartitioned
    );
    let group_by = aggregate.group_expr();
    let calls_model = group_by
        .expr()
        .iter()
        .any(|(e, _)| calls_accelerator_udf(e))
        || aggregate
            .aggr_expr()
            .iter()
            .any(|a| a.expressions().iter().any(calls_accelerator_udf));
    if !evaluates_input || !calls_model {
        return Ok(None);
    }
    let unreachable = !group_by.is_single()
        || aggregate
            .filter_expr()
            .iter()
            .flatten()
            .any(calls_accelerator_udf)
        || aggregate
            .aggr_expr()
            .iter()
            .any(|a| a.order_bys().iter().any(|o| calls_accelerator_udf(&o.expr)));
    if unreachable {
        return Ok(None);
    }
    let input = Arc::clone(aggregate.input());
    let input_schema = input.schema();
    // Only what the aggregate reads: each model call once, the columns it reads besides.
    let mut models: Vec<ProjectionExpr> = vec![];
    let groups = group_by
        .expr()
        .iter()
        .map(|(e, name)| {
            Ok((
                lift_model_calls(e, &input_schema, &mut models)?,
                name.clone(),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    // Each aggregate's arguments and its own `ORDER BY` (`first_value(x ORDER BY id)`), read
    // from the projection's columns.
    let mut lifted = vec![];
    for a in aggregate.aggr_expr() {
        let args = a
            .expressions()
            .iter()
            .map(|e| lift_model_calls(e, &input_schema, &mut models))
            .collect::<Result<Vec<_>>>()?;
        let order_bys = (a.order_bys().iter())
            .map(|o| {
                let expr = lift_model_calls(&o.expr, &input_schema, &mut models)?;
                Ok(PhysicalSortExpr::new(expr, o.options))
            })
            .collect::<Result<Vec<_>>>()?;
        lifted.push((a, args, order_bys));
    }
    // So do the aggregates' `FILTER (WHERE ...)` conditions.
    let filters = (aggregate.filter_expr().iter())
        .map(|filter| {
            (filter.as_ref())
                .map(|f| lift_model_calls(f, &input_schema, &mut models))
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    let projection = ProjectionExec::try_new(models, input)?;
    let computed = plan_model_projection(&projection, steps_on_cpu, config)?;
    let computed_schema = computed.schema();
    let aggregates = (lifted.into_iter())
        .map(|(a, args, order_bys)| {
            rebuilt_aggregate(a, args, order_bys, &computed_schema).map(Arc::new)
        })
        .collect::<Result<Vec<_>>>()?;
    let planned = AggregateExec::try_new(
        *aggregate.mode(),
        PhysicalGroupBy::new_single(groups),
        aggregates,
        filters,
        computed,
        computed_schema,
    )?
    .with_limit_options(aggregate.limit_options());
    let (want, got) = (aggregate.schema(), planned.schema());
    if want == got {
        return Ok(Some(Arc::new(planned)));
    }
    let same_types = want.fields().len() == got.fields().len()
        && (want.fields().iter().zip(got.fields()))
            .all(|(w, g)| w.data_type() == g.data_type() && w.is_nullable() == g.is_nullable());
    if !same_types {
        return Err(DataFusionError::Internal(format!(
            "moving model calls out of an aggregate changed its output: {want} became {got}"
        )));
    }
    // A first phase's state columns for an aggregate's own `ORDER BY` are named after its
    // ordering's columns with their places (`n@0`), which the projection moved: named back,
    // so the phase above reads the names it was planned with.
    let named_back = (want.fields().iter().zip(got.fields()).enumerate())
        .map(|(i, (w, g))| ProjectionExpr {
            expr: Arc::new(Column::new(g.name(), i)),
            alias: w.name().clone(),
        })
        .collect::<Vec<_>>();
    Ok(Some(Arc::new(ProjectionExec::try_new(
        named_back,
        Arc::new(planned),
    )?)))
}

/// `aggregate` over another input: `args` and `order_bys` read from `schema`, everything
/// else as it was. Built afresh rather than by `with_new_expressions`, which keeps the old
/// input's schema (apache/datafusion#18149): DataFusion's `reverse_expr` (a `first_value`
/// turned `last_value` for an input sorted the other way) built from it, typing `x` by
/// whichever column had its place in the old input ("expected Int64 but found Date32", or a
/// panic reading an array as another type).
fn rebuilt_aggregate(
    aggregate: &AggregateFunctionExpr,
    args: Vec<Arc<dyn PhysicalExpr>>,
    order_bys: Vec<PhysicalSortExpr>,
    schema: &datafusion::arrow::datatypes::SchemaRef,
) -> Result<AggregateFunctionExpr> {
    let mut builder = AggregateExprBuilder::new(Arc::new(aggregate.fun().clone()), args)
        .order_by(order_bys)
        .schema(Arc::clone(schema))
        .alias(aggregate.name())
        .with_ignore_nulls(aggregate.ignore_nulls())
        .with_distinct(aggregate.is_distinct())
        .with_reversed(aggregate.is_reversed());
    if let Some(display) = aggregate.human_display() {
        builder = builder.human_display(display);
        if let Some(alias) = aggregate.human_display_alias() {
            builder = builder.human_display_alias(alias);
        }
    }
    builder.build()
}

/// Models over models (`model_b(post(model_a(x)))`) as a chain of levels: `None` when no
/// model call has an argument that calls a model; otherwise a projection computing the
/// innermost model calls (those whose arguments call none) beside the input columns still
/// needed, and the expressions of the projection above it that read their results. Each
/// level then becomes an accelerator operator of its own, and CPU work between two models
/// (`post`) a CPU operator between them, so a model's worker never waits on another model
/// or on CPU work.
pub fn split_nested_models(
    projection: &ProjectionExec,
) -> Result<Option<(ProjectionExec, Vec<ProjectionExpr>)>> {
    let nested = |e: &Arc<dyn PhysicalExpr>| {
        let mut found = false;
        e.apply(|node| {
            if is_model_call(node) && node.children().into_iter().any(calls_accelerator_udf) {
                found = true;
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .map(|_| found)
    };
    let mut any_nested = false;
    for e in projection.expr() {
        any_nested |= nested(&e.expr)?;
    }
    if !any_nested {
        return Ok(None);
    }
    let input = projection.input();
    let input_len = input.schema().fields().len();
    // Replace each innermost model call by a column numbered after the input's columns.
    let mut innermost: Vec<Arc<dyn PhysicalExpr>> = vec![];
    let mut outer = vec![];
    for e in projection.expr() {
        let expr = Arc::clone(&e.expr).transform_down(|node| {
            if !is_model_call(&node) || node.children().into_iter().any(calls_accelerator_udf) {
                return Ok(Transformed::no(node));
            }
            let column = hoisted_column(&node, input_len, &mut innermost);
            Ok(Transformed::new(column, true, TreeNodeRecursion::Jump))
        })?;
        outer.push((expr.data, e.alias.clone()));
    }
    // The model calls go below under names no input column has.
    let input_schema = input.schema();
    let taken = |name: &str| input_schema.fields().iter().any(|f| f.name() == name);
    let names = (0..)
        .map(|k| format!("__flumen_level_{k}"))
        .filter(|name| !taken(name))
        .take(innermost.len())
        .collect();
    let (inner, outer) = hoist_below(input, outer, innermost, names)?;
    Ok(Some((inner, outer)))
}

/// `projection` with every model call whose function declares a CPU step (and passes
/// `split`) taking the step's result in place of its arguments: `embed(x)` →
/// `embed(embed_tokens(x))`. Calls whose arguments call a model themselves keep their
/// arguments (the step would run in the accelerator operator anyway), and so do calls already
/// over the step's result.
pub fn with_cpu_steps(
    projection: &ProjectionExec,
    split: impl Fn(&Arc<dyn AcceleratorFunction>) -> bool,
) -> Result<ProjectionExec> {
    let schema = projection.input().schema();
    let mut changed = false;
    let mut exprs = vec![];
    for e in projection.expr() {
        let expr = Arc::clone(&e.expr).transform_up(|node| {
            let Some(step) = called_accelerator_function(&node)
                .filter(|f| split(f))
                .and_then(|f| f.cpu_step())
            else {
                return Ok(Transformed::no(node));
            };
            let call = as_any(&node)
                .downcast_ref::<ScalarFunctionExpr>()
                .expect("a model call is a ScalarFunctionExpr");
            let already_stepped = call.args().iter().any(|arg| {
                as_any(arg)
                    .downcast_ref::<ScalarFunctionExpr>()
                    .is_some_and(|inner| inner.name() == step.name())
            });
            if already_stepped || call.args().iter().any(calls_accelerator_udf) {
                return Ok(Transformed::no(node));
            }
            let config = Arc::new(call.config_options().clone());
            let stepped = ScalarFunctionExpr::try_new(
                step,
                call.args().to_vec(),
                &schema,
                Arc::clone(&config),
            )?;
            // The model's result type does not depend on how its input was prepared.
            let model = ScalarFunctionExpr::new(
                call.name(),
                Arc::new(call.fun().clone()),
                vec![Arc::new(stepped)],
                call.return_field(&schema)?,
                config,
            );
            Ok(Transformed::yes(Arc::new(model) as Arc<dyn PhysicalExpr>))
        })?;
        changed |= expr.transformed;
        exprs.push(ProjectionExpr {
            expr: expr.data,
            alias: e.alias.clone(),
        });
    }
    if !changed {
        return Ok(projection.clone());
    }
    ProjectionExec::try_new(exprs, Arc::clone(projection.input()))
}

/// Split a projection calling accelerator UDFs in two: a plain projection below that computes
/// the CPU work (every argument of a model call that is neither a column nor a literal nor
/// itself calls a model, and every output expression that calls no model), and the returned
/// projection above it that only calls the models over columns. Without CPU work, the
/// projection comes back unchanged.
pub fn split_cpu_work(projection: &ProjectionExec) -> Result<ProjectionExec> {
    let input = projection.input();
    let input_schema = input.schema();
    let input_len = input_schema.fields().len();
    let mut hoisted: Vec<Arc<dyn PhysicalExpr>> = vec![];
    let mut upper = vec![];
    for e in projection.expr() {
        let expr = if !calls_accelerator_udf(&e.expr) && is_cpu_work(&e.expr) {
            hoisted_column(&e.expr, input_len, &mut hoisted)
        } else {
            hoist_model_arguments(&e.expr, input_len, &mut hoisted)?
        };
        upper.push((expr, e.alias.clone()));
    }
    if hoisted.is_empty() {
        return Ok(projection.clone());
    }
    let names = (0..hoisted.len()).map(hoisted_name).collect();
    let (lower, upper) = hoist_below(input, upper, hoisted, names)?;
    ProjectionExec::try_new(upper, Arc::new(lower))
}

/// The two projections that compute `upper` (expressions over `input`'s columns and over
/// the columns of `hoisted`, numbered after the input's as [`hoisted_column`] makes them) in
/// two steps: the one below passes on the input columns read above, then computes
/// `hoisted` under `names`; the expressions above are renumbered to read its output.
fn hoist_below(
    input: &Arc<dyn ExecutionPlan>,
    upper: Vec<(Arc<dyn PhysicalExpr>, String)>,
    hoisted: Vec<Arc<dyn PhysicalExpr>>,
    names: Vec<String>,
) -> Result<(ProjectionExec, Vec<ProjectionExpr>)> {
    let input_schema = input.schema();
    let input_len = input_schema.fields().len();
    let mut used: Vec<Column> = upper
        .iter()
        .flat_map(|(e, _)| collect_columns(e))
        .filter(|c| c.index() < input_len)
        .collect();
    used.sort_by_key(|c| c.index());
    used.dedup_by_key(|c| c.index());
    // Where each column read above is found below: (name, position).
    let mut below: Vec<Option<(String, usize)>> = vec![None; input_len + hoisted.len()];
    let mut lower = vec![];
    for column in &used {
        let alias = input_schema.field(column.index()).name().clone();
        below[column.index()] = Some((alias.clone(), lower.len()));
        lower.push(ProjectionExpr {
            expr: Arc::new(column.clone()) as Arc<dyn PhysicalExpr>,
            alias,
        });
    }
    for (k, (expr, alias)) in hoisted.into_iter().zip(names).enumerate() {
        below[input_len + k] = Some((alias.clone(), lower.len()));
        lower.push(ProjectionExpr { expr, alias });
    }
    let lower = ProjectionExec::try_new(lower, Arc::clone(input))?;
    let upper = upper
        .into_iter()
        .map(|(expr, alias)| {
            let expr = expr
                .transform(|node| {
                    Ok(match as_any(&node).downcast_ref::<Column>() {
                        Some(c) => {
                            let (name, index) = below[c.index()]
                                .clone()
                                .expect("every column read above is passed on below");
                            Transformed::yes(
                                Arc::new(Column::new(&name, index)) as Arc<dyn PhysicalExpr>
                            )
                        }
                        None => Transformed::no(node),
                    })
                })?
                .data;
            Ok(ProjectionExpr { expr, alias })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((lower, upper))
}

/// Split off the CPU work that consumes model outputs (`cosine_similarity(embed(a), v)`):
/// the returned projection computes only the model calls (and passes on the columns the rest
/// needs); the expressions returned with it, for a plain projection above, compute the rest
/// on the CPU pool. `None` when every output is a model call, a column or a literal.
pub fn split_model_consumers(
    projection: &ProjectionExec,
) -> Result<(ProjectionExec, Option<Vec<ProjectionExpr>>)> {
    let consumes_model = |e: &Arc<dyn PhysicalExpr>| calls_accelerator_udf(e) && !is_model_call(e);
    if !projection.expr().iter().any(|e| consumes_model(&e.expr)) {
        return Ok((projection.clone(), None));
    }
    let input_schema = projection.input().schema();
    let mut models: Vec<ProjectionExpr> = vec![];
    let mut above = vec![];
    for e in projection.expr() {
        let expr = if consumes_model(&e.expr) {
            lift_model_calls(&e.expr, &input_schema, &mut models)?
        } else {
            let k = models.len();
            models.push(e.clone());
            Arc::new(Column::new(&e.alias, k)) as Arc<dyn PhysicalExpr>
        };
        above.push(ProjectionExpr {
            expr,
            alias: e.alias.clone(),
        });
    }
    let below = ProjectionExec::try_new(models, Arc::clone(projection.input()))?;
    Ok((below, Some(above)))
}

/// True when `expr` itself is a call of an accelerator UDF.
fn is_model_call(expr: &Arc<dyn PhysicalExpr>) -> bool {
    called_accelerator_function(expr).is_some()
}

/// `expr` reading the outputs of the model projection `models`: each model call and each
/// input column becomes one of its outputs (an equal one is reused).
fn lift_model_calls(
    expr: &Arc<dyn PhysicalExpr>,
    input_schema: &datafusion::arrow::datatypes::SchemaRef,
    models: &mut Vec<ProjectionExpr>,
) -> Result<Arc<dyn PhysicalExpr>> {
    let column = as_any(expr).downcast_ref::<Column>();
    if is_model_call(expr) || column.is_some() {
        let k = match models.iter().position(|m| &m.expr == expr) {
            Some(k) => k,
            None => {
                let name = match column {
                    Some(c) if !models.iter().any(|m| m.alias == c.name()) => {
                        input_schema.field(c.index()).name().clone()
                    }
                    _ => format!("__flumen_model_{}", models.len()),
                };
                models.push(ProjectionExpr {
                    expr: Arc::clone(expr),
                    alias: name,
                });
                models.len() - 1
            }
        };
        return Ok(Arc::new(Column::new(&models[k].alias, k)));
    }
    let children = expr.children();
    if children.is_empty() {
        return Ok(Arc::clone(expr));
    }
    let children = children
        .into_iter()
        .map(|child| lift_model_calls(child, input_schema, models))
        .collect::<Result<Vec<_>>>()?;
    Arc::clone(expr).with_new_children(children)
}

/// Projection expressions passing on `schema`'s columns `indices` under their own names.
fn pass_through(
    schema: &datafusion::arrow::datatypes::SchemaRef,
    indices: impl IntoIterator<Item = usize>,
) -> Vec<ProjectionExpr> {
    indices
        .into_iter()
        .map(|i| {
            let name = schema.field(i).name();
            ProjectionExpr {
                expr: Arc::new(Column::new(name, i)) as Arc<dyn PhysicalExpr>,
                alias: name.clone(),
            }
        })
        .collect()
}

/// Name of the `k`-th column computed below an accelerator projection.
fn hoisted_name(k: usize) -> String {
    format!("__flumen_cpu_{k}")
}

/// True for an expression that is CPU work worth moving below the model call: not a column,
/// not a literal, and calling no model itself.
fn is_cpu_work(expr: &Arc<dyn PhysicalExpr>) -> bool {
    as_any(expr).downcast_ref::<Column>().is_none()
        && as_any(expr).downcast_ref::<Literal>().is_none()
        && !calls_accelerator_udf(expr)
}

/// A column standing for `expr`, computed below as the `k`-th hoisted expression (an equal
/// expression hoisted before is reused).
fn hoisted_column(
    expr: &Arc<dyn PhysicalExpr>,
    input_len: usize,
    hoisted: &mut Vec<Arc<dyn PhysicalExpr>>,
) -> Arc<dyn PhysicalExpr> {
    let k = match hoisted.iter().position(|h| h == expr) {
        Some(k) => k,
        None => {
            hoisted.push(Arc::clone(expr));
            hoisted.len() - 1
        }
    };
    Arc::new(Column::new(&hoisted_name(k), input_len + k))
}

/// `expr` with every CPU-work argument of its model calls replaced by a hoisted column.
fn hoist_model_arguments(
    expr: &Arc<dyn PhysicalExpr>,
    input_len: usize,
    hoisted: &mut Vec<Arc<dyn PhysicalExpr>>,
) -> Result<Arc<dyn PhysicalExpr>> {
    let children = expr.children();
    if children.is_empty() {
        return Ok(Arc::clone(expr));
    }
    let model_call = is_model_call(expr);
    let children = children
        .into_iter()
        .map(|child| {
            if model_call && is_cpu_work(child) {
                Ok(hoisted_column(child, input_len, hoisted))
            } else {
                hoist_model_arguments(child, input_len, hoisted)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Arc::clone(expr).with_new_children(children)
}

fn as_any(expr: &Arc<dyn PhysicalExpr>) -> &dyn std::any::Any {
    expr.as_ref()
}
