//! A memory cap for a bench process: a child cgroup of the one the process is in, with a
//! memory limit that counts the page cache too, so data written and read back (spill runs,
//! the output) cannot stay in the page cache of a machine with more memory than the run is
//! meant to have, and a disk bound measured with the cache dropped is a fair bound.
//!
//! Needs root and the cgroup v1 memory controller (`/sys/fs/cgroup/memory`) or cgroup v2
//! with the memory controller available to the process's cgroup. The process leaves the
//! cgroup (back to its parent) and removes it when the cap is dropped.

use std::io::{Error, ErrorKind, Result};
use std::path::{Path, PathBuf};

/// The process's stay in a memory-limited cgroup; dropping it moves the process back.
pub struct MemoryCap {
    /// The cgroup made for the cap.
    dir: PathBuf,
    /// The cgroup the process was in, to go back to.
    parent: PathBuf,
    /// The file holding the limit and the file holding the peak usage.
    peak_file: &'static str,
}

impl MemoryCap {
    /// Move this process into a new cgroup whose memory (resident and page cache) is
    /// limited to `bytes`.
    pub fn enter(bytes: u64) -> Result<Self> {
        let cgroups = std::fs::read_to_string("/proc/self/cgroup")?;
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let (parent, limit_file, peak_file) = if v1.join("memory.limit_in_bytes").exists() {
            let path = cgroups
                .lines()
                .filter_map(|l| l.splitn(3, ':').nth(2).map(|p| (l, p)))
                .find(|(l, _)| {
                    l.split(':')
                        .nth(1)
                        .is_some_and(|c| c.split(',').any(|c| c == "memory"))
                })
                .map(|(_, p)| p)
                .ok_or_else(|| {
                    Error::new(ErrorKind::NotFound, "no memory cgroup for this process")
                })?;
            (
                v1.join(path.trim_start_matches('/')),
                "memory.limit_in_bytes",
                "memory.max_usage_in_bytes",
            )
        } else {
            let path = cgroups
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .ok_or_else(|| Error::new(ErrorKind::NotFound, "no cgroup v2 for this process"))?;
            let parent = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            std::fs::write(parent.join("cgroup.subtree_control"), "+memory")?;
            (parent, "memory.max", "memory.peak")
        };
        let dir = parent.join(format!("flumen-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let cap = Self {
            dir,
            parent,
            peak_file,
        };
        std::fs::write(cap.dir.join(limit_file), bytes.to_string())?;
        std::fs::write(cap.dir.join("cgroup.procs"), std::process::id().to_string())?;
        Ok(cap)
    }

    /// The cgroup's peak memory (resident and page cache) so far, when the kernel says.
    pub fn peak(&self) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(self.peak_file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }
}

impl Drop for MemoryCap {
    fn drop(&mut self) {
        // Every thread of the process moves with its pid in `cgroup.procs`.
        let _ = std::fs::write(
            self.parent.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let _ = std::fs::remove_dir(&self.dir);
    }
}
