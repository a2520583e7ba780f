//! Where a model's cache segments live: a local directory, or a prefix of an object store
//! (`s3://bucket/prefix`, `gs://`, `az://`: credentials and endpoint from the process's
//! environment, `AWS_*` and the like, as the operator set it).
//!
//! A local segment is written under a temporary name, synced and renamed; an object store's
//! put is atomic. Object-store calls run on a small runtime of the cache's own, waited for
//! from the calling thread (a model call is synchronous).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use datafusion::arrow::array::ArrayRef;
use datafusion::error::{DataFusionError, Result};
use futures::TryStreamExt;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::segment::{self, EXTENSION, Segment};

/// One model's segments: where they are.
#[derive(Debug, Clone)]
pub enum Place {
    /// A local directory.
    Local(PathBuf),
    /// A prefix of an object store.
    Remote {
        /// The store.
        store: Arc<dyn ObjectStore>,
        /// The prefix (the model's directory).
        dir: StorePath,
        /// The prefix as a URL, for errors.
        url: String,
    },
}

/// A segment as a listing shows it.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Its name in the directory.
    pub name: String,
    /// Its size.
    pub bytes: u64,
    /// When it was written.
    pub modified: SystemTime,
}

impl Place {
    /// The place of the model directory `name` under the cache root `root` (a path or a
    /// URL), made if local.
    pub fn open(root: &str, name: &str) -> Result<Self> {
        let failed = |e: &dyn std::fmt::Display| {
            DataFusionError::Execution(format!("flumen.model_cache '{root}': {e}"))
        };
        match url::Url::parse(root) {
            Ok(url) if url.scheme().len() > 1 && url.scheme() != "file" => {
                let credentials = std::env::vars().filter(|(key, _)| {
                    ["AWS_", "GOOGLE_", "AZURE_"]
                        .iter()
                        .any(|p| key.starts_with(p))
                });
                let (store, base) = object_store::parse_url_opts(
                    &url,
                    credentials.map(|(k, v)| (k.to_lowercase(), v)),
                )
                .map_err(|e| failed(&e))?;
                let dir = base.clone().join(name);
                Ok(Self::Remote {
                    store: Arc::from(store),
                    dir,
                    url: format!("{}/{name}", root.trim_end_matches('/')),
                })
            }
            _ => {
                let dir = PathBuf::from(root.strip_prefix("file://").unwrap_or(root)).join(name);
                std::fs::create_dir_all(&dir)
                    .map_err(|e| failed(&format!("cannot create {}: {e}", dir.display())))?;
                Ok(Self::Local(dir))
            }
        }
    }

    /// The segments there now.
    pub fn list(&self) -> Vec<Listed> {
        match self {
            Self::Local(dir) => (std::fs::read_dir(dir).into_iter().flatten().flatten())
                .filter(|e| e.path().extension().is_some_and(|x| x == EXTENSION))
                .filter_map(|e| {
                    let meta = e.metadata().ok()?;
                    Some(Listed {
                        name: e.file_name().to_string_lossy().to_string(),
                        bytes: meta.len(),
                        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    })
                })
                .collect(),
            Self::Remote { store, dir, .. } => {
                let (store, dir) = (Arc::clone(store), dir.clone());
                block(async move {
                    store
                        .list(Some(&dir))
                        .try_collect::<Vec<_>>()
                        .await
                        .unwrap_or_default()
                })
                .into_iter()
                .filter_map(|meta| {
                    let name = meta.location.filename()?.to_string();
                    name.ends_with(&format!(".{EXTENSION}")).then(|| Listed {
                        name,
                        bytes: meta.size,
                        modified: meta.last_modified.into(),
                    })
                })
                .collect()
            }
        }
    }

    /// Read segment `name` (checked against its checksum).
    pub fn read(&self, name: &str) -> Result<Segment> {
        match self {
            Self::Local(dir) => segment::read(&dir.join(name)),
            Self::Remote { store, dir, url } => {
                let (store, path) = (Arc::clone(store), dir.clone().join(name));
                let bytes =
                    block(async move { store.get(&path).await?.bytes().await }).map_err(|e| {
                        DataFusionError::Execution(format!("model cache segment {url}/{name}: {e}"))
                    })?;
                segment::decode(&bytes, &format!("{url}/{name}"))
            }
        }
    }

    /// Write a new segment of `keys` and `values`; its name and size.
    pub fn write(&self, keys: &[[u8; 32]], values: &ArrayRef) -> Result<(String, u64)> {
        match self {
            Self::Local(dir) => {
                let (path, bytes) = segment::write(dir, keys, values)?;
                let name = path.file_name().map(|n| n.to_string_lossy().to_string());
                Ok((name.unwrap_or_default(), bytes))
            }
            Self::Remote { store, dir, url } => {
                let bytes = segment::encode(keys, values)?;
                let size = bytes.len() as u64;
                let name = format!("{}.{EXTENSION}", segment::unique_name());
                let (store, path) = (Arc::clone(store), dir.clone().join(name.as_str()));
                block(async move { store.put(&path, bytes.into()).await }).map_err(|e| {
                    DataFusionError::Execution(format!(
                        "model cache: cannot write {url}/{name}: {e}"
                    ))
                })?;
                Ok((name, size))
            }
        }
    }

    /// Remove segment `name` (a damaged one, or one evicted).
    pub fn remove(&self, name: &str) {
        match self {
            Self::Local(dir) => {
                let _ = std::fs::remove_file(dir.join(name));
            }
            Self::Remote { store, dir, .. } => {
                let (store, path) = (Arc::clone(store), dir.clone().join(name));
                let _ = block(async move { store.delete(&path).await });
            }
        }
    }

    /// Write the identity's words beside the segments, unless there already.
    pub fn describe(&self, identity: &str) {
        match self {
            Self::Local(dir) => {
                let path = dir.join(super::IDENTITY_FILE);
                if !path.exists() {
                    // A lost race writes the same text.
                    let _ = std::fs::write(path, format!("{identity}\n"));
                }
            }
            Self::Remote { store, dir, .. } => {
                let (store, path) = (Arc::clone(store), dir.clone().join(super::IDENTITY_FILE));
                let text = format!("{identity}\n");
                let _ = block(async move { store.put(&path, text.into_bytes().into()).await });
            }
        }
    }
}

/// Run `work` on the cache's own runtime and wait for it on this thread.
fn block<T: Send + 'static>(work: impl Future<Output = T> + Send + 'static) -> T {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("flumen-model-cache")
            .enable_all()
            .build()
            .expect("the model cache's I/O runtime")
    });
    futures::executor::block_on(runtime.spawn(work)).expect("a model cache I/O task panicked")
}
