//! The demo `docs` table: deterministic HTML documents about a handful of topics, written as
//! Parquet, so the REPL, the examples and the benchmarks run with no data of the user's.
//!
//! Each row is `(id BIGINT, topic VARCHAR, body VARCHAR)`. A body is an HTML page of one to
//! nine paragraphs about its topic, with the markup, character references, accented and
//! full-width letters, ligatures and no-break spaces that web text has (what `clean_text`
//! removes), so `embed(clean_text(body))` and a semantic search over it are meaningful.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;

/// Rows of the demo table the REPL registers.
pub const DEFAULT_ROWS: usize = 100_000;

/// Rows per Parquet row group (and per generated batch).
const ROW_GROUP_ROWS: usize = 16_384;

/// Topics, each with words that documents about it use.
const TOPICS: &[(&str, &[&str])] = &[
    (
        "rivers",
        &[
            "river", "delta", "flood", "current", "bank", "estuary", "salmon",
        ],
    ),
    (
        "databases",
        &[
            "query",
            "index",
            "transaction",
            "table",
            "parquet",
            "join",
            "schema",
        ],
    ),
    (
        "gpus",
        &[
            "kernel",
            "tensor",
            "ＧＰＵ",
            "memory",
            "warp",
            "cuda",
            "throughput",
        ],
    ),
    (
        "compilers",
        &[
            "parser",
            "register",
            "optimizer",
            "ﬁle",
            "bytecode",
            "inline",
            "type",
        ],
    ),
    (
        "weather",
        &[
            "storm", "rain", "forecast", "pressure", "wind", "été", "cloud",
        ],
    ),
    (
        "music",
        &[
            "guitar", "chord", "tempo", "señal", "melody", "concert", "rhythm",
        ],
    ),
    (
        "chess",
        &[
            "opening", "bishop", "gambit", "endgame", "rook", "tempo", "castle",
        ],
    ),
    (
        "bread",
        &[
            "flour",
            "dough",
            "oven",
            "crust",
            "levain",
            "Brötchen",
            "bake",
        ],
    ),
];

/// Words any document may use, with character references and compatibility forms.
const COMMON: &[&str] = &[
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "with",
    "about",
    "café",
    "naïve",
    "ﬂow",
    "über",
    "&amp;",
    "&eacute;t&eacute;",
    "&#8211;",
    "&lt;note&gt;",
    "x²",
    "½",
];

/// The `docs` table's schema.
pub fn docs_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("topic", DataType::Utf8, false),
        Field::new("body", DataType::Utf8, false),
    ]))
}

/// The default place of a demo table of `rows` rows: `~/.cache/flumen/demo/`.
pub fn default_path(rows: usize) -> PathBuf {
    crate::config::cache_dir()
        .join("demo")
        .join(format!("docs-{rows}.parquet"))
}

/// Write the demo table of `rows` rows to `path` unless it is there already; returns `path`.
/// The file appears whole or not at all (written under a temporary name, then renamed).
pub fn ensure_docs(path: &Path, rows: usize) -> Result<PathBuf> {
    if !path.exists() {
        write_docs(path, rows)?;
    }
    Ok(path.to_path_buf())
}

/// Write the demo table of `rows` rows to `path` (zstd, row groups of 16,384 rows).
pub fn write_docs(path: &Path, rows: usize) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let schema = docs_schema();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let file = std::fs::File::create(&tmp)?;
    let mut writer = ArrowWriter::try_new(file, Arc::clone(&schema), Some(props))?;
    for start in (0..rows).step_by(ROW_GROUP_ROWS) {
        let ids: Vec<i64> = (start as i64..(start + ROW_GROUP_ROWS).min(rows) as i64).collect();
        let topics: Vec<&str> = ids.iter().map(|id| topic_of(*id).0).collect();
        let bodies: Vec<String> = ids.iter().map(|id| document(*id)).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(StringArray::from(topics)),
                Arc::new(StringArray::from(bodies)),
            ],
        )?;
        writer.write(&batch)?;
    }
    writer.close()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn topic_of(id: i64) -> &'static (&'static str, &'static [&'static str]) {
    &TOPICS[(id as usize).wrapping_mul(31) % TOPICS.len()]
}

/// A small deterministic generator (xorshift) seeded by the row id.
struct Rng(u64);

impl Rng {
    fn new(id: i64) -> Self {
        Self((id as u64 ^ 0x2545_f491_4f6c_dd1d).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The body of document `id`: an HTML page about its topic.
pub fn document(id: i64) -> String {
    let (topic, words) = topic_of(id);
    let mut rng = Rng::new(id);
    let mut doc = format!(
        "<html><head><title>Document {id} about {topic}</title>\
         <style>p {{ margin: 0 }}</style></head><body>\n<h1>On {topic}</h1>\n"
    );
    let paragraphs = 1 + rng.below(9);
    for p in 0..paragraphs {
        doc.push_str(if p % 3 == 2 {
            "<h2>"
        } else {
            "<p class=\"text\">"
        });
        let length = 8 + rng.below(40);
        for w in 0..length {
            let word = if rng.below(3) == 0 {
                words[rng.below(words.len())]
            } else {
                COMMON[rng.below(COMMON.len())]
            };
            if w % 11 == 5 {
                doc.push_str("<b>");
                doc.push_str(word);
                doc.push_str("</b>");
            } else {
                doc.push_str(word);
            }
            doc.push(if w % 7 == 3 { '\u{a0}' } else { ' ' });
        }
        doc.push_str(if p % 3 == 2 { "</h2>\n" } else { "</p>\n" });
    }
    doc.push_str("<!-- generated by flumen --></body></html>");
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_deterministic_and_about_their_topic() {
        assert_eq!(document(42), document(42));
        assert_ne!(document(42), document(43));
        let (topic, _) = topic_of(7);
        assert!(document(7).contains(&format!("about {topic}")));
    }

    #[test]
    fn the_table_is_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs.parquet");
        ensure_docs(&path, 20_000).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let reader = datafusion::parquet::file::reader::SerializedFileReader::new(file).unwrap();
        use datafusion::parquet::file::reader::FileReader;
        assert_eq!(reader.metadata().file_metadata().num_rows(), 20_000);
        assert_eq!(reader.metadata().num_row_groups(), 2);
        // Only the table is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
