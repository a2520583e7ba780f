//! Temporary directories a process owns: removed when dropped, when the process ends
//! through [`remove_owned_dirs`], and otherwise (a process killed with SIGKILL, or one that
//! left through `std::process::exit`) by the next flumen process that makes one beside them.
//!
//! Ownership is a lock: each directory holds a file, `.owner`, that its process keeps
//! locked (`flock`) while it lives. The kernel drops the lock when the process dies however
//! it dies, so a directory whose `.owner` can be locked by someone else has no owner left.
//! The lock file is locked before it gets its name, so no directory is ever seen with an
//! unlocked `.owner` while its process lives. A directory without `.owner` (one being made
//! right now) is left alone.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tempfile::TempDir;

/// The lock file's name inside an owned directory.
const OWNER_FILE: &str = ".owner";

/// The owned directories of this process still in place (for [`remove_owned_dirs`]).
static OWNED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// `(parent, prefix)` pairs this process already swept: once each is enough, since what it
/// finds was left by processes that ended before it looked.
static SWEPT: Mutex<Option<HashSet<(PathBuf, String)>>> = Mutex::new(None);

/// A temporary directory this process owns (see the module's documentation).
#[derive(Debug)]
pub struct OwnedDir {
    dir: TempDir,
    /// Locked while it is open: the directory's owner is alive.
    _owner: File,
}

impl OwnedDir {
    /// A new directory named `prefix` and a random suffix under `parent` (else the
    /// system's temporary directory), after the directories of that prefix there whose
    /// owner is gone were removed.
    pub fn create(parent: Option<&Path>, prefix: &str) -> std::io::Result<Self> {
        let parent = match parent {
            Some(parent) => {
                std::fs::create_dir_all(parent)?;
                parent.to_path_buf()
            }
            None => std::env::temp_dir(),
        };
        sweep_once(&parent, prefix);
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(&parent)?;
        // Locked under a name no sweeper reads, then named: `.owner` is never unlocked
        // while this process lives.
        let pending = dir.path().join(".owner-pending");
        let owner = File::create(&pending)?;
        owner.lock()?;
        std::fs::rename(&pending, dir.path().join(OWNER_FILE))?;
        OWNED.lock().unwrap().push(dir.path().to_path_buf());
        Ok(Self { dir, _owner: owner })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for OwnedDir {
    fn drop(&mut self) {
        OWNED.lock().unwrap().retain(|p| p != self.dir.path());
        // `TempDir`'s own drop removes the directory.
    }
}

/// Remove every owned directory of this process still in place: for a process about to
/// leave through `std::process::exit`, which runs no destructor.
pub fn remove_owned_dirs() {
    remove_owned_where(|_| true);
}

/// Remove the owned directories `which` picks.
fn remove_owned_where(which: impl Fn(&Path) -> bool) {
    let picked: Vec<PathBuf> = {
        let mut owned = OWNED.lock().unwrap();
        let (picked, kept) = owned.drain(..).partition(|dir| which(dir));
        *owned = kept;
        picked
    };
    for dir in picked {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// [`sweep`] `parent` for `prefix`, the first time this process asks.
fn sweep_once(parent: &Path, prefix: &str) {
    let key = (parent.to_path_buf(), prefix.to_string());
    if !SWEPT.lock().unwrap().get_or_insert_default().insert(key) {
        return;
    }
    let removed = sweep(parent, prefix);
    if removed > 0 {
        log::info!(
            "removed {removed} directories {}{prefix}* left by flumen processes that ended",
            parent.display()
        );
    }
}

/// Remove the directories named `prefix...` under `parent` whose owner is gone (their
/// `.owner` can be locked); returns how many.
pub fn sweep(parent: &Path, prefix: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(owner) = File::open(path.join(OWNER_FILE)) else {
            continue;
        };
        if owner.try_lock().is_ok() && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory whose owner is alive stays; one whose owner let go of it (as a killed
    /// process does) is swept; one being made (no `.owner` yet) stays.
    #[test]
    fn only_directories_without_a_live_owner_are_swept() {
        let parent = tempfile::tempdir().unwrap();
        let live = OwnedDir::create(Some(parent.path()), "flumen-test-").unwrap();
        // An owner that died: its directory and lock file are there, the lock is not.
        let dead = parent.path().join("flumen-test-dead");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(OWNER_FILE), b"").unwrap();
        std::fs::write(dead.join("block.arrow"), b"rows").unwrap();
        let making = parent.path().join("flumen-test-making");
        std::fs::create_dir(&making).unwrap();
        let other = parent.path().join("other-dead");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join(OWNER_FILE), b"").unwrap();

        assert_eq!(sweep(parent.path(), "flumen-test-"), 1);
        assert!(
            live.path().join(OWNER_FILE).exists(),
            "a live owner's directory stays"
        );
        assert!(!dead.exists(), "a dead owner's directory goes");
        assert!(making.exists(), "a directory being made stays");
        assert!(other.exists(), "another prefix is not looked at");

        let path = live.path().to_path_buf();
        drop(live);
        assert!(!path.exists(), "a dropped directory goes");
    }

    /// What `std::process::exit` would leave (no destructor runs) is listed, and removed
    /// by [`remove_owned_dirs`] (here only this test's: other tests' run beside it).
    #[test]
    fn owned_directories_go_before_an_exit() {
        let parent = tempfile::tempdir().unwrap();
        let dir = OwnedDir::create(Some(parent.path()), "flumen-exit-").unwrap();
        let path = dir.path().to_path_buf();
        std::mem::forget(dir);
        assert!(OWNED.lock().unwrap().contains(&path));
        remove_owned_where(|dir| dir == path);
        assert!(!path.exists());
        assert!(!OWNED.lock().unwrap().contains(&path));
    }

    /// A directory left by a process killed with SIGKILL (a child of this test binary that
    /// made one and waited) is swept by the next one made beside it.
    #[test]
    fn a_killed_owners_directory_is_swept() {
        const PARENT: &str = "FLUMEN_TEST_OWNED_DIR_PARENT";
        if let Some(parent) = std::env::var_os(PARENT) {
            let dir = OwnedDir::create(Some(Path::new(&parent)), "flumen-killed-").unwrap();
            println!("made {}", dir.path().display());
            std::thread::sleep(std::time::Duration::from_secs(60));
            return;
        }
        let parent = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "store::owned_dir::tests::a_killed_owners_directory_is_swept",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PARENT, parent.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let made = || {
            std::fs::read_dir(parent.path())
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .find(|p| p.join(OWNER_FILE).exists())
        };
        let started = std::time::Instant::now();
        let left = loop {
            if let Some(dir) = made() {
                break dir;
            }
            assert!(
                started.elapsed().as_secs() < 30,
                "the child made no directory"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(sweep(parent.path(), "flumen-killed-"), 0, "its owner lives");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(left.exists(), "a killed process removes nothing");
        let next = OwnedDir::create(Some(parent.path()), "flumen-killed-").unwrap();
        assert!(!left.exists(), "the next directory made beside it swept it");
        assert!(next.path().exists());
    }
}
