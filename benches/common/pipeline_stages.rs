//! The pipeline bench's stages and the bound measured outside flumen: the CPU stage `post`
//! (a projection head on the CPU between two models), documents whose length shifts
//! half-way, each stage's cost in a plain single-threaded loop, and the idle gaps of a
//! device's timeline.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, FixedSizeListArray, Float32Array, Int64Array, RecordBatch,
    StringArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Float32Type};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;
use serde_json::{Value, json};

/// Width of the vectors `post` reads and writes.
pub const POST_DIMS: usize = 384;

/// `post(v)`: `layers` dense layers (384 x 384 weights, tanh) over a vector of 384 floats —
/// a projection head run on the CPU between two models. Real arithmetic, whose cost does
/// not depend on the document.
#[derive(Debug)]
pub struct Post {
    signature: Signature,
    weights: Vec<Vec<f32>>,
}

impl PartialEq for Post {
    fn eq(&self, other: &Self) -> bool {
        self.weights.len() == other.weights.len()
    }
}
impl Eq for Post {}
impl std::hash::Hash for Post {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.weights.len().hash(state);
    }
}

impl Post {
    /// `post` with `layers` layers of fixed pseudo-random weights.
    pub fn udf(layers: usize) -> ScalarUDF {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let scale = 1.0 / (POST_DIMS as f32).sqrt();
        let weights = (0..layers)
            .map(|_| {
                (0..POST_DIMS * POST_DIMS)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
                    })
                    .collect()
            })
            .collect();
        ScalarUDF::new_from_impl(Self {
            signature: Signature::any(1, Volatility::Immutable),
            weights,
        })
    }

    fn apply(&self, vector: &[f32], out: &mut Vec<f32>) {
        let mut x = vector.to_vec();
        let mut y = vec![0f32; POST_DIMS];
        for w in &self.weights {
            y.iter_mut().for_each(|v| *v = 0.0);
            for (i, xi) in x.iter().enumerate() {
                let row = &w[i * POST_DIMS..(i + 1) * POST_DIMS];
                for (yj, wij) in y.iter_mut().zip(row) {
                    *yj += xi * wij;
                }
            }
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi = yi.tanh();
            }
        }
        out.extend_from_slice(&x);
    }
}

impl ScalarUDFImpl for Post {
    fn name(&self) -> &str {
        "post"
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _: &[DataType]) -> Result<DataType> {
        Ok(vector_type(POST_DIMS))
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let input = ColumnarValue::values_to_arrays(&args.args)?.remove(0);
        let vectors = input.as_fixed_size_list_opt().ok_or_else(|| {
            DataFusionError::Execution(format!("post takes vectors, got {}", input.data_type()))
        })?;
        if vectors.value_length() as usize != POST_DIMS {
            return Err(DataFusionError::Execution(format!(
                "post takes vectors of {POST_DIMS} floats, got {}",
                vectors.value_length()
            )));
        }
        let values = vectors.values().as_primitive::<Float32Type>().values();
        let mut out = Vec::with_capacity(vectors.len() * POST_DIMS);
        for row in 0..vectors.len() {
            let start = (vectors.offset() + row) * POST_DIMS;
            self.apply(&values[start..start + POST_DIMS], &mut out);
        }
        let list = FixedSizeListArray::try_new(
            Arc::new(Field::new_list_field(DataType::Float32, true)),
            POST_DIMS as i32,
            Arc::new(Float32Array::from(out)),
            vectors.logical_nulls(),
        )?;
        Ok(ColumnarValue::Array(Arc::new(list)))
    }
}

fn vector_type(dims: usize) -> DataType {
    DataType::FixedSizeList(
        Arc::new(Field::new_list_field(DataType::Float32, true)),
        dims as i32,
    )
}

/// Write `rows` documents whose length shifts half-way: the first half are flumen's demo
/// documents, the second half the same documents' bodies repeated `factor` times (long
/// pages), in row groups of 16,384 rows like the demo table.
pub fn write_shifted_docs(path: &Path, rows: usize, factor: usize) -> Result<()> {
    let schema = flumen::demo::docs_schema();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
        .set_max_row_group_row_count(Some(16_384))
        .build();
    let mut writer = ArrowWriter::try_new(
        std::fs::File::create(&tmp)?,
        Arc::clone(&schema),
        Some(props),
    )?;
    for start in (0..rows).step_by(16_384) {
        let ids: Vec<i64> = (start as i64..(start + 16_384).min(rows) as i64).collect();
        let bodies: Vec<String> = ids
            .iter()
            .map(|&id| {
                let body = flumen::demo::document(id);
                if (id as usize) < rows / 2 {
                    body
                } else {
                    body.repeat(factor.max(1))
                }
            })
            .collect();
        let topics: Vec<&str> = ids.iter().map(|_| "mixed").collect();
        writer.write(&RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(StringArray::from(topics)),
                Arc::new(StringArray::from(bodies)),
            ],
        )?)?;
    }
    writer.close()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> Duration {
    // SAFETY: clock_gettime only writes the struct it is given.
    let ts = unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts);
        ts
    };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Call a scalar UDF over whole arrays.
pub fn call(udf: &ScalarUDF, args: &[ArrayRef]) -> Result<ArrayRef> {
    let arg_fields: Vec<_> = args
        .iter()
        .enumerate()
        .map(|(i, a)| Arc::new(Field::new(format!("a{i}"), a.data_type().clone(), true)))
        .collect();
    let types: Vec<DataType> = args.iter().map(|a| a.data_type().clone()).collect();
    let return_field = Arc::new(Field::new("out", udf.return_type(&types)?, true));
    let rows = args.first().map_or(0, |a| a.len());
    let out = udf.invoke_with_args(ScalarFunctionArgs {
        args: args.iter().cloned().map(ColumnarValue::Array).collect(),
        arg_fields,
        number_rows: rows,
        return_field,
        config_options: Arc::new(ConfigOptions::new()),
    })?;
    out.into_array(rows)
}

/// Removes an earlier run's output file at `path`, if any. Call it before the clock starts:
/// unlinking a 1.5 GB file (the 1M-row output) frees its page cache and extents in the
/// caller's thread, 0.1–0.4 s that a job writing a new file does not pay (it read as a first
/// row 0.28 s late at 1M rows). Removed, not truncated: ext4 writes a truncated-and-rewritten
/// file's data out when it is closed (its `auto_da_alloc` guard against empty files after a
/// crash), which made each run's writer close wait ~35 ms for the disk.
pub fn remove_old_output(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

/// Writes a finished run's output file out to the disk, after the clock stops. A 1M-row run
/// leaves 1.5 GB of dirty pages, which the kernel would otherwise write back during the next
/// run (`vmstat` showed 120–200 MB/s going out during a run, and that run's first row came
/// 0.8 s late), so each run starts with the disk idle.
pub fn flush_output(path: &Path) -> Result<()> {
    Ok(std::fs::File::open(path)?.sync_all()?)
}

/// A new file at `path` for a run's output; its callers have removed an earlier run's file
/// there with [`remove_old_output`] before their clock started.
pub fn new_output_file(path: &Path) -> Result<std::fs::File> {
    Ok(std::fs::File::create(path)?)
}

/// Scales [`stage_costs`]' figures for a sample of the rows by `factor` (all rows / rows
/// sampled): each stage's CPU time, decode, the writer's per-row work and the devices' time.
/// The writer's close is kept as measured: it writes out the last row group, which the
/// sample makes the size of the full run's. Only for inputs whose rows are drawn alike
/// throughout (the three-stage input's second half is longer: it is measured whole).
pub fn scale_stage_costs(alone: &mut Value, factor: f64) {
    let scaled = |v: &Value, key: &str| v[key].as_f64().unwrap_or(0.0) * factor;
    let close = alone["writer_close_s"].as_f64().unwrap_or(0.0);
    alone["cpu_s"] = json!((scaled(alone, "cpu_s") - close * factor) + close);
    alone["writer_s"] = json!((scaled(alone, "writer_s") - close * factor) + close);
    alone["decode_s"] = json!(scaled(alone, "decode_s"));
    for stage in alone["stages"].as_array_mut().into_iter().flatten() {
        stage["cpu_s"] = json!(scaled(stage, "cpu_s"));
    }
    for device in alone["devices"].as_array_mut().into_iter().flatten() {
        device["device_s"] = json!(scaled(device, "device_s"));
    }
}

/// One stage of a plain loop: a function of the previous stage's column, and what it
/// feeds a device (a model with zero service time, whose device time is reckoned apart).
pub struct LoopStage {
    /// Name in the report.
    pub name: &'static str,
    /// The function (for a model: the model with a zero-time device).
    pub udf: ScalarUDF,
    /// For a model: (rows per device batch, device time per batch, per KiB of input).
    pub device: Option<(usize, Duration, Duration)>,
}

/// Each stage of the pipeline alone, outside flumen: one thread reads `input` (Parquet, in
/// batches of 8,192 rows), runs the stages in turn over `body` and writes the result to
/// `output` as the benchmark's reader does; each step's thread CPU time is its cost (the
/// writer's close, which writes out its last row group, also apart: `writer_close_s`). A
/// model's device time is what its batches would cost on the device with every batch full.
/// `row_limit`: read only this many first rows (see [`scale_stage_costs`]).
pub fn stage_costs(
    input: &Path,
    output: &Path,
    stages: &[LoopStage],
    writer_props: WriterProperties,
    row_limit: Option<usize>,
) -> Result<Value> {
    remove_old_output(output)?;
    let started = Instant::now();
    let file = std::fs::File::open(input)?;
    let mut reader = ParquetRecordBatchReaderBuilder::try_new(file)?
        .with_batch_size(8192)
        .build()?;
    let mut cpu = vec![Duration::ZERO; stages.len()];
    let mut input_bytes = vec![0usize; stages.len()];
    let (mut decode, mut write, mut close) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut writer = None;
    let mut rows = 0usize;
    while rows < row_limit.unwrap_or(usize::MAX) {
        let t = thread_cpu();
        let Some(batch) = reader.next() else { break };
        let mut batch = batch?;
        if let Some(limit) = row_limit {
            batch = batch.slice(0, batch.num_rows().min(limit - rows));
        }
        decode += thread_cpu() - t;
        rows += batch.num_rows();
        let ids = Arc::clone(batch.column_by_name("id").expect("id"));
        let mut column = Arc::clone(batch.column_by_name("body").expect("body"));
        for (k, stage) in stages.iter().enumerate() {
            input_bytes[k] += payload_bytes(&column);
            let t = thread_cpu();
            column = call(&stage.udf, &[column])?;
            cpu[k] += thread_cpu() - t;
        }
        let out = RecordBatch::try_from_iter([("id", ids), ("v", column)])?;
        let t = thread_cpu();
        let w = match &mut writer {
            Some(w) => w,
            None => writer.insert(ArrowWriter::try_new(
                new_output_file(output)?,
                out.schema(),
                Some(writer_props.clone()),
            )?),
        };
        w.write(&out)?;
        write += thread_cpu() - t;
    }
    if let Some(w) = writer {
        let t = thread_cpu();
        w.close()?;
        close = thread_cpu() - t;
        write += close;
    }
    let wall_s = started.elapsed().as_secs_f64();
    if rows > 0 {
        flush_output(output)?;
    }
    let devices: Vec<Value> = stages
        .iter()
        .zip(&input_bytes)
        .filter_map(|(stage, bytes)| {
            let (batch_rows, per_batch, per_kib) = stage.device?;
            let s = rows.div_ceil(batch_rows.max(1)) as f64 * per_batch.as_secs_f64()
                + per_kib.as_secs_f64() * *bytes as f64 / 1024.0;
            Some(json!({"name": stage.name, "device_s": s}))
        })
        .collect();
    let stage_cpu: Vec<Value> = stages
        .iter()
        .zip(&cpu)
        .map(
            |(s, c)| json!({"name": s.name, "cpu_s": c.as_secs_f64(), "model": s.device.is_some()}),
        )
        .collect();
    let total = decode + write + cpu.iter().sum::<Duration>();
    Ok(json!({
        "mode": "alone",
        "rows": rows as f64,
        "wall_s": wall_s,
        "decode_s": decode.as_secs_f64(),
        "writer_s": write.as_secs_f64(),
        "writer_close_s": close.as_secs_f64(),
        "cpu_s": total.as_secs_f64(),
        "stages": stage_cpu,
        "devices": devices,
    }))
}

/// Bytes of input a model is charged for: text bytes, or 4 per float of a vector.
fn payload_bytes(column: &ArrayRef) -> usize {
    match column.data_type() {
        DataType::Utf8 => {
            let offsets = column.as_string::<i32>().value_offsets();
            (offsets[column.len()] - offsets[0]) as usize
        }
        DataType::FixedSizeList(_, n) => column.len() * *n as usize * 4,
        _ => column.get_buffer_memory_size(),
    }
}

/// The idle gaps between consecutive batches on a device, in ms: median, 90th percentile,
/// largest, how many, how many over 1 ms, and the idle time between its first and last
/// batch.
pub fn gap_stats(intervals: &[(Duration, Duration)]) -> Value {
    let mut gaps: Vec<f64> = intervals
        .windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].1).as_secs_f64() * 1e3)
        .collect();
    gaps.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if gaps.is_empty() {
            f64::NAN
        } else {
            gaps[((gaps.len() - 1) as f64 * q).round() as usize]
        }
    };
    json!({
        "median_ms": at(0.5),
        "p90_ms": at(0.9),
        "max_ms": gaps.last().copied().unwrap_or(f64::NAN),
        "n": gaps.len(),
        "over_1ms": gaps.iter().filter(|g| **g > 1.0).count(),
        "idle_s": gaps.iter().sum::<f64>() / 1e3,
    })
}
