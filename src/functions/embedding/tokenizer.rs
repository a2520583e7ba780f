//! WordPiece tokenization for the embedding model, set up the way sentence-transformers runs
//! it: truncation at the model's max_seq_length, no padding (flumen packs sequences).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use datafusion::error::{DataFusionError, Result};
use tokenizers::{Tokenizer, TruncationParams};

use super::model_files::model_error;

/// The longest input, in tokens (special tokens included), the model is run on.
pub const MAX_SEQ_LEN: usize = 256;

/// Tokenizers this process has loaded, by model directory: CPU tasks tokenize with them,
/// so `tokenizer.json` is read once per process, not once per task.
static LOADED: OnceLock<Mutex<HashMap<PathBuf, Arc<SentenceTokenizer>>>> = OnceLock::new();

/// A loaded `tokenizer.json`.
pub struct SentenceTokenizer {
    inner: Tokenizer,
}

impl SentenceTokenizer {
    /// Load `tokenizer.json` from the model directory. The file itself asks for padding to
    /// 128 and truncation at 128; both are overridden to match sentence-transformers.
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("tokenizer.json");
        let mut inner = Tokenizer::from_file(&path)
            .map_err(|e| model_error(format!("cannot read {}: {e}", path.display())))?;
        inner.with_padding(None);
        inner
            .with_truncation(Some(TruncationParams {
                max_length: MAX_SEQ_LEN,
                ..Default::default()
            }))
            .map_err(|e| DataFusionError::Execution(format!("tokenizer truncation: {e}")))?;
        Ok(Self { inner })
    }

    /// The tokenizer of the model in `model_dir`, loaded once per process and shared.
    pub fn shared(model_dir: &Path) -> Result<Arc<Self>> {
        let loaded = LOADED.get_or_init(Default::default);
        if let Some(found) = loaded.lock().unwrap().get(model_dir) {
            return Ok(Arc::clone(found));
        }
        // Loaded outside the lock: two tasks may both read the file once, first one kept.
        let tokenizer = Arc::new(Self::load(model_dir)?);
        let mut loaded = loaded.lock().unwrap();
        Ok(Arc::clone(
            loaded.entry(model_dir.to_path_buf()).or_insert(tokenizer),
        ))
    }

    /// Token ids of one text, as [`encode`](Self::encode) gives them, on the calling thread
    /// alone (a CPU task must not fan out over the machine's cores).
    pub fn encode_one(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| DataFusionError::Execution(format!("tokenizing for embed(): {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of each text, `[CLS] … [SEP]`, at most [`MAX_SEQ_LEN`] long.
    pub fn encode(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        let encodings = self
            .inner
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| DataFusionError::Execution(format!("tokenizing for embed(): {e}")))?;
        Ok(encodings
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }
}
