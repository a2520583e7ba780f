//! `embed()` against sentence-transformers' own vectors, and through SQL.
//!
//! Needs the model: `cargo run --release --bin flumen -- install-model` (`.ci/run` does it).
//! The CUDA test runs when a CUDA device is present and prints `skipped: no CUDA device`
//! otherwise.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, FixedSizeListArray, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Float32Type, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;

mod common;
use common::{collect, skip_no_device, try_collect};

/// One fixture row: a text and the embedding sentence-transformers computed for it.
struct Reference {
    text: String,
    embedding: Vec<f32>,
}

fn references() -> Vec<Reference> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/fixtures/minilm-reference.jsonl"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    text.lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            Reference {
                text: row["text"].as_str().unwrap().to_string(),
                embedding: row["embedding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect(),
            }
        })
        .collect()
}

/// The fixture texts as one batch of a `text` column.
fn texts_batch(refs: &[Reference]) -> RecordBatch {
    let texts = StringArray::from_iter_values(refs.iter().map(|r| r.text.as_str()));
    let schema = Arc::new(Schema::new(vec![Field::new("text", DataType::Utf8, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(texts)]).unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

async fn session(device: &str) -> SessionContext {
    let ctx = flumen::session(FlumenConfig::default());
    collect(&ctx, &format!("SET flumen.device = '{device}'")).await;
    ctx
}

/// Embed every fixture text through SQL (`SELECT embed(text) FROM refs`) and compare.
async fn check_against_references(device: &str, min_cosine: f64) {
    check_against_references_in(device, "fp32", min_cosine).await;
}

/// The same under `flumen.embed_precision = precision`; each text's vector, in fixture order.
async fn check_against_references_in(
    device: &str,
    precision: &str,
    min_cosine: f64,
) -> Vec<Vec<f32>> {
    let refs = references();
    let ctx = session(device).await;
    collect(&ctx, &format!("SET flumen.embed_precision = '{precision}'")).await;
    let batch = texts_batch(&refs);
    ctx.register_batch("refs", batch).unwrap();
    let batches = collect(&ctx, "SELECT text, embed(text) AS v FROM refs").await;
    let mut seen = 0;
    let mut worst = f64::MAX;
    let mut vectors_in_order = vec![vec![]; refs.len()];
    for b in &batches {
        let texts = b.column(0).as_string::<i32>();
        let vectors = b
            .column(1)
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .unwrap();
        assert_eq!(vectors.value_length(), 384);
        for row in 0..b.num_rows() {
            let text = texts.value(row);
            let at = refs.iter().position(|r| r.text == text).unwrap();
            let reference = &refs[at];
            let got = vectors.value(row);
            let got = got.as_primitive::<Float32Type>().values();
            vectors_in_order[at] = got.to_vec();
            let cos = cosine(got, &reference.embedding);
            assert!(cos >= min_cosine, "{device}: cosine {cos} for {text:?}");
            worst = worst.min(cos);
            seen += 1;
        }
    }
    assert_eq!(seen, refs.len());
    println!("{device} {precision}: {seen} fixture sentences, lowest cosine similarity {worst:.7}");
    vectors_in_order
}

/// `EXPLAIN ANALYZE` of embedding the fixture texts (registered as `refs` the first time),
/// as text: the embed worker's figures.
async fn analyze_refs(ctx: &SessionContext) -> String {
    if !ctx.table_exist("refs").unwrap() {
        ctx.register_batch("refs", texts_batch(&references()))
            .unwrap();
    }
    let out = collect(ctx, "EXPLAIN ANALYZE SELECT embed(text) AS v FROM refs").await;
    datafusion::arrow::util::pretty::pretty_format_batches(&out)
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_matches_sentence_transformers() {
    check_against_references("cpu", 0.9999).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_matches_sentence_transformers() {
    if let Err(why) = flumen::functions::embedding::cuda_driver::probe_device_count() {
        skip_no_device(&why.to_string());
        return;
    }
    check_against_references("cuda", 0.9999).await;
    // The worker's load, in parts: files read while the device opened, then the upload.
    let ctx = session("cuda").await;
    let text = analyze_refs(&ctx).await;
    for figure in [
        "embed_load_ms=",
        "embed_files_ms=",
        "cuda_open_ms=",
        "cuda_init_ms=",
        "cuda_context_ms=",
        "cuda_blas_ms=",
        "cuda_upload_ms=",
    ] {
        assert!(text.contains(figure), "no {figure} in\n{text}");
    }
    let line = text.lines().find(|l| l.contains("embed_load_ms=")).unwrap();
    println!(
        "cuda load: {}",
        line.split(", ")
            .filter(|p| p.contains("_ms="))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nulls_and_every_string_type() {
    let ctx = session("cpu").await;
    let batches = collect(
        &ctx,
        "SELECT embed(CAST(t AS VARCHAR)) AS a, embed(arrow_cast(t, 'LargeUtf8')) AS b, \
                embed(arrow_cast(t, 'Utf8View')) AS c \
         FROM (VALUES ('a red fox'), (NULL), ('')) AS v(t)",
    )
    .await;
    let b = &batches[0];
    assert_eq!(b.num_rows(), 3);
    for col in 0..3 {
        let v = b
            .column(col)
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .unwrap();
        assert!(v.is_valid(0) && v.is_null(1) && v.is_valid(2));
        let first = v.value(0);
        let first = first.as_primitive::<Float32Type>().values();
        let reference = b.column(0).as_fixed_size_list().value(0);
        assert_eq!(first, reference.as_primitive::<Float32Type>().values());
        let norm: f32 = first.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_text_is_truncated_at_256_tokens() {
    let ctx = session("cpu").await;
    let words = "streaming ".repeat(300);
    let longer = format!("{words} and then something else entirely");
    let sql = format!(
        "SELECT cosine_similarity(embed('{words}'), embed('{longer}')) AS same, \
                cosine_similarity(embed('{words}'), embed('a cat')) AS different"
    );
    let batches = collect(&ctx, &sql).await;
    let same = batches[0]
        .column(0)
        .as_primitive::<datafusion::arrow::datatypes::Float64Type>()
        .value(0);
    let different = batches[0]
        .column(1)
        .as_primitive::<datafusion::arrow::datatypes::Float64Type>()
        .value(0);
    // Everything after token 256 is cut: both texts embed identically.
    assert!(same > 0.999999, "{same}");
    assert!(different < 0.5, "{different}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn similar_sentences_rank_first() {
    let ctx = session("cpu").await;
    let sql = "SELECT t, cosine_similarity(embed(t), embed('A man plays the guitar.')) AS s, \
                      dot_product(embed(t), embed('A man plays the guitar.')) AS d, \
                      l2_distance(embed(t), embed('A man plays the guitar.')) AS l \
               FROM (VALUES ('Someone is playing an instrument on stage.'), \
                            ('The stock market fell sharply.'), ('A cat sleeps.')) AS v(t) \
               ORDER BY s DESC";
    let batches = collect(&ctx, sql).await;
    let b = &batches[0];
    assert_eq!(
        b.column(0).as_string::<i32>().value(0),
        "Someone is playing an instrument on stage."
    );
    let f64s = |c: usize| {
        b.column(c)
            .as_primitive::<datafusion::arrow::datatypes::Float64Type>()
            .clone()
    };
    let (s, d, l) = (f64s(1), f64s(2), f64s(3));
    for row in 0..3 {
        // Unit vectors: dot = cosine and |a-b|² = 2 - 2 cos.
        assert!((s.value(row) - d.value(row)).abs() < 1e-5);
        assert!((l.value(row).powi(2) - (2.0 - 2.0 * s.value(row))).abs() < 1e-4);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors() {
    let ctx = session("cpu").await;
    let error = |sql: &'static str| {
        let ctx = ctx.clone();
        async move {
            try_collect(&ctx, sql)
                .await
                .err()
                .unwrap_or_else(|| panic!("{sql} should fail"))
                .to_string()
        }
    };
    let err = error("SELECT embed(42)").await;
    assert!(err.contains("embed"), "{err}");
    let err = error("SELECT cosine_similarity('a', 'b')").await;
    assert!(
        err.contains("cosine_similarity") && err.contains("vectors"),
        "{err}"
    );
    let missing = tempfile::tempdir().unwrap();
    let set_dir = format!("SET flumen.model_dir = '{}'", missing.path().display());
    collect(&ctx, &set_dir).await;
    let err = error("SELECT embed('hi')").await;
    assert!(
        err.contains("not found") && err.contains("install-model"),
        "{err}"
    );
    // The session goes on.
    collect(&ctx, "SET flumen.model_dir = ''").await;
    let ok = collect(&ctx, "SELECT embed('hi') IS NOT NULL").await;
    assert_eq!(ok[0].num_rows(), 1);
}

/// `embed`'s tokenizer runs as its CPU step (`flumen.preprocess_on_cpu = true`; `auto` does it
/// when the model is on CUDA): `EXPLAIN` shows `embed_tokens` computed below the accelerator
/// operator (in the scan's CPU tasks) and the model fed its token ids; the vectors equal
/// those of the worker tokenizing itself (`false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenization_runs_on_the_cpu_pool_with_the_same_vectors() {
    let refs = references();
    let batch = texts_batch(&refs);
    let vectors = |split: bool| {
        let batch = batch.clone();
        async move {
            let ctx = session("cpu").await;
            let setting = if split { "true" } else { "false" };
            collect(&ctx, &format!("SET flumen.preprocess_on_cpu = {setting}")).await;
            ctx.register_batch("refs", batch).unwrap();
            let plan = collect(&ctx, "EXPLAIN SELECT text, embed(text) AS v FROM refs").await;
            let plan = datafusion::arrow::util::pretty::pretty_format_batches(&plan)
                .unwrap()
                .to_string();
            let rows = collect(
                &ctx,
                "SELECT text, embed(text) AS v FROM refs ORDER BY text",
            )
            .await;
            (plan, rows)
        }
    };
    let (split_plan, split_rows) = vectors(true).await;
    let (whole_plan, whole_rows) = vectors(false).await;
    let accelerator_line = |plan: &str| {
        plan.lines()
            .find(|l| l.contains("AcceleratorProjectionExec: expr="))
            .unwrap_or_else(|| panic!("no accelerator projection in\n{plan}"))
            .to_string()
    };
    let (split_line, whole_line) = (accelerator_line(&split_plan), accelerator_line(&whole_plan));
    assert!(
        split_line.contains("embed(__flumen_cpu_0@") && !split_line.contains("embed_tokens"),
        "the model should read the tokens computed below it:\n{split_plan}"
    );
    let below = split_plan.split(&split_line).nth(1).unwrap();
    assert!(
        below.contains("embed_tokens(text@0) as __flumen_cpu_0") && below.contains("pool=cpu"),
        "the tokenizer should run in a CPU operator below the model:\n{split_plan}"
    );
    assert!(
        whole_line.contains("embed(text@0)") && !whole_plan.contains("embed_tokens"),
        "with preprocess_on_cpu = false the worker tokenizes:\n{whole_plan}"
    );
    let flat = |batches: &[RecordBatch]| -> Vec<(String, Vec<f32>)> {
        batches
            .iter()
            .flat_map(|b| {
                let texts = b.column(0).as_string::<i32>().clone();
                let vectors = b.column(1).as_fixed_size_list().clone();
                (0..b.num_rows())
                    .map(move |r| {
                        let v = vectors.value(r);
                        let v = v.as_primitive::<Float32Type>().values().to_vec();
                        (texts.value(r).to_string(), v)
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let (split, whole) = (flat(&split_rows), flat(&whole_rows));
    assert_eq!(split.len(), refs.len());
    assert_eq!(split.len(), whole.len());
    for ((text, a), (other, b)) in split.iter().zip(&whole) {
        assert_eq!(text, other);
        let cos = cosine(a, b);
        assert!(
            cos > 0.999_999,
            "{text:?}: cosine {cos} between the two plans"
        );
        let reference = refs.iter().find(|r| &r.text == text).unwrap();
        let cos = cosine(a, &reference.embedding);
        assert!(
            cos >= 0.9999,
            "{text:?}: cosine {cos} against sentence-transformers"
        );
    }
}

/// The worker cuts passes by tokens, tunes the budget from measured throughput (default) or
/// takes a fixed one, and `EXPLAIN ANALYZE` shows its choice with the model's operator;
/// the vectors do not depend on how passes are cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_how_the_worker_batches() {
    let refs = references();
    let batch = texts_batch(&refs);
    let ctx = session("cpu").await;
    ctx.register_batch("refs", batch).unwrap();
    let analyze = |settings: &'static str| {
        let ctx = ctx.clone();
        async move {
            collect(&ctx, settings).await;
            let out = collect(&ctx, "EXPLAIN ANALYZE SELECT embed(text) AS v FROM refs").await;
            let text = datafusion::arrow::util::pretty::pretty_format_batches(&out)
                .unwrap()
                .to_string();
            text.lines()
                .find(|l| l.contains("pool=accelerator"))
                .unwrap_or_else(|| panic!("no accelerator operator in\n{text}"))
                .to_string()
        }
    };
    let figure = |line: &str, name: &str| -> Option<u64> {
        let at = line.find(&format!("{name}="))? + name.len() + 1;
        line[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let tuned = analyze("SET flumen.embed_batch_tokens = 0").await;
    let budget = figure(&tuned, "embed_batch_tokens").unwrap_or_else(|| panic!("{tuned}"));
    assert!(
        flumen::functions::embedding::batch_tuner::all_token_budgets()
            .any(|b| b == budget as usize),
        "{tuned}"
    );
    assert!(figure(&tuned, "embed_batch_trials").is_some(), "{tuned}");
    assert!(figure(&tuned, "embed_load_ms").is_some(), "{tuned}");
    assert!(figure(&tuned, "embed_files_ms").is_some(), "{tuned}");
    let fixed = analyze("SET flumen.embed_batch_tokens = 300").await;
    assert_eq!(figure(&fixed, "embed_batch_tokens"), Some(300), "{fixed}");
    let by_rows = analyze("SET flumen.embed_batch_size = 7").await;
    assert_eq!(figure(&by_rows, "embed_batch_size"), Some(7), "{by_rows}");
    // Passes of at most 300 tokens, or of 7 sentences: the same vectors.
    for settings in [
        "SET flumen.embed_batch_size = 0",
        "SET flumen.embed_batch_size = 7",
    ] {
        collect(&ctx, settings).await;
        let rows = collect(&ctx, "SELECT text, embed(text) AS v FROM refs").await;
        for b in &rows {
            let vectors = b.column(1).as_fixed_size_list();
            for r in 0..b.num_rows() {
                let text = b.column(0).as_string::<i32>().value(r);
                let reference = refs.iter().find(|x| x.text == text).unwrap();
                let v = vectors.value(r);
                let cos = cosine(
                    v.as_primitive::<Float32Type>().values(),
                    &reference.embedding,
                );
                assert!(cos >= 0.9999, "{settings}: {text:?}: cosine {cos}");
            }
        }
    }
}

/// Issue 69's numerics check, emulated on the CPU: the encoder computing as a bfloat16 GPU
/// path would (weights and stored activations rounded to bf16, sums in fp32) against the
/// fp32 encoder, over the fixture sentences and demo documents (about 170 tokens each, the
/// README's main job's texts). Goal: cosine >= 0.999 for every text; min and mean printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_numerics_emulated_on_the_cpu_stay_within_cosine_0_999_of_fp32() {
    use flumen::functions::embedding::bert::BertWeights;
    use flumen::functions::embedding::cpu::CpuEncoder;
    use flumen::functions::embedding::model_files;

    let weights = BertWeights::load(&model_files::model_dir("")).unwrap();
    let mut fp32 = CpuEncoder::new(Arc::new(weights.clone()), 2).unwrap();
    let mut bf16 = CpuEncoder::emulating_bf16(&weights, 2).unwrap();
    compare_bf16_with_fp32(&mut fp32, &mut bf16, 64).await;
}

/// The same check on a GPU: the CUDA encoder in bf16 (tensor cores) against it in fp32,
/// over the fixture sentences and 2,000 demo documents; and the bf16 path through SQL
/// against sentence-transformers' own vectors (cosine >= 0.999 each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_bf16_stays_within_cosine_0_999_of_fp32_and_the_reference() {
    use flumen::EmbedPrecision;
    use flumen::functions::embedding::bert::{BertWeights, SentenceEncoder};
    use flumen::functions::embedding::cuda::{CudaDevice, CudaEncoder};
    use flumen::functions::embedding::model_files;

    if let Err(why) = flumen::functions::embedding::cuda_driver::probe_device_count() {
        return skip_no_device(&why.to_string());
    }
    let weights = Arc::new(BertWeights::load(&model_files::model_dir("")).unwrap());
    let mut fp32 = CudaEncoder::new(Arc::clone(&weights)).unwrap();
    let device = CudaDevice::open().unwrap();
    let mut bf16 = CudaEncoder::on(device, weights, EmbedPrecision::Bf16).unwrap();
    assert!(bf16.device().ends_with(" bf16"), "{}", bf16.device());
    compare_bf16_with_fp32(&mut fp32, &mut bf16, 2000).await;
    check_against_references_in("cuda", "bf16", 0.999).await;
    // `auto` is bf16 on a device with bf16 tensor cores (8.0+: every GPU lent so far).
    let ctx = session("cuda").await;
    collect(&ctx, "SET flumen.embed_precision = 'auto'").await;
    let text = analyze_refs(&ctx).await;
    assert!(
        text.contains("embed_bf16=1"),
        "auto did not choose bf16:\n{text}"
    );
}

/// `fp32` and `bf16` encoders over the fixture sentences and `docs` demo documents (cleaned
/// as the README's main job cleans them): cosine >= 0.999 for every text, min and mean
/// printed, and the bf16 vectors not fp32's (a path that did not round would pass the rest).
async fn compare_bf16_with_fp32(
    fp32: &mut dyn flumen::functions::embedding::bert::SentenceEncoder,
    bf16: &mut dyn flumen::functions::embedding::bert::SentenceEncoder,
    docs: usize,
) {
    use flumen::functions::embedding::bert::PackedBatch;
    use flumen::functions::embedding::{model_files, tokenizer::SentenceTokenizer};

    let tokenizer = SentenceTokenizer::load(&model_files::model_dir("")).unwrap();
    let docs_dir = tempfile::tempdir().unwrap();
    let path = docs_dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, docs).unwrap();
    let ctx = session("cpu").await;
    ctx.register_parquet("docs", path.to_str().unwrap(), Default::default())
        .await
        .unwrap();
    let cleaned = collect(&ctx, "SELECT clean_text(body) AS t FROM docs ORDER BY id").await;
    let mut corpora: Vec<(&str, Vec<String>)> = vec![(
        "fixture sentences",
        references().into_iter().map(|r| r.text).collect(),
    )];
    let docs = cleaned
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_string::<i32>()
                .iter()
                .map(|t| t.unwrap().to_string())
        })
        .collect();
    corpora.push(("demo documents", docs));
    for (corpus, texts) in corpora {
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let ids = tokenizer.encode(&refs).unwrap();
        let mut cosines = vec![];
        for chunk in ids.chunks(16) {
            let batch = PackedBatch::new(chunk.iter().map(Vec::as_slice));
            let (a, b) = (fp32.encode(&batch).unwrap(), bf16.encode(&batch).unwrap());
            let width = a.len() / chunk.len();
            for (x, y) in a.chunks(width).zip(b.chunks(width)) {
                cosines.push(cosine(x, y));
            }
        }
        let worst = cosines.iter().copied().fold(f64::INFINITY, f64::min);
        let mean = cosines.iter().sum::<f64>() / cosines.len() as f64;
        let tokens = ids.iter().map(Vec::len).sum::<usize>() / ids.len();
        println!(
            "bf16 ({}) against fp32 ({}), {corpus}: {} texts of {tokens} tokens on average, \
             cosine min {worst:.6}, mean {mean:.6}",
            bf16.device(),
            fp32.device(),
            cosines.len()
        );
        assert!(
            worst >= 0.999,
            "{corpus}: a bf16 vector at cosine {worst} of fp32's"
        );
        assert!(
            mean < 1.0 - 1e-7,
            "{corpus}: bf16 vectors equal fp32's (mean {mean})"
        );
    }
}

/// `flumen.embed_precision = 'bf16'` through SQL on the CPU (the emulated rounding): every
/// fixture sentence within cosine 0.999 of sentence-transformers' vector; a bad value is
/// an error naming the choices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bf16_setting_reaches_the_cpu_encoder_through_sql() {
    let bf16 = check_against_references_in("cpu", "bf16", 0.999).await;
    let fp32 = check_against_references_in("cpu", "fp32", 0.9999).await;
    let differ = bf16.iter().zip(&fp32).filter(|(a, b)| a != b).count();
    assert!(
        differ * 2 > fp32.len(),
        "only {differ} of {} bf16 vectors differ from fp32's: the setting did not take",
        fp32.len()
    );
    let ctx = session("cpu").await;
    for (precision, flag) in [("bf16", "embed_bf16=1"), ("auto", "embed_bf16=0")] {
        collect(&ctx, &format!("SET flumen.embed_precision = '{precision}'")).await;
        let text = analyze_refs(&ctx).await;
        assert!(text.contains(flag), "{precision}: no {flag} in\n{text}");
    }
    let err = try_collect(&ctx, "SET flumen.embed_precision = 'fp8'")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("'fp32', 'bf16' or 'auto'") && err.contains("fp8"),
        "{err}"
    );
}

/// `flumen.embed_passes_in_flight` on the CPU: the encoder computes a pass when it starts,
/// so the worker keeps one (`embed_passes_in_flight=1` in `EXPLAIN ANALYZE`) whatever the
/// setting, with the same vectors; a value other than 1 or 2 is an error naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_in_flight_on_the_cpu_are_one() {
    let ctx = session("cpu").await;
    for setting in ["1", "2"] {
        collect(
            &ctx,
            &format!("SET flumen.embed_passes_in_flight = {setting}"),
        )
        .await;
        let text = analyze_refs(&ctx).await;
        assert!(
            text.contains("embed_passes_in_flight=1"),
            "setting {setting}:\n{text}"
        );
    }
    collect(&ctx, "SET flumen.embed_passes_in_flight = 3").await;
    let err = try_collect(&ctx, "SELECT embed(text) FROM refs")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("flumen.embed_passes_in_flight must be 1 or 2, got 3"),
        "{err}"
    );
}

/// On a GPU, passes queued two at a time (the next one packed, uploaded and launched
/// while the last computes) give the vectors of passes run one at a time: 2,000 demo
/// documents in passes of 16 documents, cosine >= 0.999999 for every one; through SQL,
/// `EXPLAIN ANALYZE` says two were in flight and the fixture still matches
/// sentence-transformers. A caller that starts more passes than the slots hold gets an
/// error, not another pass's vectors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_passes_in_flight_give_the_vectors_of_one_at_a_time() {
    use flumen::functions::embedding::bert::{BertWeights, PackedBatch, SentenceEncoder};
    use flumen::functions::embedding::cuda::CudaEncoder;
    use flumen::functions::embedding::{model_files, tokenizer::SentenceTokenizer};

    if let Err(why) = flumen::functions::embedding::cuda_driver::probe_device_count() {
        return skip_no_device(&why.to_string());
    }
    let dir = model_files::model_dir("");
    let weights = Arc::new(BertWeights::load(&dir).unwrap());
    let mut encoder = CudaEncoder::new(weights).unwrap();
    assert_eq!(encoder.passes_in_flight(), 2);
    let docs_dir = tempfile::tempdir().unwrap();
    let path = docs_dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, 2000).unwrap();
    let ctx = session("cpu").await;
    ctx.register_parquet("docs", path.to_str().unwrap(), Default::default())
        .await
        .unwrap();
    let cleaned = collect(&ctx, "SELECT clean_text(body) AS t FROM docs ORDER BY id").await;
    let texts: Vec<String> = cleaned
        .iter()
        .flat_map(|b| {
            let column = b.column(0).as_string::<i32>();
            column
                .iter()
                .map(|t| t.unwrap().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let ids = SentenceTokenizer::load(&dir)
        .unwrap()
        .encode(&refs)
        .unwrap();
    let batches: Vec<PackedBatch> = ids
        .chunks(16)
        .map(|chunk| PackedBatch::new(chunk.iter().map(Vec::as_slice)))
        .collect();

    let started = std::time::Instant::now();
    let one_at_a_time: Vec<Vec<f32>> = batches.iter().map(|b| encoder.encode(b).unwrap()).collect();
    let one_s = started.elapsed().as_secs_f64();
    let started = std::time::Instant::now();
    let mut two_at_a_time = vec![];
    let mut pending = std::collections::VecDeque::new();
    // The host's time queueing each pass (packing, the copies, ~60 launches): if it is
    // small beside a pass's device time, CUDA graphs (one launch a pass) would gain little.
    let mut queueing = std::time::Duration::ZERO;
    for batch in &batches {
        let queued = std::time::Instant::now();
        pending.push_back(encoder.start(batch).unwrap());
        queueing += queued.elapsed();
        if pending.len() == 2 {
            two_at_a_time.push(encoder.finish(pending.pop_front().unwrap()).unwrap());
        }
    }
    while let Some(pass) = pending.pop_front() {
        two_at_a_time.push(encoder.finish(pass).unwrap());
    }
    let two_s = started.elapsed().as_secs_f64();
    let mut worst = f64::INFINITY;
    for (a, b) in one_at_a_time.iter().zip(&two_at_a_time) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.chunks(384).zip(b.chunks(384)) {
            worst = worst.min(cosine(x, y));
        }
    }
    println!(
        "cuda passes in flight: {} passes of 16 documents, one at a time {one_s:.3} s, two \
         at a time {two_s:.3} s ({:.2}x), lowest cosine between them {worst:.7}; the host \
         queued a pass in {:.3} ms on average, a pass took {:.3} ms two at a time",
        batches.len(),
        one_s / two_s,
        queueing.as_secs_f64() * 1e3 / batches.len() as f64,
        two_s * 1e3 / batches.len() as f64
    );
    assert!(worst >= 0.999999, "lowest cosine {worst}");

    // Three started, the first finished: its slot holds the third now.
    let first = encoder.start(&batches[0]).unwrap();
    let second = encoder.start(&batches[1]).unwrap();
    let third = encoder.start(&batches[2]).unwrap();
    let err = encoder.finish(first).unwrap_err().to_string();
    assert!(err.contains("no longer in its slot"), "{err}");
    for (pass, expected) in [(second, &one_at_a_time[1]), (third, &one_at_a_time[2])] {
        let got = encoder.finish(pass).unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(cosine(&got, expected) >= 0.999999);
    }

    check_against_references("cuda", 0.9999).await;
    let ctx = session("cuda").await;
    let text = analyze_refs(&ctx).await;
    assert!(text.contains("embed_passes_in_flight=2"), "{text}");

    // Through SQL, pieces of 64 documents in passes of at most 4,096 tokens: the worker
    // queues the next piece's passes before the last piece is collected; the vectors are
    // those of one pass at a time.
    let mut runs = vec![];
    for passes in [1, 2] {
        let ctx = session("cuda").await;
        for set in [
            "SET flumen.model_piece_rows = 64".to_string(),
            "SET flumen.embed_batch_tokens = 4096".to_string(),
            format!("SET flumen.embed_passes_in_flight = {passes}"),
        ] {
            collect(&ctx, &set).await;
        }
        ctx.register_parquet("docs", path.to_str().unwrap(), Default::default())
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let out = collect(&ctx, "SELECT id, embed(clean_text(body)) AS v FROM docs").await;
        let seconds = started.elapsed().as_secs_f64();
        let mut vectors = common::embeddings_by_id(&out);
        vectors.sort_by_key(|(id, _)| *id);
        println!(
            "cuda, pieces of 64, {passes} passes in flight: 2,000 documents in {seconds:.3} s"
        );
        runs.push(vectors);
    }
    assert_eq!(runs[0].len(), 2000);
    let mut worst = f64::INFINITY;
    for ((id, one), (id2, two)) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(id, id2);
        worst = worst.min(cosine(one, two));
    }
    assert!(
        worst >= 0.999999,
        "pieces queued ahead: lowest cosine {worst}"
    );
}
