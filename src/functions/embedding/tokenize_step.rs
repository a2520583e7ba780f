//! `embed_tokens(text)`: `embed`'s CPU step, the model's tokenizer as a plain scalar function.
//!
//! The planner rewrites `embed(x)` as `embed(embed_tokens(x))` (`flumen.preprocess_on_cpu`),
//! so texts are tokenized by CPU tasks, in parallel with the model, and an accelerator worker
//! gets token ids: a `List(UInt32)` per row, `[CLS] … [SEP]`, truncated at the model's 256
//! positions exactly as the worker would tokenize. NULL in, NULL out.

use std::sync::{Arc, OnceLock};

use datafusion::arrow::array::{Array, ArrayRef, ListBuilder, UInt32Builder};
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::common::cast::{as_large_string_array, as_string_array, as_string_view_array};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

use super::model_files;
use super::tokenizer::SentenceTokenizer;
use crate::config::FlumenConfig;

/// The type `embed_tokens` returns: one list of token ids per text.
pub fn token_ids_type() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(DataType::UInt32, false)))
}

/// The `embed_tokens` scalar function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct EmbedTokens {
    signature: Signature,
}

impl Default for EmbedTokens {
    fn default() -> Self {
        Self {
            signature: Signature::string(1, Volatility::Immutable),
        }
    }
}

impl ScalarUDFImpl for EmbedTokens {
    fn name(&self) -> &str {
        "embed_tokens"
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(token_ids_type())
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let tokenizer = tokenizer_for(&args.config_options)?;
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let input = &arrays[0];
        let ids = match input.data_type() {
            DataType::Utf8 => tokenize_all(&tokenizer, as_string_array(input)?.iter())?,
            DataType::LargeUtf8 => tokenize_all(&tokenizer, as_large_string_array(input)?.iter())?,
            DataType::Utf8View => tokenize_all(&tokenizer, as_string_view_array(input)?.iter())?,
            other => {
                return Err(DataFusionError::Execution(format!(
                    "embed() takes text (Utf8, LargeUtf8 or Utf8View), got {other}"
                )));
            }
        };
        Ok(ColumnarValue::Array(ids))
    }
}

/// `embed_tokens` as a `ScalarUDF`, one per process (the step `embed` declares).
pub fn embed_tokens_udf() -> Arc<ScalarUDF> {
    static UDF: OnceLock<Arc<ScalarUDF>> = OnceLock::new();
    Arc::clone(UDF.get_or_init(|| Arc::new(ScalarUDF::new_from_impl(EmbedTokens::default()))))
}

/// The tokenizer of the session's model (`flumen.model_dir`).
fn tokenizer_for(config: &ConfigOptions) -> Result<Arc<SentenceTokenizer>> {
    let setting = config
        .extensions
        .get::<FlumenConfig>()
        .map(|flumen| flumen.model_dir.clone())
        .unwrap_or_default();
    let dir = model_files::model_dir(&setting);
    model_files::check_model_dir(&dir)?;
    SentenceTokenizer::shared(&dir)
}

/// Token ids of every text, as one `List(UInt32)` array.
fn tokenize_all<'a>(
    tokenizer: &SentenceTokenizer,
    texts: impl Iterator<Item = Option<&'a str>>,
) -> Result<ArrayRef> {
    let mut builder = ListBuilder::new(UInt32Builder::new())
        .with_field(Arc::new(Field::new_list_field(DataType::UInt32, false)));
    for text in texts {
        match text {
            Some(text) => {
                builder.values().append_slice(&tokenizer.encode_one(text)?);
                builder.append(true);
            }
            None => builder.append(false),
        }
    }
    let array = builder.finish();
    debug_assert_eq!(array.data_type(), &token_ids_type());
    Ok(Arc::new(array))
}
