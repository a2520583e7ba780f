//! The model-output cache's lookup, planned into the CPU stage that feeds a model.
//!
//! With `flumen.model_cache` set, each call of a cacheable model ([`cache_identity`]) in an
//! accelerator projection is rewritten ([`with_cache_lookups`]) so that:
//!
//! 1. the CPU stage computes each row's key from the model's *original* arguments, before
//!    its CPU step (`model_cache_key(identity, body)`: the same key whether the tokenizer
//!    runs on the CPU or in the model's worker), then looks it up
//!    (`model_cache_get(identity, key, NULL)`: `{found, value}` per row);
//! 2. the CPU step runs for the misses only (`CASE WHEN NOT hit['found'] THEN
//!    embed_tokens(body) END`);
//! 3. the model operator computes the misses only and writes them to the cache
//!    (`model_cache_fill(identity, hit, key, CASE WHEN NOT hit['found'] THEN embed(tokens)
//!    END)`):
//!    a `CASE` evaluates its branch over the rows it selects alone, so the model sees no hit,
//!    and a block whose every row hit loads no model at all.
//!
//! The identity is the function's where the query is planned: a host whose model files or
//! device differ would compute different outputs for the same key (see `docs/model-cache.md`).
//!
//! [`cache_identity`]: crate::functions::accelerator::AcceleratorFunction::cache_identity

use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::ScalarUDF;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{CaseExpr, Column, Literal, NotExpr};
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::config::FlumenConfig;
use crate::functions::accelerator::{
    accelerator_function, called_accelerator_udf, calls_accelerator_udf,
};
use crate::functions::model_cache::functions::{FILL, GET, KEY, model_cache_functions};

/// One cacheable model call of the projection: where it is and what it is keyed by.
struct CachedModelCall {
    /// The function's cache identity, in words.
    identity: String,
    /// The call's arguments before its CPU step, over the input of the CPU projection.
    raw_args: Vec<Arc<dyn PhysicalExpr>>,
    /// The column of the CPU projection that holds the step's result, when the model takes
    /// one and nothing else reads it.
    step_column: Option<usize>,
}

/// `models` (an accelerator projection whose model calls read columns of its input, as
/// [`split_cpu_work`](super::accelerator_projection::split_cpu_work) leaves it) with the
/// cache's lookup in the CPU work below it and its fill around each cacheable model call
/// (see the module docs); `models` unchanged when the session has no cache or no call is
/// cacheable.
pub fn with_cache_lookups(
    models: &ProjectionExec,
    config: &ConfigOptions,
) -> Result<ProjectionExec> {
    let cache_on = config
        .extensions
        .get::<FlumenConfig>()
        .is_some_and(|flumen| !flumen.model_cache.trim().is_empty());
    if !cache_on {
        return Ok(models.clone());
    }
    let lower = models.input();
    // The CPU work below the models, as expressions over `base`.
    let (base, lower_exprs) = match lower.downcast_ref::<ProjectionExec>() {
        Some(projection) => (Arc::clone(projection.input()), projection.expr().to_vec()),
        None => (Arc::clone(lower), pass_through(lower, 0)),
    };
    let mut calls: Vec<(usize, CachedModelCall)> = vec![];
    for (output, e) in models.expr().iter().enumerate() {
        let Some((call, udf)) = called_accelerator_udf(&e.expr) else {
            continue;
        };
        if call.args().iter().any(calls_accelerator_udf) {
            continue;
        }
        let Some(identity) = udf.function().cache_identity(config)? else {
            continue;
        };
        let resolved: Option<Vec<Arc<dyn PhysicalExpr>>> = (call.args().iter())
            .map(|arg| resolve(arg, &lower_exprs))
            .collect();
        let Some(resolved) = resolved else {
            continue;
        };
        let step = udf.function().cpu_step().map(|s| s.name().to_string());
        let stepped = match (call.args(), resolved.as_slice()) {
            ([arg], [value]) => (value.downcast_ref::<ScalarFunctionExpr>())
                .filter(|f| Some(f.name()) == step.as_deref())
                .zip(arg.downcast_ref::<Column>()),
            _ => None,
        };
        let (raw_args, step_column) = match stepped {
            Some((step_call, column)) => {
                let read_elsewhere = (models.expr().iter().enumerate())
                    .any(|(k, other)| k != output && reads_column(&other.expr, column.index()));
                let only_reader = (!read_elsewhere).then_some(column.index());
                (step_call.args().to_vec(), only_reader)
            }
            None => (resolved, None),
        };
        calls.push((
            output,
            CachedModelCall {
                identity,
                raw_args,
                step_column,
            },
        ));
    }
    if calls.is_empty() {
        return Ok(models.clone());
    }
    let [key_udf, get_udf, fill_udf] = cache_udfs();
    let options = Arc::new(config.clone());

    // Keys over the base's columns.
    let base_len = base.schema().fields().len();
    let mut keyed = pass_through(&base, 0);
    for (j, (_, call)) in calls.iter().enumerate() {
        let mut args = vec![literal(&call.identity)];
        args.extend(call.raw_args.iter().cloned());
        let key = ScalarFunctionExpr::try_new(
            Arc::clone(&key_udf),
            args,
            &base.schema(),
            Arc::clone(&options),
        )?;
        keyed.push(ProjectionExpr::new(Arc::new(key), key_name(j)));
    }
    let keyed: Arc<dyn ExecutionPlan> = Arc::new(ProjectionExec::try_new(keyed, base)?);

    // The lookups, beside the keys.
    let mut looked_up = pass_through(&keyed, 0);
    for (j, (output, call)) in calls.iter().enumerate() {
        let return_type = models.schema().field(*output).data_type().clone();
        let args = vec![
            literal(&call.identity),
            Arc::new(Column::new(&key_name(j), base_len + j)) as Arc<dyn PhysicalExpr>,
            Arc::new(Literal::new(ScalarValue::try_new_null(&return_type)?)),
        ];
        let hit = ScalarFunctionExpr::try_new(
            Arc::clone(&get_udf),
            args,
            &keyed.schema(),
            Arc::clone(&options),
        )?;
        looked_up.push(ProjectionExpr::new(Arc::new(hit), hit_name(j)));
    }
    let looked_up: Arc<dyn ExecutionPlan> = Arc::new(ProjectionExec::try_new(looked_up, keyed)?);
    let hit_at = |j: usize| base_len + calls.len() + j;

    // The CPU work as before, a step only for the misses, and the keys and hits passed on.
    let mut work = lower_exprs;
    for (j, (_, call)) in calls.iter().enumerate() {
        if let Some(column) = call.step_column {
            let hit = Arc::new(Column::new(&hit_name(j), hit_at(j)));
            let missed = missed(hit, &looked_up.schema(), &options)?;
            let step = Arc::clone(&work[column].expr);
            work[column].expr = Arc::new(CaseExpr::try_new(None, vec![(missed, step)], None)?);
        }
    }
    let work_len = work.len();
    for j in 0..calls.len() {
        work.push(ProjectionExpr::new(
            Arc::new(Column::new(&key_name(j), base_len + j)),
            key_name(j),
        ));
        work.push(ProjectionExpr::new(
            Arc::new(Column::new(&hit_name(j), hit_at(j))),
            hit_name(j),
        ));
    }
    let work: Arc<dyn ExecutionPlan> = Arc::new(ProjectionExec::try_new(work, looked_up)?);

    // The model calls, for the misses only, filled in around the hits.
    let mut exprs = models.expr().to_vec();
    for (j, (output, call)) in calls.iter().enumerate() {
        let hit = Arc::new(Column::new(&hit_name(j), work_len + 2 * j + 1));
        let key = Arc::new(Column::new(&key_name(j), work_len + 2 * j));
        let missed = missed(Arc::clone(&hit) as _, &work.schema(), &options)?;
        let model = Arc::clone(&exprs[*output].expr);
        let computed = Arc::new(CaseExpr::try_new(None, vec![(missed, model)], None)?);
        let fill = ScalarFunctionExpr::try_new(
            Arc::clone(&fill_udf),
            vec![literal(&call.identity), hit, key, computed],
            &work.schema(),
            Arc::clone(&options),
        )?;
        exprs[*output].expr = Arc::new(fill);
    }
    ProjectionExec::try_new(exprs, work)
}

/// Whether calls of `udf` (an accelerator UDF) get the cache's lookup under `config`: the
/// session has a cache and the function is deterministic.
pub fn cache_may_answer(udf: &ScalarUDF, config: &ConfigOptions) -> bool {
    let cache_on = config
        .extensions
        .get::<FlumenConfig>()
        .is_some_and(|flumen| !flumen.model_cache.trim().is_empty());
    cache_on
        && accelerator_function(udf)
            .is_some_and(|f| f.cache_identity(config).ok().flatten().is_some())
}

/// What the cache lookups of a task that ran `plan` read in this process, by name, taken
/// when the task ends: the figures of the CPU operator that looks up, on a driver's
/// threads or in a worker alike. None when the session (`flumen`) has no cache.
pub fn take_lookup_figures(
    plan: &Arc<dyn ExecutionPlan>,
    flumen: &FlumenConfig,
) -> Vec<(String, u64)> {
    if flumen.model_cache.trim().is_empty() {
        return vec![];
    }
    crate::functions::model_cache::take_read_figures(
        &looked_up_identities(plan),
        &flumen.model_cache,
    )
}

/// The identities whose caches `plan` looks up (its `model_cache_get` calls, in any
/// node), each once: a task running `plan` takes their read figures when it ends
/// ([`take_read_figures`](crate::functions::model_cache::take_read_figures)).
pub fn looked_up_identities(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut identities: Vec<String> = vec![];
    let _ = plan.apply(|node| {
        node.apply_expressions(&mut |expr: &Arc<dyn PhysicalExpr>| {
            expr.apply(|e| {
                if let Some(call) = e.downcast_ref::<ScalarFunctionExpr>()
                    && call.name() == GET
                    && let Some(first) = call.args().first()
                    && let Some(literal) = first.downcast_ref::<Literal>()
                    && let ScalarValue::Utf8(Some(identity)) = literal.value()
                    && !identities.contains(identity)
                {
                    identities.push(identity.clone());
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    identities
}

/// `NOT get_field(hit, 'found')`: whether the lookup in column `hit` missed.
fn missed(
    hit: Arc<dyn PhysicalExpr>,
    schema: &SchemaRef,
    options: &Arc<ConfigOptions>,
) -> Result<Arc<dyn PhysicalExpr>> {
    let found = ScalarFunctionExpr::try_new(
        datafusion::functions::core::get_field(),
        vec![hit, literal("found")],
        schema,
        Arc::clone(options),
    )?;
    Ok(Arc::new(NotExpr::new(Arc::new(found))))
}

/// The key, lookup and fill functions, in that order.
fn cache_udfs() -> [Arc<ScalarUDF>; 3] {
    let mut functions = model_cache_functions();
    let mut take = |name: &str| {
        let at = (functions.iter())
            .position(|f| f.name() == name)
            .expect("the model cache's functions");
        Arc::new(functions.remove(at))
    };
    [take(KEY), take(GET), take(FILL)]
}

/// `arg` (an argument of a model call over the CPU projection's columns) as an expression
/// over that projection's input; `None` for anything but a column or a literal.
fn resolve(
    arg: &Arc<dyn PhysicalExpr>,
    lower_exprs: &[ProjectionExpr],
) -> Option<Arc<dyn PhysicalExpr>> {
    if let Some(column) = arg.downcast_ref::<Column>() {
        return lower_exprs.get(column.index()).map(|e| Arc::clone(&e.expr));
    }
    arg.downcast_ref::<Literal>().map(|_| Arc::clone(arg))
}

/// Whether `expr` reads column `index` of its input.
fn reads_column(expr: &Arc<dyn PhysicalExpr>, index: usize) -> bool {
    let mut found = false;
    let _ = expr.apply(|node| {
        if node
            .downcast_ref::<Column>()
            .is_some_and(|c| c.index() == index)
        {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// Every column of `plan`'s output from `from` on, passed on under its name.
fn pass_through(plan: &Arc<dyn ExecutionPlan>, from: usize) -> Vec<ProjectionExpr> {
    let schema = plan.schema();
    (from..schema.fields().len())
        .map(|i| {
            let name = schema.field(i).name();
            ProjectionExpr::new(Arc::new(Column::new(name, i)), name.clone())
        })
        .collect()
}

fn literal(text: &str) -> Arc<dyn PhysicalExpr> {
    Arc::new(Literal::new(ScalarValue::Utf8(Some(text.to_string()))))
}

fn key_name(j: usize) -> String {
    format!("__flumen_cache_key_{j}")
}

fn hit_name(j: usize) -> String {
    format!("__flumen_cache_hit_{j}")
}
