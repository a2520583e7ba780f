//! `SampleKeys`: a random but reproducible key per row, appended as a column, for a table
//! sample of a relation whose rows have no place in a file to key them by (a memory table,
//! a CSV file, a view): see [`crate::plan::table_samples`].
//!
//! A row's key mixes the sample's seed, the row's position in the stream that carries it,
//! and a hash of its values ([`crate::functions::row_hash`]). The position keeps identical
//! rows apart; the values keep rows at the same position of different blocks apart. A task
//! run again over the same block (lineage) gives every row the same key, so the rows a
//! sample kept do not change when a lost block is recomputed.
//!
//! The node hashes every column of its input, so the logical optimizer is not let take
//! columns away below it: a query reading fewer columns would key its rows otherwise.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{RecordBatch, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DFSchema, DFSchemaRef};
use datafusion::datasource::physical_plan::{FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions::core;
use datafusion::logical_expr::ScalarUDF;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::projection::{ProjectionExpr, ProjectionExprs};
use datafusion::physical_expr::{EquivalenceProperties, ScalarFunctionExpr};
use datafusion::physical_plan::execution_plan::EmissionType;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PhysicalExpr,
    PlanProperties,
};
use datafusion::physical_planner::{ExtensionPlanner, PhysicalPlanner};
use futures::StreamExt;

use crate::functions::row_hash::{hash_rows, row_hash_udf};

/// The name of the key column a [`SampleKeysNode`] appends.
pub const SAMPLE_KEY: &str = "__flumen_sample_key";

/// The logical node: its input's columns, then [`SAMPLE_KEY`] (`UInt64`, never NULL).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SampleKeysNode {
    input: LogicalPlan,
    seed: u64,
    schema: DFSchemaRef,
}

impl SampleKeysNode {
    /// Keys for the rows of `input`, drawn with `seed`.
    pub fn try_new(input: LogicalPlan, seed: u64) -> Result<Self> {
        let key = Field::new(SAMPLE_KEY, DataType::UInt64, false);
        let mut schema = input.schema().as_ref().clone();
        schema.merge(&DFSchema::try_from(Schema::new(vec![key]))?);
        Ok(Self {
            input,
            seed,
            schema: Arc::new(schema),
        })
    }

    /// The node as a logical plan.
    pub fn into_plan(self) -> LogicalPlan {
        LogicalPlan::Extension(Extension {
            node: Arc::new(self),
        })
    }
}

impl PartialOrd for SampleKeysNode {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.seed.cmp(&other.seed) {
            Ordering::Equal => self.input.partial_cmp(&other.input),
            order => Some(order),
        }
    }
}

impl UserDefinedLogicalNodeCore for SampleKeysNode {
    fn name(&self) -> &str {
        "SampleKeys"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "SampleKeys: seed={}", self.seed)
    }

    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> Result<Self> {
        let input = inputs.pop().filter(|_| inputs.is_empty()).ok_or_else(|| {
            DataFusionError::Internal("SampleKeys takes exactly one input".into())
        })?;
        Self::try_new(input, self.seed)
    }
}

/// Plans a [`SampleKeysNode`] as a [`SampleKeysExec`].
#[derive(Debug, Default)]
pub struct SampleKeysPlanner;

#[async_trait]
impl ExtensionPlanner for SampleKeysPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn Session,
        _planning: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(keys) = node.as_any().downcast_ref::<SampleKeysNode>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return Err(DataFusionError::Internal(
                "SampleKeys takes exactly one input".into(),
            ));
        };
        if let Some(keyed) = keys_by_file_row(input, keys.seed, session)? {
            return Ok(Some(keyed));
        }
        Ok(Some(Arc::new(SampleKeysExec::new(
            Arc::clone(input),
            keys.seed,
        ))))
    }
}

/// Where `input` is a Parquet file scan (a provider that wraps a listing table, such as the
/// shell's demo `docs`), its rows keyed by their place in their file as a Parquet listing
/// table's are ([`crate::plan::table_samples`]): the scan also reads `input_file_name()` and
/// `file_row_index()`, and a projection appends `row_hash(seed, file name, row)` as
/// [`SAMPLE_KEY`]. So the sample does not depend on how the file is cut into splits (a
/// model query's are smaller). `None` for any other input.
fn keys_by_file_row(
    input: &Arc<dyn ExecutionPlan>,
    seed: u64,
    session: &dyn Session,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(config) = (input.downcast_ref::<DataSourceExec>())
        .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>())
        .filter(|config| config.file_source().file_type() == "parquet")
    else {
        return Ok(None);
    };
    let schema = input.schema();
    let columns = schema.fields().len();
    let options = Arc::new(session.config_options().clone());
    let call = |function: Arc<ScalarUDF>| -> Result<Arc<dyn PhysicalExpr>> {
        Ok(Arc::new(ScalarFunctionExpr::try_new(
            function,
            vec![],
            &schema,
            Arc::clone(&options),
        )?))
    };
    let mut read: Vec<ProjectionExpr> = (schema.fields().iter().enumerate())
        .map(|(i, f)| ProjectionExpr::new(Arc::new(Column::new(f.name(), i)), f.name().clone()))
        .collect();
    read.push(ProjectionExpr::new(
        call(core::input_file_name())?,
        "__flumen_sample_file",
    ));
    read.push(ProjectionExpr::new(
        call(core::file_row_index())?,
        "__flumen_sample_row",
    ));
    let Some(source) = config
        .file_source()
        .try_pushdown_projection(&ProjectionExprs::new(read))?
    else {
        return Ok(None);
    };
    let scan = DataSourceExec::from_data_source(
        FileScanConfigBuilder::from(config.clone())
            .with_source(source)
            .build(),
    );
    let scan_schema = scan.schema();
    // The file's name: where the wrapped table lies is not known here, and must not change
    // the rows kept.
    let file_name = ScalarFunctionExpr::try_new(
        datafusion::functions::unicode::substr_index(),
        vec![
            Arc::new(Column::new("__flumen_sample_file", columns)),
            Arc::new(Literal::new(ScalarValue::from("/"))),
            Arc::new(Literal::new(ScalarValue::Int64(Some(-1)))),
        ],
        &scan_schema,
        Arc::clone(&options),
    )?;
    let key = ScalarFunctionExpr::try_new(
        Arc::new(row_hash_udf()),
        vec![
            Arc::new(Literal::new(ScalarValue::UInt64(Some(seed)))),
            Arc::new(file_name),
            Arc::new(Column::new("__flumen_sample_row", columns + 1)),
        ],
        &scan_schema,
        options,
    )?;
    let mut keyed: Vec<ProjectionExpr> = (schema.fields().iter().enumerate())
        .map(|(i, f)| ProjectionExpr::new(Arc::new(Column::new(f.name(), i)), f.name().clone()))
        .collect();
    keyed.push(ProjectionExpr::new(Arc::new(key), SAMPLE_KEY));
    Ok(Some(Arc::new(ProjectionExec::try_new(keyed, scan)?)))
}

/// The physical node: each partition's rows with their keys, in their order.
#[derive(Debug)]
pub struct SampleKeysExec {
    input: Arc<dyn ExecutionPlan>,
    seed: u64,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
}

impl SampleKeysExec {
    /// Keys for the rows of `input`, drawn with `seed`.
    pub fn new(input: Arc<dyn ExecutionPlan>, seed: u64) -> Self {
        let input_schema = input.schema();
        let fields = input_schema
            .fields()
            .iter()
            .cloned()
            .chain([Arc::new(Field::new(SAMPLE_KEY, DataType::UInt64, false))]);
        let schema = Arc::new(Schema::new_with_metadata(
            fields.collect::<Vec<_>>(),
            input_schema.metadata().clone(),
        ));
        let properties = PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            input.output_partitioning().clone(),
            EmissionType::Incremental,
            input.boundedness(),
        );
        Self {
            input,
            seed,
            schema,
            properties: Arc::new(properties),
        }
    }

    /// The seed the keys are drawn with.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl DisplayAs for SampleKeysExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "SampleKeysExec: seed={}", self.seed)
    }
}

impl ExecutionPlan for SampleKeysExec {
    fn name(&self) -> &str {
        "SampleKeysExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        // A repartition below would move rows between streams, and so their positions.
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children
            .pop()
            .filter(|_| children.is_empty())
            .ok_or_else(|| {
                DataFusionError::Internal("SampleKeysExec takes exactly one input".into())
            })?;
        Ok(Arc::new(Self::new(input, self.seed)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let (schema, seed) = (Arc::clone(&self.schema), self.seed);
        let mut position = 0u64;
        let keyed = input.map(move |batch| {
            let batch = batch?;
            let keys = row_keys(&batch, seed, position)?;
            position += batch.num_rows() as u64;
            let columns = batch.columns().iter().cloned();
            let columns = columns.chain([Arc::new(keys) as _]).collect();
            Ok(RecordBatch::try_new(Arc::clone(&schema), columns)?)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            keyed,
        )))
    }
}

/// The keys of `batch`'s rows, the first of which is at `first_position` of its stream.
fn row_keys(batch: &RecordBatch, seed: u64, first_position: u64) -> Result<UInt64Array> {
    let rows = batch.num_rows();
    let values = match batch.num_columns() {
        0 => vec![0; rows],
        _ => hash_rows(batch.columns(), seed, rows)?,
    };
    Ok(values
        .into_iter()
        .enumerate()
        .map(|(i, value)| mix(seed ^ mix(value ^ mix(first_position + i as u64))))
        .collect())
}

/// What a task plan holds for a [`SampleKeysExec`] (its input is the node's child).
#[derive(Clone, PartialEq, prost::Message)]
struct SampleKeysMessage {
    #[prost(string, tag = "1")]
    kind: String,
    #[prost(uint64, tag = "2")]
    seed: u64,
}

/// What marks a [`SampleKeysMessage`] in a task plan.
const SAMPLE_KEYS: &str = "flumen.sample_keys";

/// `node`'s encoding in a task plan, if it is a [`SampleKeysExec`].
pub fn encode(node: &Arc<dyn ExecutionPlan>) -> Option<Vec<u8>> {
    let keys = node.downcast_ref::<SampleKeysExec>()?;
    let message = SampleKeysMessage {
        kind: SAMPLE_KEYS.into(),
        seed: keys.seed,
    };
    Some(prost::Message::encode_to_vec(&message))
}

/// The [`SampleKeysExec`] `bytes` encode over `inputs`; `None` if they encode another node.
pub fn decode(
    bytes: &[u8],
    inputs: &[Arc<dyn ExecutionPlan>],
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(message) = <SampleKeysMessage as prost::Message>::decode(bytes)
        .ok()
        .filter(|m| m.kind == SAMPLE_KEYS)
    else {
        return Ok(None);
    };
    let [input] = inputs else {
        return Err(DataFusionError::Execution(format!(
            "a task plan's SampleKeysExec has {} inputs",
            inputs.len()
        )));
    };
    Ok(Some(Arc::new(SampleKeysExec::new(
        Arc::clone(input),
        message.seed,
    ))))
}

/// SplitMix64's finalizer: every bit of `x` moves about half the bits of the result.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;

    fn batch(values: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(values.to_vec()))]).unwrap()
    }

    #[test]
    fn identical_rows_get_different_keys_and_the_same_rows_the_same_keys_again() {
        let rows = batch(&[7, 7, 7, 7]);
        let keys = row_keys(&rows, 1, 0).unwrap();
        let distinct: std::collections::HashSet<u64> = keys.values().iter().copied().collect();
        assert_eq!(distinct.len(), 4, "{keys:?}");
        assert_eq!(row_keys(&rows, 1, 0).unwrap(), keys);
        assert_ne!(row_keys(&rows, 2, 0).unwrap(), keys, "another seed");
    }

    #[test]
    fn the_same_position_in_blocks_of_other_rows_gets_other_keys() {
        let a = row_keys(&batch(&[1, 2, 3]), 5, 0).unwrap();
        let b = row_keys(&batch(&[4, 5, 6]), 5, 0).unwrap();
        assert!(a.values().iter().zip(b.values()).all(|(x, y)| x != y));
    }

    #[test]
    fn keys_below_a_share_of_the_range_keep_about_that_share() {
        let values: Vec<i64> = (0..100_000).collect();
        let keys = row_keys(&batch(&values), 42, 0).unwrap();
        let threshold = (0.1 * 2f64.powi(64)) as u64;
        let kept = keys.values().iter().filter(|k| **k < threshold).count();
        // 10,000 expected; a binomial's standard deviation is ~95 rows.
        assert!((9_500..10_500).contains(&kept), "{kept}");
    }
}
