//! `clean_text(text)`: the preprocessing web text needs before a model sees it.
//!
//! It drops HTML markup (tags, comments, and the contents of `<script>` and `<style>`),
//! decodes character references (`&amp;`, `&#233;`, `&eacute;`), applies Unicode NFKC
//! normalization (ligatures, full-width forms, non-breaking spaces become their plain forms),
//! removes control and format characters, and collapses runs of whitespace into one space.
//! NULL in, NULL out; Utf8, LargeUtf8 and Utf8View in, Utf8 out. It is ordinary CPU work:
//! in `embed(clean_text(body))` the planner runs it in CPU tasks, not on the accelerator pool.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, StringBuilder};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::cast::{as_large_string_array, as_string_array, as_string_view_array};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use unicode_normalization::UnicodeNormalization;

/// The `clean_text` scalar function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CleanText {
    signature: Signature,
}

impl Default for CleanText {
    fn default() -> Self {
        Self {
            signature: Signature::string(1, Volatility::Immutable),
        }
    }
}

impl ScalarUDFImpl for CleanText {
    fn name(&self) -> &str {
        "clean_text"
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Utf8)
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let input = &arrays[0];
        let out: ArrayRef = match input.data_type() {
            DataType::Utf8 => clean_all(as_string_array(input)?.iter())?,
            DataType::LargeUtf8 => clean_all(as_large_string_array(input)?.iter())?,
            DataType::Utf8View => clean_all(as_string_view_array(input)?.iter())?,
            other => {
                return Err(DataFusionError::Execution(format!(
                    "clean_text expects text, got {other}"
                )));
            }
        };
        Ok(ColumnarValue::Array(out))
    }
}

/// `clean_text` as a `ScalarUDF` to register.
pub fn clean_text_udf() -> ScalarUDF {
    ScalarUDF::new_from_impl(CleanText::default())
}

/// The most bytes of text one Utf8 array holds (its offsets are 32-bit).
const MAX_UTF8_BYTES: usize = i32::MAX as usize;

/// Clean every value into one Utf8 array; an error, before any work, for a value over
/// [`MAX_UTF8_BYTES`], and for cleaned values that together would not fit one array.
fn clean_all<'a>(values: impl Iterator<Item = Option<&'a str>>) -> Result<ArrayRef> {
    let too_large = |what: String| {
        DataFusionError::Execution(format!(
            "clean_text: {what} is over the {MAX_UTF8_BYTES} bytes (2 GiB) one Utf8 result can \
             hold; cut the text into pieces first (e.g. with substr)"
        ))
    };
    let mut builder = StringBuilder::new();
    let mut scratch = String::new();
    let mut out = String::new();
    let mut total = 0usize;
    for value in values {
        match value {
            Some(text) => {
                if text.len() > MAX_UTF8_BYTES {
                    return Err(too_large(format!("a text of {} bytes", text.len())));
                }
                clean_into(text, &mut scratch, &mut out);
                total += out.len();
                if total > MAX_UTF8_BYTES {
                    return Err(too_large(format!(
                        "the cleaned texts of one batch ({total} bytes so far)"
                    )));
                }
                builder.append_value(&out);
            }
            None => builder.append_null(),
        }
    }
    Ok(Arc::new(builder.finish()))
}

/// Clean one text into `out` (`scratch` is reused working space).
pub fn clean_into(text: &str, scratch: &mut String, out: &mut String) {
    scratch.clear();
    strip_markup(text, scratch);
    let decoded = html_escape::decode_html_entities(scratch.as_str());
    out.clear();
    let mut pending_space = false;
    for c in decoded.nfkc() {
        if c.is_whitespace() {
            pending_space = !out.is_empty();
        } else if c.is_control() || is_format(c) {
            continue;
        } else {
            if pending_space {
                out.push(' ');
                pending_space = false;
            }
            out.push(c);
        }
    }
}

/// Zero-width and directional format characters that carry no text.
fn is_format(c: char) -> bool {
    matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}')
}

/// Copy `text` without its markup: an inline tag (`<b>`, `<span>`, ...) vanishes, any other
/// tag becomes a space (so the words of two paragraphs stay apart), comments and
/// `<script>`/`<style>` elements (with their contents) become a space. A `<` that opens no
/// tag (`a < b`) is kept.
fn strip_markup(text: &str, out: &mut String) {
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut copied = 0;
    while let Some(offset) = memchr::memchr(b'<', &bytes[i..]) {
        let start = i + offset;
        let rest = &text[start..];
        let end = if rest.starts_with("<!--") {
            rest.find("-->").map(|e| start + e + 3)
        } else if starts_with_tag(rest, "script") || starts_with_tag(rest, "style") {
            let name = if starts_with_tag(rest, "script") {
                "</script"
            } else {
                "</style"
            };
            find_ignore_case(rest, name)
                .and_then(|close| rest[close..].find('>').map(|e| start + close + e + 1))
        } else if rest[1..].starts_with(|c: char| c.is_ascii_alphabetic() || c == '/' || c == '!') {
            rest.find('>').map(|e| start + e + 1)
        } else {
            None
        };
        match end {
            Some(end) => {
                out.push_str(&text[copied..start]);
                if !is_inline_tag(&text[start..end]) {
                    out.push(' ');
                }
                copied = end;
                i = end;
            }
            None => i = start + 1,
        }
        if i >= bytes.len() {
            break;
        }
    }
    out.push_str(&text[copied..]);
}

/// Elements that sit inside a line of text: their tags separate no words.
const INLINE_TAGS: &[&str] = &[
    "a", "abbr", "b", "bdi", "bdo", "cite", "code", "data", "dfn", "em", "font", "i", "kbd",
    "mark", "q", "s", "samp", "small", "span", "strong", "sub", "sup", "time", "u", "var", "wbr",
];

/// True for an opening or closing tag of an inline element.
fn is_inline_tag(tag: &str) -> bool {
    let name = tag
        .trim_start_matches('<')
        .trim_start_matches('/')
        .split(|c: char| !c.is_ascii_alphanumeric())
        .next()
        .unwrap_or("");
    INLINE_TAGS.iter().any(|t| t.eq_ignore_ascii_case(name))
}

/// True when `rest` opens the element `name` (`<script>`, `<SCRIPT type=...>`).
fn starts_with_tag(rest: &str, name: &str) -> bool {
    let after = &rest.as_bytes()[1..];
    after.len() > name.len()
        && after[..name.len()].eq_ignore_ascii_case(name.as_bytes())
        && !after[name.len()].is_ascii_alphanumeric()
}

fn find_ignore_case(haystack: &str, needle: &str) -> Option<usize> {
    let needle = needle.as_bytes();
    haystack
        .as_bytes()
        .windows(needle.len())
        .position(|w| w.eq_ignore_ascii_case(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(text: &str) -> String {
        let (mut scratch, mut out) = (String::new(), String::new());
        clean_into(text, &mut scratch, &mut out);
        out
    }

    #[test]
    fn markup_entities_and_unicode_are_cleaned() {
        assert_eq!(
            clean("<p>Caf&eacute; &amp; <b>cr&#232;me</b></p>\n\n<br/>br\u{fb01}ne"),
            "Café & crème brfine"
        );
        assert_eq!(clean("a < b and c > d"), "a < b and c > d");
        assert_eq!(
            clean("<style>p { color: red }</style>x<SCRIPT type='t'>if (a<b) {}</script >y"),
            "x y"
        );
        assert_eq!(clean("one<!-- hidden -->two"), "one two");
        // Full-width letters, no-break spaces, zero-width and control characters.
        assert_eq!(
            clean("\u{ff21}\u{ff22}\u{a0}\u{a0}c\u{200b}d\u{7}"),
            "AB cd"
        );
        assert_eq!(clean("   "), "");
        assert_eq!(clean("<unclosed"), "<unclosed");
        assert_eq!(clean("<p>one</p><p>t<I>w</I>o</p>"), "one two");
    }
}
