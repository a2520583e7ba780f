//! Options shared by the lakehouse table factories (Delta Lake, Iceberg).

use std::collections::HashMap;

use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::CreateExternalTable;

/// The one LOCATION of a `CREATE EXTERNAL TABLE` for a lakehouse table.
pub fn single_location(cmd: &CreateExternalTable) -> Result<&str> {
    match cmd.locations.as_slice() {
        [location] => Ok(location),
        other => Err(DataFusionError::Plan(format!(
            "a {} table takes one LOCATION, got {}",
            cmd.file_type,
            other.len()
        ))),
    }
}

/// An option given as `'name'` (DataFusion stores it as `format.name`) or `'format.name'`.
pub fn option<'a>(options: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    options
        .get(name)
        .or_else(|| options.get(&format!("format.{name}")))
        .map(String::as_str)
}

/// Milliseconds since the epoch from RFC 3339 text or a plain integer.
pub fn parse_timestamp_millis(text: &str) -> Option<i64> {
    if let Ok(ms) = text.trim().parse::<i64>() {
        return Some(ms);
    }
    let value =
        datafusion::arrow::compute::kernels::cast_utils::string_to_timestamp_nanos(text).ok()?;
    Some(value.div_euclid(1_000_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_as_rfc3339_or_millis() {
        assert_eq!(
            parse_timestamp_millis("1700000000000"),
            Some(1_700_000_000_000)
        );
        assert_eq!(
            parse_timestamp_millis("2023-11-14T22:13:20Z"),
            Some(1_700_000_000_000)
        );
        assert_eq!(parse_timestamp_millis("yesterday"), None);
    }
}
