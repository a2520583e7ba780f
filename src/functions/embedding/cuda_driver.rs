//! The CUDA driver as flumen finds it at run time: whether its libraries open (kept open
//! once they do), how many devices it reports, and errors of CUDA calls. Nothing here
//! needs a device; every function says why when there is none.

use std::sync::Mutex;

use cudarc::driver::CudaContext;
use datafusion::error::DataFusionError;

/// True when the CUDA driver library loads and reports at least one device.
pub fn cuda_available() -> bool {
    probe_device_count().is_ok_and(|n| n > 0)
}

/// Whether one of the libraries cudarc knows as `names` (its names: `cuda`, `cublas`,
/// `nvrtc`) opens; one that does stays loaded for the process. cudarc's own
/// `is_culib_present` closes the library it opened, so cudarc's first call then loads it
/// again: for cuBLAS (with cuBLASLt, ~560 MB) ~60 ms each time even from the page cache.
pub fn library_loaded(names: &[&str]) -> bool {
    static KEPT: Mutex<Vec<(String, libloading::Library)>> = Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if names.iter().any(|n| kept.iter().any(|(k, _)| k == n)) {
        return true;
    }
    for name in names {
        for file in cudarc::get_lib_name_candidates(name) {
            // SAFETY: opening a CUDA library runs only its initialisers, as cudarc's own
            // loading of the same file does.
            if let Ok(library) = unsafe { libloading::Library::new(&file) } {
                kept.push((name.to_string(), library));
                return true;
            }
        }
    }
    false
}

/// Number of CUDA devices, or why none can be used. Never panics.
pub fn probe_device_count() -> std::result::Result<usize, String> {
    if !library_loaded(&["cuda", "nvcuda"]) {
        return Err("no CUDA device: libcuda.so.1 not found".into());
    }
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(n as usize),
        Ok(Ok(_)) => Err("no CUDA device: the driver reports none".into()),
        Ok(Err(e)) => Err(format!("no CUDA device: {e}")),
        Err(_) => Err("no CUDA device: the CUDA driver failed to load".into()),
    }
}

/// An error of a CUDA call, naming what was being done.
pub(crate) fn cuda_error(what: &str, e: impl std::fmt::Debug) -> DataFusionError {
    DataFusionError::Execution(format!("embed() on CUDA: {what}: {e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUDA library found is opened once and stays mapped; one not found is not kept.
    /// Checked in a process of its own (this test binary, running only this test): another
    /// test's kernels load NVRTC through cudarc for good, which would map it either way.
    #[test]
    fn a_cuda_library_found_stays_loaded() {
        let name = "functions::embedding::cuda_driver::tests::a_cuda_library_found_stays_loaded";
        if !super::super::test_skip::alone_in_a_process(name) {
            return;
        }
        assert!(!library_loaded(&["flumen_no_such_library"]));
        if !library_loaded(&["nvrtc"]) {
            return super::super::test_skip::skip_missing_tool(
                "libnvrtc.so.13 not found (no CUDA toolkit; .ci/run installs NVRTC)",
            );
        }
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.contains("libnvrtc"), "libnvrtc is not mapped");
        assert!(library_loaded(&["nvrtc"]));
    }
}
