//! The CUDA kernels' code: `cuda_kernels.cu` compiled by NVRTC (PTX, or a CUBIN for the
//! device's own architecture, so a newer NVRTC never emits PTX the driver refuses), and the
//! CUBINs kept on disk under `<cache>/flumen/kernels/`, so a later worker or process loads
//! one instead of compiling. Needs only `libnvrtc.so.13`, no device.

use std::ffi::{CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::Ptx;
use datafusion::error::{DataFusionError, Result};

use super::cuda_driver::{cuda_error, library_loaded};

/// The kernels' CUDA C source.
pub const KERNEL_SOURCE: &str = include_str!("cuda_kernels.cu");

/// Compile the kernels with NVRTC: a CUBIN for `sm_{major}{minor}` when an architecture is
/// given, else PTX. Needs only `libnvrtc.so.13`, no device.
pub fn compile_kernels(arch: Option<(i32, i32)>) -> Result<Ptx> {
    Ok(match nvrtc_compile(arch)? {
        KernelCode::Cubin(cubin) => Ptx::from_binary(cubin),
        KernelCode::Ptx(text) => Ptx::from_src(text),
    })
}

/// What NVRTC made of the kernels.
pub(super) enum KernelCode {
    /// Machine code for one architecture.
    Cubin(Vec<u8>),
    /// PTX, for the driver to compile.
    Ptx(String),
}

pub(super) fn nvrtc_compile(arch: Option<(i32, i32)>) -> Result<KernelCode> {
    if !library_loaded(&["nvrtc"]) {
        return Err(DataFusionError::Execution(
            "embed() on CUDA: libnvrtc.so.13 not found (install the nvidia-cuda-nvrtc wheel \
             or the CUDA toolkit and put its lib directory on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    use cudarc::nvrtc::{result, sys};
    let source = CString::new(KERNEL_SOURCE).expect("kernel source has no NUL");
    let name = CString::new("flumen_bert.cu").expect("no NUL");
    let program =
        result::create_program(&source, Some(&name)).map_err(|e| cuda_error("nvrtc", e))?;
    let mut options = vec!["--std=c++17".to_string()];
    match arch {
        Some((major, minor)) => options.push(format!("--gpu-architecture=sm_{major}{minor}")),
        None => options.push("--gpu-architecture=compute_80".to_string()),
    }
    // SAFETY: `program` is a live NVRTC program until destroyed below.
    let compiled = unsafe { result::compile_program(program, &options) };
    let outcome = match compiled {
        Err(e) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(program) }.unwrap_or_default();
            let log = unsafe { CStr::from_ptr(log.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            Err(cuda_error("compiling kernels", format!("{e:?}: {log}")))
        }
        Ok(()) if arch.is_some() => unsafe {
            let mut size = 0usize;
            let status = sys::nvrtcGetCUBINSize(program, &mut size);
            if status != sys::nvrtcResult::NVRTC_SUCCESS {
                Err(cuda_error("nvrtcGetCUBINSize", status))
            } else {
                let mut cubin = vec![0u8; size];
                let status = sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut _);
                if status != sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(cuda_error("nvrtcGetCUBIN", status))
                } else {
                    Ok(KernelCode::Cubin(cubin))
                }
            }
        },
        Ok(()) => unsafe { result::get_ptx(program) }
            .map(|ptx| {
                let text = unsafe { CStr::from_ptr(ptx.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                KernelCode::Ptx(text)
            })
            .map_err(|e| cuda_error("nvrtcGetPTX", e)),
    };
    // SAFETY: the program is not used after this.
    let _ = unsafe { result::destroy_program(program) };
    outcome
}

/// The kernels' CUBIN for `arch`: from the cache file under `cache_dir` when it was compiled
/// from this very source by this NVRTC version, else compiled now and stored there (errors
/// storing it are ignored: the cache only saves time). Returns the CUBIN and whether it came
/// from the cache.
pub(super) fn device_kernels(arch: (i32, i32), cache_dir: &Path) -> Result<(Vec<u8>, bool)> {
    let path = kernel_cache_path(cache_dir, arch);
    if let Some(cubin) = cached_cubin(&path, KERNEL_SOURCE) {
        return Ok((cubin, true));
    }
    Ok((compile_and_store(arch, &path)?, false))
}

/// Compile the CUBIN for `arch` and keep it at `path`.
pub(super) fn compile_and_store(arch: (i32, i32), path: &Path) -> Result<Vec<u8>> {
    let KernelCode::Cubin(cubin) = nvrtc_compile(Some(arch))? else {
        return Err(cuda_error("compiling kernels", "NVRTC gave no CUBIN"));
    };
    let _ = store_cubin(path, KERNEL_SOURCE, &cubin);
    Ok(cubin)
}

/// `<cache_dir>/kernels/bert-sm{major}{minor}-nvrtc{version}.cubin`.
pub(super) fn kernel_cache_path(cache_dir: &Path, (major, minor): (i32, i32)) -> PathBuf {
    let (mut nv_major, mut nv_minor) = (0, 0);
    // SAFETY: plain out-parameters; only called once NVRTC is known to load.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nv_major, &mut nv_minor) };
    cache_dir.join("kernels").join(format!(
        "bert-sm{major}{minor}-nvrtc{nv_major}.{nv_minor}.cubin"
    ))
}

/// The CUBIN a cache file holds when it was compiled from exactly `source`: the file is the
/// source, a NUL byte, then the CUBIN.
fn cached_cubin(path: &Path, source: &str) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    let cubin = data.strip_prefix(source.as_bytes())?.strip_prefix(&[0u8])?;
    (!cubin.is_empty()).then(|| cubin.to_vec())
}

/// Write a cache file (whole or not at all: a temporary file renamed into place, so a
/// process reading it meanwhile sees the old file or the new one).
fn store_cubin(path: &Path, source: &str, cubin: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    file.write_all(source.as_bytes())?;
    file.write_all(&[0])?;
    file.write_all(cubin)?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_skip;
    use super::*;

    /// The kernels compile wherever NVRTC is found, device or not (`.ci/run` installs it,
    /// so under CI a missing NVRTC fails).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !library_loaded(&["nvrtc"]) {
            return test_skip::skip_missing_tool(
                "libnvrtc.so.13 not found (no CUDA toolkit; .ci/run installs NVRTC)",
            );
        }
        compile_kernels(None).expect("PTX");
        compile_kernels(Some((9, 0))).expect("CUBIN for sm_90");
    }

    /// A CUBIN compiled once is read back from the cache; a cache file of other source, or
    /// cut short, is not used.
    #[test]
    fn compiled_kernels_are_kept_on_disk() {
        if !library_loaded(&["nvrtc"]) {
            return test_skip::skip_missing_tool(
                "libnvrtc.so.13 not found (no CUDA toolkit; .ci/run installs NVRTC)",
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let (compiled, cached) = device_kernels((9, 0), dir.path()).unwrap();
        assert!(!cached && !compiled.is_empty());
        let (again, cached) = device_kernels((9, 0), dir.path()).unwrap();
        assert!(cached);
        assert_eq!(again, compiled);
        let path = kernel_cache_path(dir.path(), (9, 0));
        assert!(
            path.to_string_lossy().contains("bert-sm90-nvrtc"),
            "{path:?}"
        );
        assert_eq!(cached_cubin(&path, "other source"), None);
        let data = std::fs::read(&path).unwrap();
        std::fs::write(&path, &data[..KERNEL_SOURCE.len() + 1]).unwrap();
        assert_eq!(
            cached_cubin(&path, KERNEL_SOURCE),
            None,
            "no CUBIN after the source"
        );
        let (_, cached) = device_kernels((9, 0), dir.path()).unwrap();
        assert!(!cached, "a damaged file is compiled afresh");
        assert_eq!(cached_cubin(&path, KERNEL_SOURCE), Some(compiled));
    }
}
