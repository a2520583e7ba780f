//! A real model alone, outside flumen's scheduler: the device's share of the pipeline bench's
//! bound, and the vectors every mode's output is checked against.
//!
//! One thread runs the model's CPU step over every row first (untimed: that is CPU work,
//! counted by the plain loop of `pipeline_stages`), then calls the loaded model directly on
//! blocks of the rows one after another. The wall time of those calls is the device's time:
//! no scheduler, no queue, no other work between them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::compute::concat;
use datafusion::arrow::datatypes::{DataType, Float32Type, Int64Type};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::ScalarUDF;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use datafusion::parquet::file::properties::WriterProperties;
use flumen::AcceleratorFunction;
use serde_json::{Value, json};

/// Rows of the untimed first call (the device's kernels and buffers come up in it).
const WARM_UP_ROWS: usize = 64;

/// Run `model` alone over `input`'s `body` (after the CPU functions `prep`, in turn) in
/// blocks of `block_rows` rows, writing `id` and the vectors to `output`. Returns
/// `{rows, device_s, wall_s, load_s, blocks}`: `device_s` (and `wall_s`) is the wall time of
/// the model's calls.
pub fn run(
    input: &Path,
    output: &Path,
    prep: &[ScalarUDF],
    model: &dyn AcceleratorFunction,
    config: &ConfigOptions,
    block_rows: usize,
    writer_props: WriterProperties,
) -> Result<Value> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(input)?)?
        .with_batch_size(8192)
        .build()?;
    let (mut ids, mut inputs) = (vec![], vec![]);
    for batch in reader {
        let batch = batch?;
        let mut column = Arc::clone(batch.column_by_name("body").expect("body"));
        for udf in prep {
            column = super::pipeline_stages::call(udf, &[column])?;
        }
        ids.push(Arc::clone(batch.column_by_name("id").expect("id")));
        inputs.push(column);
    }
    let concat_all = |parts: &[ArrayRef]| {
        concat(&parts.iter().map(|a| a.as_ref()).collect::<Vec<_>>()).map_err(DataFusionError::from)
    };
    let (ids, inputs) = (concat_all(&ids)?, concat_all(&inputs)?);
    let return_type = model.return_type(&[DataType::Utf8])?;

    let loading = Instant::now();
    let mut worker = model.load(config)?;
    worker.process(
        &[inputs.slice(0, inputs.len().min(WARM_UP_ROWS))],
        &return_type,
    )?;
    let load_s = loading.elapsed().as_secs_f64();

    let mut writer = None;
    let (mut device_s, mut blocks) = (0.0, 0);
    for start in (0..inputs.len()).step_by(block_rows.max(1)) {
        let len = block_rows.min(inputs.len() - start);
        let called = Instant::now();
        let vectors = worker.process(&[inputs.slice(start, len)], &return_type)?;
        device_s += called.elapsed().as_secs_f64();
        blocks += 1;
        let batch = RecordBatch::try_from_iter([("id", ids.slice(start, len)), ("v", vectors)])?;
        let writer = match &mut writer {
            Some(w) => w,
            None => writer.insert(ArrowWriter::try_new(
                std::fs::File::create(output)?,
                batch.schema(),
                Some(writer_props.clone()),
            )?),
        };
        writer.write(&batch)?;
    }
    if let Some(writer) = writer {
        writer.close()?;
    }
    Ok(json!({
        "rows": inputs.len(),
        "device_s": device_s,
        "wall_s": device_s,
        "load_s": load_s,
        "blocks": blocks,
    }))
}

/// Each row's vector in the Parquet file at `path` (`id`, then a vector column), by id.
fn vectors_by_id(path: &Path) -> Result<HashMap<i64, Vec<f32>>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path)?)?.build()?;
    let mut rows = HashMap::new();
    for batch in reader {
        let batch = batch?;
        let ids = batch.column(0).as_primitive::<Int64Type>();
        let vectors = batch.column(1).as_fixed_size_list();
        for row in 0..batch.num_rows() {
            let vector = if vectors.is_null(row) {
                vec![]
            } else {
                vectors
                    .value(row)
                    .as_primitive::<Float32Type>()
                    .values()
                    .to_vec()
            };
            rows.insert(ids.value(row), vector);
        }
    }
    Ok(rows)
}

/// Cosine similarity of two vectors (0 when either is all zeros).
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let (na, nb) = (norm(a), norm(b));
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    dot / (na * nb)
}

/// The least cosine similarity, over rows, between the vectors of `output` and those of
/// `reference` (the model alone); an error when the two hold other ids or a row's vector is
/// missing on one side only.
pub fn least_cosine(output: &Path, reference: &Path) -> Result<f64> {
    let (got, want) = (vectors_by_id(output)?, vectors_by_id(reference)?);
    if got.len() != want.len() {
        return Err(DataFusionError::Execution(format!(
            "{} holds {} rows, the model alone wrote {}",
            output.display(),
            got.len(),
            want.len()
        )));
    }
    let mut least = 1.0f64;
    for (id, expected) in &want {
        let actual = got.get(id).ok_or_else(|| {
            DataFusionError::Execution(format!("{}: id {id} is missing", output.display()))
        })?;
        if expected.len() != actual.len() {
            return Err(DataFusionError::Execution(format!(
                "{}: id {id}: a vector of {} floats, the model alone's has {}",
                output.display(),
                actual.len(),
                expected.len()
            )));
        }
        if !expected.is_empty() {
            least = least.min(cosine(expected, actual));
        }
    }
    Ok(least)
}
