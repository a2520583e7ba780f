//! The CUDA backend, through `cudarc` with dynamic loading: the crate builds and runs with
//! no CUDA installed; `libcuda.so.1`, `libnvrtc.so.13` and `libcublas.so.13` are opened at
//! run time (found through the loader's path, e.g. `LD_LIBRARY_PATH`).
//!
//! Kernels (`cuda_kernels.cu`) are compiled by NVRTC into a CUBIN for the device's own
//! architecture (so a newer NVRTC never emits PTX the driver refuses), kept on disk under
//! `<cache>/flumen/kernels/` so a later worker or process loads it instead; matrix
//! products run on cuBLAS in FP32. Each worker owns its context's stream, so the copies of
//! one worker overlap the compute of another; results come back through a pinned buffer.

use std::ffi::{CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use datafusion::error::{DataFusionError, Result};

use super::bert::{BertWeights, LayerNorm, Linear, PackedBatch, SentenceEncoder};

/// The kernels' CUDA C source.
pub const KERNEL_SOURCE: &str = include_str!("cuda_kernels.cu");
const THREADS: u32 = 128;
/// Query tokens (and threads) of a block of the tiled attention kernel (`ATTENTION_TILE`).
const ATTENTION_TILE: u32 = 64;

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

fn cuda_error(what: &str, e: impl std::fmt::Debug) -> DataFusionError {
    DataFusionError::Execution(format!("embed() on CUDA: {what}: {e:?}"))
}

/// Compile the kernels with NVRTC: a CUBIN for `sm_{major}{minor}` when an architecture is
/// given, else PTX. Needs only `libnvrtc.so.13`, no device.
pub fn compile_kernels(arch: Option<(i32, i32)>) -> Result<Ptx> {
    Ok(match nvrtc_compile(arch)? {
        KernelCode::Cubin(cubin) => Ptx::from_binary(cubin),
        KernelCode::Ptx(text) => Ptx::from_src(text),
    })
}

/// What NVRTC made of the kernels.
enum KernelCode {
    /// Machine code for one architecture.
    Cubin(Vec<u8>),
    /// PTX, for the driver to compile.
    Ptx(String),
}

fn nvrtc_compile(arch: Option<(i32, i32)>) -> Result<KernelCode> {
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
fn device_kernels(arch: (i32, i32), cache_dir: &Path) -> Result<(Vec<u8>, bool)> {
    let path = kernel_cache_path(cache_dir, arch);
    if let Some(cubin) = cached_cubin(&path, KERNEL_SOURCE) {
        return Ok((cubin, true));
    }
    Ok((compile_and_store(arch, &path)?, false))
}

/// Compile the CUBIN for `arch` and keep it at `path`.
fn compile_and_store(arch: (i32, i32), path: &Path) -> Result<Vec<u8>> {
    let KernelCode::Cubin(cubin) = nvrtc_compile(Some(arch))? else {
        return Err(cuda_error("compiling kernels", "NVRTC gave no CUBIN"));
    };
    let _ = store_cubin(path, KERNEL_SOURCE, &cubin);
    Ok(cubin)
}

/// `<cache_dir>/kernels/bert-sm{major}{minor}-nvrtc{version}.cubin`.
fn kernel_cache_path(cache_dir: &Path, (major, minor): (i32, i32)) -> PathBuf {
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

struct DeviceLinear {
    weight: CudaSlice<f32>,
    bias: CudaSlice<f32>,
    inputs: usize,
    outputs: usize,
}

struct DeviceNorm {
    gamma: CudaSlice<f32>,
    beta: CudaSlice<f32>,
}

struct DeviceLayer {
    qkv: DeviceLinear,
    attention_out: DeviceLinear,
    attention_norm: DeviceNorm,
    intermediate: DeviceLinear,
    output: DeviceLinear,
    output_norm: DeviceNorm,
}

struct Kernels {
    embed_tokens: CudaFunction,
    add_bias: CudaFunction,
    bias_gelu: CudaFunction,
    add_layer_norm: CudaFunction,
    attention: CudaFunction,
    /// `attention_tiled_{32,64}` for the model's head width, if it is one of those.
    attention_tiled: Option<CudaFunction>,
    mean_pool_normalize: CudaFunction,
}

/// BERT sentence encoder on a CUDA device: weights resident, one stream per worker.
pub struct CudaEncoder {
    host: Arc<BertWeights>,
    /// The opened device: its stream, cuBLAS handle, name and how long opening took.
    device: CudaDevice,
    kernels: Kernels,
    word: CudaSlice<f32>,
    position: CudaSlice<f32>,
    token_type: CudaSlice<f32>,
    embedding_norm: DeviceNorm,
    layers: Vec<DeviceLayer>,
    pinned: Option<PinnedHostSlice<f32>>,
    /// Milliseconds uploading the weights took.
    upload_ms: u64,
}

/// Device 0 made ready for a model, before any weights: its context, the kernels (compiled
/// or from the cache), a stream and a cuBLAS handle. Opening it needs no model files, so
/// an embed worker opens it on a thread of its own while it reads the model's files.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    name: String,
    /// Milliseconds spent getting the kernels (compiled or from the cache), and which.
    kernels_ms: u64,
    kernels_cached: bool,
    /// Milliseconds finding the driver and the device and opening cuBLAS's library.
    init_ms: u64,
    /// Milliseconds creating the context.
    context_ms: u64,
    /// Milliseconds creating the stream and the cuBLAS handle.
    blas_ms: u64,
    /// Milliseconds opening took in all (context, kernels, stream, cuBLAS).
    open_ms: u64,
}

impl CudaDevice {
    /// Open device 0: context, kernels, stream and cuBLAS handle.
    pub fn open() -> Result<Self> {
        let opened = Instant::now();
        probe_device_count().map_err(DataFusionError::Execution)?;
        if !library_loaded(&["cublas"]) {
            return Err(DataFusionError::Execution(
                "embed() on CUDA: libcublas.so.13 not found (put the CUDA libraries on LD_LIBRARY_PATH)".into(),
            ));
        }
        let init_ms = opened.elapsed().as_millis() as u64;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| cuda_error("creating a context", "the driver panicked"))?
            .map_err(|e| cuda_error("creating a context", e))?;
        let context_ms = opened.elapsed().as_millis() as u64 - init_ms;
        let arch = ctx
            .compute_capability()
            .map_err(|e| cuda_error("compute capability", e))?;
        let name = format!("cuda:0 ({})", ctx.name().unwrap_or_default());
        let started = Instant::now();
        let cache_dir = crate::config::cache_dir();
        let (cubin, kernels_cached) = device_kernels(arch, &cache_dir)?;
        let module = match ctx.load_module(Ptx::from_binary(cubin)) {
            Ok(module) => module,
            // A cache file the driver refuses (damaged): compile afresh and replace it.
            Err(_) if kernels_cached => {
                let cubin = compile_and_store(arch, &kernel_cache_path(&cache_dir, arch))?;
                ctx.load_module(Ptx::from_binary(cubin))
                    .map_err(|e| cuda_error("loading kernels", e))?
            }
            Err(e) => return Err(cuda_error("loading kernels", e)),
        };
        let kernels_ms = started.elapsed().as_millis() as u64;
        let started = Instant::now();
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error("creating a stream", e))?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| cuda_error("cuBLAS", e))?;
        Ok(Self {
            ctx,
            module,
            stream,
            blas,
            name,
            kernels_ms,
            kernels_cached,
            init_ms,
            context_ms,
            blas_ms: started.elapsed().as_millis() as u64,
            open_ms: opened.elapsed().as_millis() as u64,
        })
    }
}

impl CudaEncoder {
    /// Open device 0 and upload the weights.
    pub fn new(weights: Arc<BertWeights>) -> Result<Self> {
        Self::on(CudaDevice::open()?, weights)
    }

    /// Upload the weights to an opened device (this thread may not be the one that opened it).
    pub fn on(device: CudaDevice, weights: Arc<BertWeights>) -> Result<Self> {
        let uploaded = Instant::now();
        device
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        let f = |n: &str| device.module.load_function(n).map_err(|e| cuda_error(n, e));
        let kernels = Kernels {
            embed_tokens: f("embed_tokens")?,
            add_bias: f("add_bias")?,
            bias_gelu: f("bias_gelu")?,
            add_layer_norm: f("add_layer_norm")?,
            attention: f("attention")?,
            attention_tiled: match weights.config.head_dim() {
                32 => Some(f("attention_tiled_32")?),
                64 => Some(f("attention_tiled_64")?),
                _ => None,
            },
            mean_pool_normalize: f("mean_pool_normalize")?,
        };
        if weights.config.head_dim() > THREADS as usize {
            return Err(cuda_error(
                "attention",
                "head width above 128 is not supported",
            ));
        }
        let up = |v: &[f32]| {
            device
                .stream
                .clone_htod(v)
                .map_err(|e| cuda_error("uploading weights", e))
        };
        let linear = |l: &Linear| -> Result<DeviceLinear> {
            Ok(DeviceLinear {
                weight: up(&l.weight)?,
                bias: up(&l.bias)?,
                inputs: l.inputs,
                outputs: l.outputs,
            })
        };
        let norm = |n: &LayerNorm| -> Result<DeviceNorm> {
            Ok(DeviceNorm {
                gamma: up(&n.gamma)?,
                beta: up(&n.beta)?,
            })
        };
        let mut layers = vec![];
        for l in &weights.layers {
            layers.push(DeviceLayer {
                qkv: linear(&l.qkv)?,
                attention_out: linear(&l.attention_out)?,
                attention_norm: norm(&l.attention_norm)?,
                intermediate: linear(&l.intermediate)?,
                output: linear(&l.output)?,
                output_norm: norm(&l.output_norm)?,
            });
        }
        Ok(Self {
            word: up(&weights.word_embeddings)?,
            position: up(&weights.position_embeddings)?,
            token_type: up(&weights.token_type_embedding)?,
            embedding_norm: norm(&weights.embedding_norm)?,
            layers,
            host: weights,
            kernels,
            pinned: None,
            upload_ms: uploaded.elapsed().as_millis() as u64,
            device,
        })
    }

    /// `out = x · W` (bias added by the next kernel) for `rows` row-major rows.
    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        layer: &DeviceLinear,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        // Row-major Y[rows,out] = X[rows,in] W[in,out] is column-major Yᵀ = Wᵀ Xᵀ.
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: layer.outputs as i32,
            n: rows as i32,
            k: layer.inputs as i32,
            alpha: 1.0f32,
            lda: layer.outputs as i32,
            ldb: layer.inputs as i32,
            beta: 0.0f32,
            ldc: layer.outputs as i32,
        };
        // SAFETY: the buffers hold rows×inputs, inputs×outputs and rows×outputs floats.
        unsafe { self.device.blas.gemm(cfg, &layer.weight, x, out) }
            .map_err(|e| cuda_error("sgemm", e))
    }

    fn alloc(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every buffer is fully written by a kernel or gemm before it is read.
        unsafe { self.device.stream.alloc::<f32>(n.max(1)) }
            .map_err(|e| cuda_error("allocating", e))
    }

    fn elementwise(
        &self,
        f: &CudaFunction,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        width: usize,
    ) -> Result<()> {
        let n = x.len() as i64;
        let width = width as i32;
        let blocks = ((n as u64).div_ceil(THREADS as u64)).min(65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.device.stream.launch_builder(f);
        launch.arg(x).arg(bias).arg(&width).arg(&n);
        // SAFETY: arguments match the kernel's signature.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("elementwise kernel", e))
    }

    fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        norm: &DeviceNorm,
        out: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<()> {
        let width = self.host.config.hidden as i32;
        let eps = self.host.config.layer_norm_eps;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (width as u32 + 32) * 4,
        };
        let null: u64 = 0;
        let mut launch = self
            .device
            .stream
            .launch_builder(&self.kernels.add_layer_norm);
        launch.arg(x).arg(bias);
        match residual {
            Some(r) => launch.arg(r),
            None => launch.arg(&null),
        };
        launch
            .arg(&norm.gamma)
            .arg(&norm.beta)
            .arg(out)
            .arg(&width)
            .arg(&eps);
        // SAFETY: arguments match the kernel's signature; shared memory as it requires.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("layer norm", e))
    }

    fn forward(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
        let cfg = self.host.config.clone();
        let (h, tokens, seqs) = (cfg.hidden, batch.ids.len(), batch.lengths.len());
        if tokens == 0 {
            return Ok(vec![]);
        }
        let offsets = batch.offsets();
        let mut positions = Vec::with_capacity(tokens);
        let mut token_seq = Vec::with_capacity(tokens);
        for (s, &len) in batch.lengths.iter().enumerate() {
            if len > cfg.max_positions {
                return Err(DataFusionError::Execution(format!(
                    "embed(): sequence of {len} tokens exceeds the model's {} positions",
                    cfg.max_positions
                )));
            }
            positions.extend(0..len as u32);
            token_seq.extend(std::iter::repeat_n(s as u32, len));
        }
        if let Some(bad) = batch.ids.iter().find(|&&id| id as usize >= cfg.vocab) {
            return Err(DataFusionError::Execution(format!(
                "embed(): token id {bad} outside the model's vocabulary of {}",
                cfg.vocab
            )));
        }
        let max_len = batch.lengths.iter().copied().max().unwrap_or(1) as i32;
        let up = |v: &[u32]| {
            self.device
                .stream
                .clone_htod(v)
                .map_err(|e| cuda_error("upload", e))
        };
        let ids = up(&batch.ids)?;
        let positions = up(&positions)?;
        let token_seq = up(&token_seq)?;
        let seq_start = up(&offsets.iter().map(|&o| o as u32).collect::<Vec<_>>())?;
        let seq_len = up(&batch.lengths.iter().map(|&l| l as u32).collect::<Vec<_>>())?;

        let width = h as i32;
        let mut raw = self.alloc(tokens * h)?;
        let mut x = self.alloc(tokens * h)?;
        {
            let cfg = LaunchConfig {
                grid_dim: (tokens as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = self
                .device
                .stream
                .launch_builder(&self.kernels.embed_tokens);
            launch
                .arg(&ids)
                .arg(&positions)
                .arg(&self.word)
                .arg(&self.position)
                .arg(&self.token_type)
                .arg(&mut raw)
                .arg(&width);
            // SAFETY: arguments match the kernel's signature.
            unsafe { launch.launch(cfg) }.map_err(|e| cuda_error("embedding kernel", e))?;
        }
        let zeros = self
            .device
            .stream
            .alloc_zeros::<f32>(h)
            .map_err(|e| cuda_error("allocating", e))?;
        self.layer_norm(&raw, &zeros, None, &self.embedding_norm, &mut x, tokens)?;

        // The tiled attention kernel, where the head width has one, and its query tiles
        // (each sequence's tokens, ATTENTION_TILE at a time): (kernel, tiles, first tokens).
        let tiled = match &self.kernels.attention_tiled {
            Some(kernel) => {
                let firsts: Vec<u32> = offsets
                    .iter()
                    .zip(&batch.lengths)
                    .flat_map(|(&start, &len)| {
                        (0..len)
                            .step_by(ATTENTION_TILE as usize)
                            .map(move |q| (start + q) as u32)
                    })
                    .collect();
                Some((kernel, firsts.len(), up(&firsts)?))
            }
            None => None,
        };
        let mut qkv = self.alloc(tokens * 3 * h)?;
        let mut context = self.alloc(tokens * h)?;
        let mut projected = self.alloc(tokens * h)?;
        let mut attended = self.alloc(tokens * h)?;
        let mut inner = self.alloc(tokens * cfg.intermediate)?;
        let heads = cfg.heads as i32;
        let head_dim = cfg.head_dim() as i32;
        let scale = 1.0 / (cfg.head_dim() as f32).sqrt();
        for i in 0..self.layers.len() {
            let layer = &self.layers[i];
            self.matmul(&x, tokens, &layer.qkv, &mut qkv)?;
            self.elementwise(&self.kernels.add_bias, &mut qkv, &layer.qkv.bias, 3 * h)?;
            // The tiled kernel where the head width has one, else a block per query token.
            let (kernel, shape) = match &tiled {
                Some((kernel, tiles, _)) => (
                    *kernel,
                    LaunchConfig {
                        grid_dim: (*tiles as u32, heads as u32, 1),
                        block_dim: (ATTENTION_TILE, 1, 1),
                        shared_mem_bytes: 0,
                    },
                ),
                None => (
                    &self.kernels.attention,
                    LaunchConfig {
                        grid_dim: (tokens as u32, heads as u32, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: (head_dim as u32 + max_len as u32 + THREADS) * 4,
                    },
                ),
            };
            let mut launch = self.device.stream.launch_builder(kernel);
            launch
                .arg(&qkv)
                .arg(&mut context)
                .arg(&token_seq)
                .arg(&seq_start)
                .arg(&seq_len);
            match &tiled {
                Some((_, _, firsts)) => launch.arg(firsts).arg(&heads).arg(&scale),
                None => launch.arg(&heads).arg(&head_dim).arg(&max_len).arg(&scale),
            };
            // SAFETY: arguments match the kernel's signature; shared memory as it requires.
            unsafe { launch.launch(shape) }.map_err(|e| cuda_error("attention kernel", e))?;
            self.matmul(&context, tokens, &layer.attention_out, &mut projected)?;
            self.layer_norm(
                &projected,
                &layer.attention_out.bias,
                Some(&x),
                &layer.attention_norm,
                &mut attended,
                tokens,
            )?;
            self.matmul(&attended, tokens, &layer.intermediate, &mut inner)?;
            self.elementwise(
                &self.kernels.bias_gelu,
                &mut inner,
                &layer.intermediate.bias,
                cfg.intermediate,
            )?;
            self.matmul(&inner, tokens, &layer.output, &mut projected)?;
            self.layer_norm(
                &projected,
                &layer.output.bias,
                Some(&attended),
                &layer.output_norm,
                &mut x,
                tokens,
            )?;
        }
        let mut pooled = self.alloc(seqs * h)?;
        {
            let cfg = LaunchConfig {
                grid_dim: (seqs as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: (h as u32 + 32) * 4,
            };
            let mut launch = self
                .device
                .stream
                .launch_builder(&self.kernels.mean_pool_normalize);
            launch
                .arg(&x)
                .arg(&seq_start)
                .arg(&seq_len)
                .arg(&mut pooled)
                .arg(&width);
            // SAFETY: arguments match the kernel's signature; shared memory as it requires.
            unsafe { launch.launch(cfg) }.map_err(|e| cuda_error("pooling kernel", e))?;
        }
        // Download through a pinned buffer (grown as needed) for a fast copy.
        let n = seqs * h;
        if self.pinned.as_ref().is_none_or(|p| p.len() < n) {
            let ctx = Arc::clone(self.device.stream.context());
            // SAFETY: the buffer is written by the copy below before it is read.
            let buffer = unsafe { ctx.alloc_pinned_with_flags::<f32>(n.next_power_of_two(), 0) }
                .map_err(|e| cuda_error("pinned buffer", e))?;
            self.pinned = Some(buffer);
        }
        let pinned = self.pinned.as_mut().expect("allocated above");
        let mut view = pooled.slice(0..n);
        let _ = &mut view;
        self.device
            .stream
            .memcpy_dtoh(
                &view,
                &mut pinned.as_mut_slice().map_err(|e| cuda_error("pinned", e))?[..n],
            )
            .map_err(|e| cuda_error("download", e))?;
        self.device
            .stream
            .synchronize()
            .map_err(|e| cuda_error("synchronize", e))?;
        Ok(pinned.as_slice().map_err(|e| cuda_error("pinned", e))?[..n].to_vec())
    }
}

impl SentenceEncoder for CudaEncoder {
    fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
        self.forward(batch)
    }

    fn device(&self) -> String {
        self.device.name.clone()
    }

    fn on_accelerator(&self) -> bool {
        true
    }

    fn load_metrics(&self) -> Vec<(String, u64)> {
        vec![
            ("cuda_kernels_ms".into(), self.device.kernels_ms),
            (
                "cuda_kernels_cached".into(),
                self.device.kernels_cached as u64,
            ),
            ("cuda_open_ms".into(), self.device.open_ms),
            ("cuda_init_ms".into(), self.device.init_ms),
            ("cuda_context_ms".into(), self.device.context_ms),
            ("cuda_blas_ms".into(), self.device.blas_ms),
            ("cuda_upload_ms".into(), self.upload_ms),
        ]
    }
}

/// The integration tests' skip rules (a missing tool fails under CI), shared with this
/// file's unit test.
#[cfg(test)]
#[path = "../../../tests/common/skip.rs"]
mod test_skip;

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUDA library found is opened once and stays mapped; one not found is not kept.
    /// Checked in a process of its own (this test binary, running only this test): another
    /// test's kernels load NVRTC through cudarc for good, which would map it either way.
    #[test]
    fn a_cuda_library_found_stays_loaded() {
        const ALONE: &str = "FLUMEN_TEST_LIBRARY_ALONE";
        if std::env::var_os(ALONE).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "functions::embedding::cuda::tests::a_cuda_library_found_stays_loaded",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ALONE, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            print!("{text}");
            return;
        }
        assert!(!library_loaded(&["flumen_no_such_library"]));
        if !library_loaded(&["nvrtc"]) {
            return super::test_skip::skip_missing_tool(
                "libnvrtc.so.13 not found (no CUDA toolkit; .ci/run installs NVRTC)",
            );
        }
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.contains("libnvrtc"), "libnvrtc is not mapped");
        assert!(library_loaded(&["nvrtc"]));
    }

    /// The kernels compile wherever NVRTC is found, device or not (`.ci/run` installs it,
    /// so under CI a missing NVRTC fails).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !library_loaded(&["nvrtc"]) {
            return super::test_skip::skip_missing_tool(
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
            return super::test_skip::skip_missing_tool(
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
