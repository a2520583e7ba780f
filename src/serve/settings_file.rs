//! The operator's settings file (`flumen serve --settings FILE`): one `name = value` per line
//! (`#` starts a comment), applied to the server's session at startup as `SET name = 'value'`
//! would, before any client connects. It is where the operator settings without a flag of
//! their own are fixed (`flumen.cpu_slots`, `flumen.spill_dir`, `datafusion.runtime.*`, ...;
//! see [`super::policy::OPERATOR_SETTINGS`]), and the defaults of client settings. A line
//! that does not parse, or names no setting, stops the server naming the line.

use std::path::Path;

use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;

/// The `(name, value)` settings of settings-file `text`; `source` names it in errors.
pub fn parse(text: &str, source: &str) -> Result<Vec<(String, String)>> {
    let mut settings = vec![];
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| {
            DataFusionError::Configuration(format!("{source} line {}: {why}: {line}", n + 1))
        };
        let (name, value) = line
            .split_once('=')
            .ok_or_else(|| bad("not `name = value`"))?;
        let name = name.trim().to_ascii_lowercase();
        let valid = !name.is_empty()
            && name.contains('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !valid {
            return Err(bad("a setting's name is like flumen.cpu_slots"));
        }
        let value = value.trim();
        let value = (value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
            .or_else(|| value.strip_prefix('"').and_then(|v| v.strip_suffix('"')))
            .unwrap_or(value);
        settings.push((name, value.to_string()));
    }
    Ok(settings)
}

/// Apply the settings file at `path` to `ctx` (the server's session, which every client's
/// copies). Returns how many settings it set.
pub async fn apply(ctx: &SessionContext, path: &Path) -> Result<usize> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| DataFusionError::Configuration(format!("reading {source}: {e}")))?;
    let settings = parse(&text, &source)?;
    for (name, value) in &settings {
        let quoted = value.replace('\'', "''");
        ctx.sql(&format!("SET {name} = '{quoted}'"))
            .await
            .map_err(|e| {
                DataFusionError::Configuration(format!("{source}: setting {name}: {e}"))
            })?;
    }
    Ok(settings.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_into_settings_and_bad_ones_are_named() {
        let text = "# the operator's\nflumen.cpu_slots = 3\n\nflumen.spill_dir = '/srv/spill' # here\nDATAFUSION.execution.batch_size=\"4096\"\n";
        assert_eq!(
            parse(text, "f").unwrap(),
            vec![
                ("flumen.cpu_slots".into(), "3".into()),
                ("flumen.spill_dir".into(), "/srv/spill".into()),
                ("datafusion.execution.batch_size".into(), "4096".into()),
            ]
        );
        let err = parse("flumen.cpu_slots 3", "f").unwrap_err().to_string();
        assert!(
            err.contains("f line 1") && err.contains("name = value"),
            "{err}"
        );
        let err = parse("x = 1; DROP TABLE t", "f").unwrap_err().to_string();
        assert!(err.contains("like flumen.cpu_slots"), "{err}");
    }

    #[tokio::test]
    async fn a_file_sets_the_servers_session_and_an_unknown_name_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = crate::session(crate::FlumenConfig::default());
        let file = dir.path().join("settings");
        std::fs::write(
            &file,
            "flumen.cpu_slots = 3\nflumen.target_block_rows = 1000\n",
        )
        .unwrap();
        assert_eq!(apply(&ctx, &file).await.unwrap(), 2);
        let config = ctx
            .state()
            .config()
            .options()
            .extensions
            .get::<crate::FlumenConfig>()
            .cloned()
            .unwrap();
        assert_eq!((config.cpu_slots, config.target_block_rows), (3, 1000));
        std::fs::write(&file, "flumen.no_such_setting = 1\n").unwrap();
        let err = apply(&ctx, &file).await.unwrap_err().to_string();
        assert!(err.contains("flumen.no_such_setting"), "{err}");
    }
}
