//! Sessions: a DataFusion `SessionContext` whose queries run on flumen (new, on a caller's
//! `SessionConfig`, or converted from an existing context), with flumen's functions,
//! table formats and object-store options registered; `RESET flumen.<name>`
//! ([`reset_flumen_setting`]).

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::execution::cache::cache_manager::{
    CacheManager, DEFAULT_FILE_STATISTICS_MEMORY_LIMIT, DEFAULT_LIST_FILES_CACHE_MEMORY_LIMIT,
    DEFAULT_METADATA_CACHE_LIMIT,
};
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::logical_expr::LogicalPlan;
use datafusion::optimizer::AnalyzerRule;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::prelude::{DataFrame, SessionConfig, SessionContext};

use crate::cluster::WorkerPoolSlot;
use crate::config::FlumenConfig;
use crate::exec::{AcceleratorPool, FlumenQueryPlanner};
use crate::functions::accelerator::accelerator_udf;
use crate::functions::{embedding, percentile_cont, row_hash, text, timestamp_time_zone, vector};
#[cfg(feature = "delta")]
use crate::io::delta;
use crate::io::{iceberg, object_stores};
use crate::plan::row_group_layout::LayoutCache;
use crate::plan::{
    accelerator_projection, aggregate_bound_reads, counted_set_operations, dropped_clauses,
    fixed_size_list_casts, grouping_set_constants, ordered_round_robins, outer_join_constants,
    partitioned_outer_joins, plain_hash_exchanges, random_shuffle, semi_joins_by_key_set,
    table_samples,
};

/// A DataFusion `SessionContext` whose queries run on flumen, with default DataFusion
/// settings and the given flumen settings.
pub fn session(config: FlumenConfig) -> SessionContext {
    session_with_config(SessionConfig::new(), config)
}

/// A flumen `SessionContext` built on the caller's DataFusion `SessionConfig`.
pub fn session_with_config(session_config: SessionConfig, config: FlumenConfig) -> SessionContext {
    let budget = config.memory_budget.0;
    let state = SessionStateBuilder::new()
        .with_config(flumen_session_config(session_config, config))
        .with_default_features()
        .with_query_planner(Arc::new(FlumenQueryPlanner::default()))
        .build();
    size_file_caches(&state.runtime_env().cache_manager, budget);
    let ctx = SessionContext::new_with_state(keep_accelerator_projections(state));
    register_functions(&ctx);
    object_stores::register_table_options(&ctx);
    register_table_factories(&ctx);
    ctx
}

/// Plan `sql` as flumen's shell, server and Python module do: DataFusion's parser, then
/// the clauses DataFusion would drop or refuse rewritten in the syntax tree
/// ([`dropped_clauses`]: `GROUP BY ... WITH ROLLUP`, `FETCH FIRST n ROWS ONLY`), then
/// DataFusion's planner (as `SessionState::create_logical_plan`).
pub async fn logical_plan(state: &SessionState, sql: &str) -> Result<LogicalPlan> {
    let dialect = state.config().options().sql_parser.dialect;
    let mut statement = state.sql_to_statement(sql, &dialect)?;
    dropped_clauses::rewrite_dropped_clauses(&mut statement)?;
    state.statement_to_plan(statement).await
}

/// `ctx.sql(sql)`, planned through [`logical_plan`].
pub async fn sql(ctx: &SessionContext, sql: &str) -> Result<DataFrame> {
    let plan = logical_plan(&ctx.state(), sql).await?;
    ctx.execute_logical_plan(plan).await
}

/// One statement a user typed, as flumen's shell and Python module run it: `RESET
/// flumen.<name>` done at once ([`reset_flumen_setting`]), the object store of every URL it
/// reads or writes registered first (`s3://`, `gs://`, ...: [`crate::io::register_for_statement`]),
/// then [`sql`]; a location that could not be read as a table says why
/// ([`crate::io::url_tables::explain_table_error`]: "no file found there" instead of "table
/// '...' not found", the files on each side of a column's type conflict).
pub async fn user_statement(ctx: &SessionContext, sql: &str) -> Result<DataFrame> {
    if let Some(done) = reset_flumen_setting(ctx, sql)? {
        return Ok(done);
    }
    crate::io::register_for_statement(ctx, sql)?;
    match self::sql(ctx, sql).await {
        Ok(df) => Ok(df),
        Err(e) => Err(crate::io::url_tables::explain_table_error(ctx, sql, e).await),
    }
}

/// Size a new session's DataFusion file caches from its memory budget (`budget` bytes),
/// never below DataFusion's defaults: footers 1/8 of it (256 MiB of a 2 GiB budget; 50 MB
/// by default), the listing's file statistics 1/32 (64 MiB; 20 MiB), file lists 1/256
/// (8 MiB; 1 MiB). A table of 20,000 small files of four columns outgrew the defaults, and
/// its files, read in the same order by every query, never hit the LRU caches: every query
/// read every footer again (a point lookup took 5.5 s, 0.7 s with the files cached). The
/// caches are sized from the budget, not charged to it: they are bounded, and held only
/// as files are read. `SET datafusion.runtime.*_cache_limit` still sets them.
fn size_file_caches(caches: &CacheManager, budget: u64) {
    let share = |fraction: u64, default: usize| {
        usize::try_from(budget / fraction)
            .unwrap_or(usize::MAX)
            .max(default)
    };
    let metadata = caches.get_file_metadata_cache();
    metadata.update_cache_limit(share(8, DEFAULT_METADATA_CACHE_LIMIT));
    if let Some(statistics) = caches.get_file_statistic_cache() {
        statistics.update_cache_limit(share(32, DEFAULT_FILE_STATISTICS_MEMORY_LIMIT));
    }
    if let Some(lists) = caches.get_list_files_cache() {
        lists.update_cache_limit(share(256, DEFAULT_LIST_FILES_CACHE_MEMORY_LIMIT));
    }
}

/// Register flumen's SQL functions: `embed` and its CPU step `embed_tokens`, `clean_text`,
/// `row_hash` and the vector helpers (`cosine_similarity`, `dot_product`, `l2_distance`),
/// `percentile_cont` in place of DataFusion's ([`percentile_cont`]), the rule that makes
/// casts to fixed-size lists read sliced lists right ([`fixed_size_list_casts`]), and the
/// one that makes `INTERSECT ALL` and `EXCEPT ALL` count copies ([`counted_set_operations`]),
/// and `to_timestamp` whose column results carry the session's time zone
/// ([`timestamp_time_zone`]); and the planner of `TABLESAMPLE` ([`table_samples`]).
pub fn register_functions(ctx: &SessionContext) {
    ctx.register_udaf(percentile_cont::percentile_cont_udaf().as_ref().clone());
    ctx.register_udf(fixed_size_list_casts::unsliced_lists_udf());
    // Last (once), after the simplifier has turned `arrow_cast` calls into casts.
    ctx.remove_optimizer_rule("unsliced_list_casts");
    ctx.add_optimizer_rule(Arc::new(fixed_size_list_casts::UnslicedListCasts));
    let counted = counted_set_operations::CountedSetOperations;
    let state = ctx.state();
    if !state
        .analyzer()
        .rules
        .iter()
        .any(|rule| rule.name() == counted.name())
    {
        ctx.add_analyzer_rule(Arc::new(counted));
    }
    // `to_timestamp` and its unit forms: column results in the session's time zone.
    for name in timestamp_time_zone::TIMESTAMP_FUNCTIONS {
        if let Some(udf) = state.scalar_functions().get(*name) {
            ctx.register_udf(timestamp_time_zone::with_time_zone(udf));
        }
    }
    ctx.register_udf(accelerator_udf(embedding::EmbedFunction::default()));
    ctx.register_udf(
        embedding::tokenize_step::embed_tokens_udf()
            .as_ref()
            .clone(),
    );
    ctx.register_udf(text::clean_text_udf());
    ctx.register_udf(row_hash::row_hash_udf());
    for udf in vector::vector_functions() {
        ctx.register_udf(udf);
    }
    for udf in crate::functions::model_cache::functions::model_cache_functions() {
        ctx.register_udf(udf);
    }
    // `TABLESAMPLE`, once (DataFusion 55 parses it and drops it).
    let samples = Arc::new(table_samples::TableSamples);
    let registered = format!("{samples:?}");
    if !(state.relation_planners().iter()).any(|p| format!("{p:?}") == registered) {
        ctx.register_relation_planner(samples)
            .expect("a session takes relation planners");
    }
}

/// Register flumen's lakehouse table formats: `STORED AS DELTATABLE` (Delta Lake) and
/// `STORED AS ICEBERG`, and `table_changes(...)` (a Delta table's change data feed); Delta's
/// need the cargo feature `delta` (on by default). And the table functions that read files:
/// `read_parquet(path)`, `read_csv`, `read_json`, `read_avro`, `read_arrow`,
/// `parquet_metadata(path)` and `glob(pattern)`.
pub fn register_table_factories(ctx: &SessionContext) {
    let state = ctx.state_ref();
    let mut state = state.write();
    let factories = state.table_factories_mut();
    #[cfg(feature = "delta")]
    factories.insert("DELTATABLE".into(), Arc::new(delta::DeltaTableFactory));
    factories.insert("ICEBERG".into(), Arc::new(iceberg::IcebergTableFactory));
    drop(state);
    #[cfg(feature = "delta")]
    ctx.register_udtf("table_changes", Arc::new(crate::io::TableChanges));
    crate::io::register_file_functions(ctx);
    ctx.register_udtf("parquet_metadata", Arc::new(crate::io::ParquetMetadata));
    ctx.register_udtf("glob", Arc::new(crate::io::Glob));
}

/// Add flumen's settings, worker pools and required DataFusion options to a session config.
pub fn flumen_session_config(session_config: SessionConfig, config: FlumenConfig) -> SessionConfig {
    let mut session_config = session_config
        .with_option_extension(config)
        .with_extension(Arc::new(AcceleratorPool::default()))
        .with_extension(Arc::new(WorkerPoolSlot::default()))
        .with_extension(Arc::new(LayoutCache::default()))
        .with_extension(Arc::new(crate::io::object_stores::StoreGrants::default()));
    // Each source split must always read the same rows (lineage): no work stealing
    // between the partitions of a scan.
    session_config
        .options_mut()
        .execution
        .enable_file_stream_work_stealing = false;
    session_config
}

/// Turn an existing DataFusion `SessionContext` into a flumen one, keeping its catalogs,
/// tables, functions and settings.
pub fn into_flumen(ctx: &SessionContext, config: FlumenConfig) -> SessionContext {
    let state = ctx.state();
    let create_default_catalog = state
        .config()
        .options()
        .catalog
        .create_default_catalog_and_schema;
    // The existing catalogs are kept: do not create a fresh (empty) default catalog.
    let session_config = flumen_session_config(state.config().clone(), config)
        .with_create_default_catalog_and_schema(false);
    let scalar = registration_order(state.scalar_functions(), |f| f.aliases());
    let aggregate = registration_order(state.aggregate_functions(), |f| f.aliases());
    let window = registration_order(state.window_functions(), |f| f.aliases());
    let rules = flumen_optimizer_rules(state.physical_optimizers());
    let mut state = SessionStateBuilder::new_from_existing(state)
        .with_physical_optimizer_rules(rules)
        .with_config(session_config)
        .with_scalar_functions(scalar)
        .with_aggregate_functions(aggregate)
        .with_window_functions(window)
        .with_query_planner(Arc::new(FlumenQueryPlanner::default()))
        .build();
    state
        .config_mut()
        .options_mut()
        .catalog
        .create_default_catalog_and_schema = create_default_catalog;
    let ctx = SessionContext::new_with_state(state);
    register_functions(&ctx);
    object_stores::register_table_options(&ctx);
    register_table_factories(&ctx);
    ctx
}

/// Put [`HideGroupingSetConstants`](grouping_set_constants::HideGroupingSetConstants) and
/// [`KeepAcceleratorProjections`](accelerator_projection::KeepAcceleratorProjections)
/// first among the session's physical optimizer rules,
/// [`RemoveNoConstantsNodes`](grouping_set_constants::RemoveNoConstantsNodes) last, and
/// [`SemiJoinsByKeySet`](semi_joins_by_key_set::SemiJoinsByKeySet) and
/// [`PartitionOuterJoins`](partitioned_outer_joins::PartitionOuterJoins) right after
/// DataFusion's join selection,
/// [`OrderedRoundRobins`](ordered_round_robins::OrderedRoundRobins) after it,
/// [`PlainHashExchanges`](plain_hash_exchanges::PlainHashExchanges) right after DataFusion's
/// rules and [`PlanRandomShuffles`](random_shuffle::PlanRandomShuffles) last (each once).
fn keep_accelerator_projections(state: SessionState) -> SessionState {
    let rules = flumen_optimizer_rules(state.physical_optimizers());
    SessionStateBuilder::new_from_existing(state)
        .with_physical_optimizer_rules(rules)
        .build()
}

/// `existing` with `HideGroupingSetConstants` and `KeepAcceleratorProjections` first,
/// `SemiJoinsByKeySet` and `PartitionOuterJoins` after join selection, `PlainHashExchanges` after DataFusion's
/// rules, and `PlanRandomShuffles`,
/// `ReadOnlyWholeAggregateBounds` and `RemoveNoConstantsNodes` last (each once).
fn flumen_optimizer_rules(
    existing: &[Arc<dyn PhysicalOptimizerRule + Send + Sync>],
) -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let rule = accelerator_projection::KeepAcceleratorProjections;
    let mut rules: Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> = vec![
        Arc::new(grouping_set_constants::HideGroupingSetConstants),
        Arc::new(rule),
    ];
    rules.extend(
        existing
            .iter()
            .filter(|r| {
                !matches!(
                    r.name(),
                    "keep_accelerator_projections"
                        | "plan_random_shuffles"
                        | "partition_outer_joins"
                        | "semi_joins_by_key_set"
                        | "hide_grouping_set_constants"
                        | "remove_no_constants_nodes"
                        | "read_only_whole_aggregate_bounds"
                        | "plain_hash_exchanges"
                        | "ordered_round_robins"
                        | "hide_outer_join_constants"
                )
            })
            .cloned(),
    );
    // Right after DataFusion's join selection (which picks `CollectLeft`), before its
    // distribution rules add the hash exchanges a partitioned join needs.
    let join_selection = rules.iter().position(|r| r.name() == "join_selection");
    let at = join_selection.map_or(1, |i| i + 1);
    rules.insert(at, Arc::new(partitioned_outer_joins::PartitionOuterJoins));
    // Before `PartitionOuterJoins`: the semi and anti joins it rewrites stay `CollectLeft`.
    rules.insert(at, Arc::new(semi_joins_by_key_set::SemiJoinsByKeySet));
    // After both: the NULL-padded sides of the outer joins they leave lose their constants
    // for the rules that follow (`RemoveNoConstantsNodes`, last, takes the nodes out).
    rules.insert(
        at + 2,
        Arc::new(outer_join_constants::HideOuterJoinConstants),
    );
    // After DataFusion's rules, whose sorting and distribution rules make the exchanges
    // that keep an order.
    rules.push(Arc::new(plain_hash_exchanges::PlainHashExchanges));
    // After DataFusion's distribution rules, which add the round-robin exchanges.
    rules.push(Arc::new(ordered_round_robins::OrderedRoundRobins));
    // After DataFusion's rules: they would not know its nodes.
    rules.push(Arc::new(random_shuffle::PlanRandomShuffles));
    // After DataFusion's filter pushdown, which put the aggregates' filters in the scans.
    rules.push(Arc::new(
        aggregate_bound_reads::ReadOnlyWholeAggregateBounds,
    ));
    rules.push(Arc::new(grouping_set_constants::RemoveNoConstantsNodes));
    rules
}

/// The functions of a registry in an order that rebuilds the same name → function map:
/// a function one of whose names now resolves to another function (an override, e.g.
/// Spark's `array_contains` over the alias of DataFusion's `array_has`) is registered first,
/// so the override registered after it wins again.
fn registration_order<F>(
    registry: &std::collections::HashMap<String, Arc<F>>,
    aliases: impl Fn(&F) -> &[String],
) -> Vec<Arc<F>> {
    let mut seen = std::collections::HashSet::new();
    let mut shadowed = vec![];
    let mut winners = vec![];
    for function in registry.values() {
        if !seen.insert(Arc::as_ptr(function)) {
            continue;
        }
        let names = registry
            .iter()
            .filter(|(_, f)| Arc::ptr_eq(f, function))
            .count();
        if names < aliases(function).len() + 1 {
            shadowed.push(Arc::clone(function));
        } else {
            winners.push(Arc::clone(function));
        }
    }
    shadowed.extend(winners);
    shadowed
}

/// Run `sql` if it is `RESET flumen.<name>`, which DataFusion 55's `RESET` refuses for every
/// namespace but its own ("Could not find config namespace"): [`reset_flumen_variable`].
/// `Some`: it was such a statement, done, and this is its (empty) result, as a `SET`'s;
/// `None`: anything else, for the caller to run. [`user_statement`] calls it (the shell, the Python session)
/// before running a statement (`flumen serve` reads the variable from the statement's plan).
pub fn reset_flumen_setting(
    ctx: &SessionContext,
    sql: &str,
) -> datafusion::error::Result<Option<datafusion::dataframe::DataFrame>> {
    use datafusion::sql::parser::{DFParser, ResetStatement, Statement};
    let Ok(mut statements) = DFParser::parse_sql(sql) else {
        return Ok(None);
    };
    let (Some(Statement::Reset(ResetStatement::Variable(name))), None) =
        (statements.pop_front(), statements.pop_front())
    else {
        return Ok(None);
    };
    let name = name.to_string().to_ascii_lowercase();
    if !name.starts_with("flumen.") {
        return Ok(None);
    }
    reset_flumen_variable(ctx, &name).map(Some)
}

/// Put `variable` (`flumen.<name>`) of `ctx` back to its default
/// ([`FlumenConfig::with_default`]), as `RESET datafusion.<name>` does for DataFusion's: the
/// statement's (empty) result, as a `SET`'s.
pub fn reset_flumen_variable(
    ctx: &SessionContext,
    variable: &str,
) -> datafusion::error::Result<datafusion::dataframe::DataFrame> {
    let field = variable.strip_prefix("flumen.").unwrap_or(variable);
    {
        let state = ctx.state_ref();
        let mut state = state.write();
        let options = state.config_mut().options_mut();
        let current = (options.extensions.get::<FlumenConfig>())
            .cloned()
            .unwrap_or_default();
        options.extensions.insert(current.with_default(field)?);
    }
    let done = datafusion::logical_expr::LogicalPlanBuilder::empty(false).build()?;
    Ok(datafusion::dataframe::DataFrame::new(ctx.state(), done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;

    #[test]
    fn a_sessions_file_caches_grow_with_its_budget_never_below_datafusions() {
        let caches_of = |budget: u64| {
            let config = FlumenConfig {
                memory_budget: ByteSize(budget),
                ..FlumenConfig::default()
            };
            let ctx = session(config);
            let caches = &ctx.runtime_env().cache_manager;
            (
                caches.get_metadata_cache_limit(),
                caches.get_file_statistic_cache_limit(),
                caches.get_list_files_cache_limit(),
            )
        };
        assert_eq!(caches_of(2 << 30), (256 << 20, 64 << 20, 8 << 20));
        assert_eq!(
            caches_of(64 << 20),
            (
                DEFAULT_METADATA_CACHE_LIMIT,
                DEFAULT_FILE_STATISTICS_MEMORY_LIMIT,
                DEFAULT_LIST_FILES_CACHE_MEMORY_LIMIT
            )
        );
    }
}
