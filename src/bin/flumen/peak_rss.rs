//! The peak resident memory of one statement, for the timing line: the kernel's high-water
//! mark of this process's resident set (`VmHWM` in `/proc/self/status`), reset to the
//! current resident set before the statement (writing `5` to `/proc/self/clear_refs`), so
//! the figure is the statement's own peak, read exactly when it ends rather than sampled.
//! Linux only; elsewhere (or where `/proc` is not mounted) the timing line leaves it out.

/// A statement's peak resident memory, started with [`PeakRss::start`].
pub struct PeakRss {
    /// The high-water mark was reset, so reading it gives this statement's peak.
    reset: bool,
}

impl PeakRss {
    /// Reset the process's high-water mark to its resident memory now.
    pub fn start() -> Self {
        let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        Self { reset }
    }

    /// The most resident memory the process held since [`PeakRss::start`], in bytes, where
    /// the system tells it.
    pub fn bytes(&self) -> Option<u64> {
        if !self.reset {
            return None;
        }
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
}

/// The integration tests' skip rules (what is missing fails under CI).
#[cfg(test)]
#[path = "../../../tests/common/skip.rs"]
mod test_skip;

#[cfg(test)]
mod tests {
    use super::test_skip;
    use super::*;

    /// Maps `bytes` of anonymous memory, writes every page, and unmaps it: resident memory
    /// the kernel counts whatever the allocator keeps.
    fn touch_and_release(bytes: usize) -> impl FnOnce() {
        // SAFETY: a fresh private anonymous mapping, written within its length and unmapped
        // once by the returned closure.
        unsafe {
            let at = libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(at, libc::MAP_FAILED);
            std::ptr::write_bytes(at as *mut u8, 1, bytes);
            move || {
                libc::munmap(at, bytes);
            }
        }
    }

    /// Checked in a process of its own (this test binary, running only this test): the
    /// peak is the whole process's, and other tests allocating on their threads meanwhile
    /// moved it by megabytes (one CI run saw the next statement's peak 5 MiB over the
    /// mark).
    #[test]
    fn a_statements_peak_covers_what_it_touched_and_forgets_what_came_before() {
        let name = "peak_rss::tests::a_statements_peak_covers_what_it_touched_and_forgets_what_came_before";
        if !test_skip::alone_in_a_process(name) {
            return;
        }
        if std::fs::write("/proc/self/clear_refs", "5").is_err() {
            // Under CI a missing kernel feature fails like a missing tool.
            return test_skip::skip_missing_tool(
                "this system cannot reset /proc/self's peak resident memory",
            );
        }
        const MIB: u64 = 1 << 20;
        let statement = PeakRss::start();
        let idle = statement.bytes().unwrap();
        let release = touch_and_release(32 << 20);
        let busy = statement.bytes().unwrap();
        release();
        assert!(
            busy >= idle + 30 * MIB,
            "peak {busy} after touching 32 MiB over {idle}"
        );
        let next = PeakRss::start().bytes().unwrap();
        assert!(
            next + 30 * MIB <= busy,
            "the next statement's peak {next} still counts the 32 MiB released before it ({busy})"
        );
    }
}
