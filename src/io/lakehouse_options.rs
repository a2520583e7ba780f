//! Options shared by the lakehouse table factories (Delta Lake, Iceberg).

use std::collections::HashMap;

use datafusion::catalog::Session;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::CreateExternalTable;

use crate::io::object_stores;

/// What a lakehouse table factory starts from: the one LOCATION, and the statement's OPTIONS
/// as pairs, after registering the location's object store from them.
pub fn prepare<'a>(
    state: &dyn Session,
    cmd: &'a CreateExternalTable,
) -> Result<(&'a str, Vec<(String, String)>)> {
    let location = single_location(cmd)?;
    let options: Vec<(String, String)> = cmd
        .options
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    object_stores::register_in_session(state, location, &options)?;
    Ok((location, options))
}

/// The time-travel option given: `Some((name, value))` for whichever of `names` is set, an
/// error naming the table when more than one is.
pub fn time_travel<'a>(
    cmd: &'a CreateExternalTable,
    table: &str,
    names: [&'static str; 2],
) -> Result<Option<(&'static str, &'a str)>> {
    let given: Vec<(&'static str, &str)> = names
        .iter()
        .filter_map(|n| option(&cmd.options, n).map(|v| (*n, v)))
        .collect();
    match given.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(*one)),
        _ => Err(DataFusionError::Plan(format!(
            "{table}: give '{}' or '{}', not both",
            names[0], names[1]
        ))),
    }
}

/// Milliseconds since the epoch from a `timestamp` option, or an error naming the table.
pub fn timestamp_option(table: &str, text: &str) -> Result<i64> {
    parse_timestamp_millis(text).ok_or_else(|| {
        DataFusionError::Plan(format!(
            "{table}: timestamp '{text}' is neither RFC 3339 (2026-01-01T00:00:00Z) nor \
             milliseconds since the epoch"
        ))
    })
}

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
