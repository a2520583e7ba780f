//! The process's resident memory, for benches that report a run's peak RSS.

/// A run's RSS figures: started when the run starts, read when it ends.
pub struct RssWatch {
    /// RSS when the run started (the binary, the runtime, what earlier runs left).
    pub base: u64,
}

impl RssWatch {
    /// Reset the process's RSS high-water mark (Linux `clear_refs` 5) and note the RSS now.
    pub fn start() -> Self {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        Self {
            base: status_bytes("VmRSS:"),
        }
    }

    /// The process's peak RSS since the start.
    pub fn peak(&self) -> u64 {
        peak_bytes()
    }

    /// How far the peak rose above the RSS at the start.
    pub fn rise(&self) -> u64 {
        self.peak().saturating_sub(self.base)
    }
}

/// The process's peak RSS (`VmHWM`): since its exec, or since an [`RssWatch`] reset it.
/// Unlike `getrusage`'s `ru_maxrss`, it does not keep the parent's peak across fork and exec.
pub fn peak_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// A size line of `/proc/self/status` (`VmHWM:`, `VmRSS:`) in bytes; 0 when unreadable.
fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}
