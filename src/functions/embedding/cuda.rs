//! The CUDA backend, through `cudarc` with dynamic loading: the crate builds and runs with
//! no CUDA installed; `libcuda.so.1`, `libnvrtc.so.13` and `libcublas.so.13` are opened at
//! run time (found through the loader's path, e.g. `LD_LIBRARY_PATH`).
//!
//! Kernels (`cuda_kernels.cu`) come compiled from [`super::cuda_compile`]; matrix products
//! run on cuBLAS, in fp32 or (`flumen.embed_precision = 'bf16'`) on tensor cores with bf16
//! inputs and fp32 sums. Each worker owns its context's stream, so the copies of one worker
//! overlap the compute of another; a worker keeps two passes queued on its stream, their
//! tokens and vectors through pinned buffers ([`super::cuda_passes`]).

use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr,
    DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use datafusion::error::{DataFusionError, Result};

use super::bert::{BertWeights, LayerNorm, Linear, PackedBatch, SentenceEncoder, StartedPass};
use super::cuda_compile::{compile_and_store, device_kernels, kernel_cache_path};
use super::cuda_driver::{cuda_error, library_loaded, probe_device_count};
use super::cuda_passes::{PASS_SLOTS, PassSlot, TokenLayout, pinned_at_least};
use crate::config::EmbedPrecision;

const THREADS: u32 = 128;
/// Query tokens (and threads) of a block of the tiled attention kernel (`ATTENTION_TILE`).
const ATTENTION_TILE: u32 = 64;

/// A value type the encoder keeps weights and activations in on the device: `f32`, or
/// [`Bf16Bits`] (bfloat16, as its 16 bits).
trait DeviceElement:
    Sized + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Unpin
{
    /// `values` uploaded, converted to this type.
    fn upload(stream: &Arc<CudaStream>, values: &[f32]) -> Result<CudaSlice<Self>>;
}

impl DeviceElement for f32 {
    fn upload(stream: &Arc<CudaStream>, values: &[f32]) -> Result<CudaSlice<f32>> {
        stream
            .clone_htod(values)
            .map_err(|e| cuda_error("uploading weights", e))
    }
}

/// A bfloat16 as its 16 bits (the top half of the f32 it rounds).
type Bf16Bits = u16;

/// `x` rounded to bfloat16 (to nearest, ties to even, as the kernels and the CPU's
/// emulation round), as its bits.
pub fn bf16_bits(x: f32) -> u16 {
    (flumen_row_kernels::round_to_bf16(x).to_bits() >> 16) as u16
}

impl DeviceElement for Bf16Bits {
    fn upload(stream: &Arc<CudaStream>, values: &[f32]) -> Result<CudaSlice<u16>> {
        let bits: Vec<u16> = values.iter().map(|&v| bf16_bits(v)).collect();
        stream
            .clone_htod(&bits)
            .map_err(|e| cuda_error("uploading weights", e))
    }
}

/// A layer's matrix in the encoder's element type, and its fp32 bias.
struct DeviceLinear<T> {
    weight: CudaSlice<T>,
    bias: CudaSlice<f32>,
    inputs: usize,
    outputs: usize,
}

struct DeviceNorm {
    gamma: CudaSlice<f32>,
    beta: CudaSlice<f32>,
}

struct DeviceLayer<T> {
    qkv: DeviceLinear<T>,
    attention_out: DeviceLinear<T>,
    attention_norm: DeviceNorm,
    intermediate: DeviceLinear<T>,
    output: DeviceLinear<T>,
    output_norm: DeviceNorm,
}

/// The model's weights on the device: embeddings and matrices in `T`; biases and norms fp32.
struct DeviceModel<T> {
    word: CudaSlice<T>,
    position: CudaSlice<T>,
    token_type: CudaSlice<T>,
    embedding_norm: DeviceNorm,
    layers: Vec<DeviceLayer<T>>,
}

impl<T: DeviceElement> DeviceModel<T> {
    fn upload(stream: &Arc<CudaStream>, weights: &BertWeights) -> Result<Self> {
        let fp32 = |v: &[f32]| f32::upload(stream, v);
        let linear = |l: &Linear| -> Result<DeviceLinear<T>> {
            Ok(DeviceLinear {
                weight: T::upload(stream, &l.weight)?,
                bias: fp32(&l.bias)?,
                inputs: l.inputs,
                outputs: l.outputs,
            })
        };
        let norm = |n: &LayerNorm| -> Result<DeviceNorm> {
            Ok(DeviceNorm {
                gamma: fp32(&n.gamma)?,
                beta: fp32(&n.beta)?,
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
            word: T::upload(stream, &weights.word_embeddings)?,
            position: T::upload(stream, &weights.position_embeddings)?,
            token_type: T::upload(stream, &weights.token_type_embedding)?,
            embedding_norm: norm(&weights.embedding_norm)?,
            layers,
        })
    }
}

/// The weights in the precision the encoder computes in.
enum Weights {
    Fp32(DeviceModel<f32>),
    Bf16(DeviceModel<Bf16Bits>),
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

/// The bf16 path's kernels (`cuda_kernels.cu`, "The bf16 path").
struct HalfKernels {
    embed_tokens: CudaFunction,
    add_bias: CudaFunction,
    bias_gelu: CudaFunction,
    add_layer_norm: CudaFunction,
    attention_tiled: CudaFunction,
    mean_pool_normalize: CudaFunction,
}

/// Every kernel the encoder loads by name, fp32's then bf16's (the tiled attention kernels
/// by head width): the test checks each is in the compiled module.
pub const KERNEL_NAMES: &[&str] = &[
    "embed_tokens",
    "add_bias",
    "bias_gelu",
    "add_layer_norm",
    "attention",
    "attention_tiled_32",
    "attention_tiled_64",
    "mean_pool_normalize",
    "embed_tokens_bf16",
    "add_bias_bf16",
    "bias_gelu_bf16",
    "add_layer_norm_bf16",
    "attention_tiled_bf16_32",
    "attention_tiled_bf16_64",
    "mean_pool_normalize_bf16",
];

/// The precision `requested` resolves to on a device of compute capability `arch` for a
/// model whose attention heads are `head_dim` wide: bf16 needs bf16 tensor cores (8.0 or
/// newer) and a tiled attention kernel for the head width (32 or 64); `auto` takes bf16
/// where both hold, fp32 elsewhere; an explicit `bf16` where one fails is an error.
pub fn resolve_precision(
    requested: EmbedPrecision,
    arch: (i32, i32),
    head_dim: usize,
) -> Result<EmbedPrecision> {
    let tensor_cores = arch.0 >= 8;
    let tiled = matches!(head_dim, 32 | 64);
    match requested {
        EmbedPrecision::Fp32 => Ok(EmbedPrecision::Fp32),
        EmbedPrecision::Auto if tensor_cores && tiled => Ok(EmbedPrecision::Bf16),
        EmbedPrecision::Auto => Ok(EmbedPrecision::Fp32),
        EmbedPrecision::Bf16 if !tensor_cores => Err(DataFusionError::Configuration(format!(
            "flumen.embed_precision = 'bf16' needs a CUDA device of compute capability 8.0 \
             or newer (bf16 tensor cores); this one is {}.{}: use 'fp32' or 'auto'",
            arch.0, arch.1
        ))),
        EmbedPrecision::Bf16 if !tiled => Err(DataFusionError::Configuration(format!(
            "flumen.embed_precision = 'bf16' on CUDA needs attention heads 32 or 64 wide; \
             this model's are {head_dim}: use 'fp32' or 'auto'"
        ))),
        EmbedPrecision::Bf16 => Ok(EmbedPrecision::Bf16),
    }
}

/// The precision `requested` resolves to on CUDA device 0 ([`resolve_precision`]), by its
/// compute capability asked of the driver once per process without opening a context; fp32
/// when there is no device to ask. For the model-output cache's identity, known before a
/// model loads (planning asks it for every query with a cached model).
pub fn device_precision(requested: EmbedPrecision, head_dim: usize) -> Result<EmbedPrecision> {
    if requested == EmbedPrecision::Fp32 || probe_device_count().is_err() {
        return Ok(EmbedPrecision::Fp32);
    }
    static ARCH: std::sync::OnceLock<std::result::Result<(i32, i32), String>> =
        std::sync::OnceLock::new();
    let arch = ARCH.get_or_init(|| {
        use cudarc::driver::{result, sys::CUdevice_attribute};
        std::panic::catch_unwind(|| -> std::result::Result<(i32, i32), String> {
            result::init().map_err(|e| format!("{e:?}"))?;
            let device = result::device::get(0).map_err(|e| format!("{e:?}"))?;
            // SAFETY: a device handle the driver just gave; plain attribute queries.
            let attribute = |a| unsafe { result::device::get_attribute(device, a) };
            Ok((
                attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .map_err(|e| format!("{e:?}"))?,
                attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .map_err(|e| format!("{e:?}"))?,
            ))
        })
        .unwrap_or_else(|_| Err("the driver panicked".into()))
    });
    let arch = arch
        .clone()
        .map_err(|e| cuda_error("compute capability", e))?;
    resolve_precision(requested, arch, head_dim)
}

/// BERT sentence encoder on a CUDA device: weights resident, one stream per worker.
pub struct CudaEncoder {
    host: Arc<BertWeights>,
    /// The opened device: its stream, cuBLAS handle, name and how long opening took.
    device: CudaDevice,
    kernels: Kernels,
    /// The bf16 path's kernels, loaded when the encoder computes in bf16.
    half: Option<HalfKernels>,
    weights: Weights,
    /// A slot per pass in flight, used in turn ([`PASS_SLOTS`]).
    slots: Vec<PassSlot>,
    /// The slot the next pass takes.
    next_slot: usize,
    /// Passes started so far (the next one's number).
    passes_started: u64,
    /// Milliseconds uploading the weights took.
    upload_ms: u64,
}

/// A device made ready for a model, before any weights: its context, the kernels (compiled
/// or from the cache), a stream and a cuBLAS handle. Opening it needs no model files, so
/// an embed worker opens it on a thread of its own while it reads the model's files.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    name: String,
    /// Its compute capability (major, minor).
    arch: (i32, i32),
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
    /// Open this worker's device ([`crate::functions::accelerator_devices::worker_device`]):
    /// context, kernels, stream and cuBLAS handle.
    pub fn open() -> Result<Self> {
        Self::open_on(crate::functions::accelerator_devices::worker_device()?)
    }

    /// Open device `ordinal`: context, kernels, stream and cuBLAS handle.
    pub fn open_on(ordinal: usize) -> Result<Self> {
        let opened = Instant::now();
        let devices = probe_device_count().map_err(DataFusionError::Execution)?;
        if ordinal >= devices {
            return Err(cuda_error(
                "opening a device",
                format!("cuda:{ordinal} asked for, {devices} visible"),
            ));
        }
        if !library_loaded(&["cublas"]) {
            return Err(DataFusionError::Execution(
                "embed() on CUDA: libcublas.so.13 not found (put the CUDA libraries on LD_LIBRARY_PATH)".into(),
            ));
        }
        let init_ms = opened.elapsed().as_millis() as u64;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| cuda_error("creating a context", "the driver panicked"))?
            .map_err(|e| cuda_error("creating a context", e))?;
        // SAFETY: everything this worker allocates in this context (a handle of its own on
        // the device's primary context) is used on its one stream, in that stream's order:
        // cudarc's tracking of each buffer's reads and writes across streams (an event wait
        // and an event record per kernel argument, ~1,000 driver calls a pass) buys nothing.
        unsafe { ctx.disable_event_tracking() };
        let context_ms = opened.elapsed().as_millis() as u64 - init_ms;
        let arch = ctx
            .compute_capability()
            .map_err(|e| cuda_error("compute capability", e))?;
        let name = format!("cuda:{ordinal} ({})", ctx.name().unwrap_or_default());
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
            arch,
            kernels_ms,
            kernels_cached,
            init_ms,
            context_ms,
            blas_ms: started.elapsed().as_millis() as u64,
            open_ms: opened.elapsed().as_millis() as u64,
        })
    }
}

/// A forward pass's token layout on the device (one buffer, [`TokenLayout::parts`]): each
/// token's id, position and sequence, each sequence's first token and length, and the tiled
/// attention kernel's query tiles.
struct DeviceBatch<'a> {
    tokens: usize,
    seqs: usize,
    /// The longest sequence's tokens.
    max_len: i32,
    ids: CudaView<'a, u32>,
    positions: CudaView<'a, u32>,
    token_seq: CudaView<'a, u32>,
    seq_start: CudaView<'a, u32>,
    seq_len: CudaView<'a, u32>,
    /// Where the head width has a tiled attention kernel: how many query tiles (each
    /// sequence's tokens, ATTENTION_TILE at a time) and each tile's first token.
    tiles: Option<(usize, CudaView<'a, u32>)>,
}

impl<'a> DeviceBatch<'a> {
    /// The parts of `layout` in `buffer`, where it was uploaded.
    fn view(buffer: &'a CudaSlice<u32>, layout: &TokenLayout) -> Self {
        let [ids, positions, token_seq, seq_start, seq_len, firsts] = layout.parts();
        Self {
            tokens: layout.tokens,
            seqs: layout.seqs,
            max_len: layout.max_len as i32,
            ids: buffer.slice(ids),
            positions: buffer.slice(positions),
            token_seq: buffer.slice(token_seq),
            seq_start: buffer.slice(seq_start),
            seq_len: buffer.slice(seq_len),
            tiles: layout.tiles.map(|tiles| (tiles, buffer.slice(firsts))),
        }
    }
}

impl CudaEncoder {
    /// Open this worker's device and upload the weights, in fp32.
    pub fn new(weights: Arc<BertWeights>) -> Result<Self> {
        Self::on(CudaDevice::open()?, weights, EmbedPrecision::Fp32)
    }

    /// Upload the weights to an opened device (this thread may not be the one that opened
    /// it), in the precision `precision` resolves to on it ([`resolve_precision`]).
    pub fn on(
        device: CudaDevice,
        weights: Arc<BertWeights>,
        precision: EmbedPrecision,
    ) -> Result<Self> {
        let uploaded = Instant::now();
        let precision = resolve_precision(precision, device.arch, weights.config.head_dim())?;
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
        let (half, model) = match precision {
            EmbedPrecision::Bf16 => {
                let half = HalfKernels {
                    embed_tokens: f("embed_tokens_bf16")?,
                    add_bias: f("add_bias_bf16")?,
                    bias_gelu: f("bias_gelu_bf16")?,
                    add_layer_norm: f("add_layer_norm_bf16")?,
                    attention_tiled: f(&format!(
                        "attention_tiled_bf16_{}",
                        weights.config.head_dim()
                    ))?,
                    mean_pool_normalize: f("mean_pool_normalize_bf16")?,
                };
                let model = DeviceModel::<Bf16Bits>::upload(&device.stream, &weights)?;
                (Some(half), Weights::Bf16(model))
            }
            _ => (
                None,
                Weights::Fp32(DeviceModel::<f32>::upload(&device.stream, &weights)?),
            ),
        };
        let slots = (0..PASS_SLOTS)
            .map(|_| PassSlot::new(&device.ctx))
            .collect::<Result<_>>()?;
        Ok(Self {
            host: weights,
            kernels,
            half,
            weights: model,
            slots,
            next_slot: 0,
            passes_started: 0,
            upload_ms: uploaded.elapsed().as_millis() as u64,
            device,
        })
    }

    /// The precision the encoder computes in.
    pub fn precision(&self) -> EmbedPrecision {
        match self.weights {
            Weights::Fp32(_) => EmbedPrecision::Fp32,
            Weights::Bf16(_) => EmbedPrecision::Bf16,
        }
    }

    /// `out = x · W` (bias added by the next kernel) for `rows` row-major rows.
    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        layer: &DeviceLinear<f32>,
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

    /// `out = x · W` on tensor cores: bf16 `x` and `W`, fp32 sums and fp32 `out` (bias
    /// added by the next kernel, which stores the result in bf16).
    fn matmul_bf16(
        &self,
        x: &CudaSlice<Bf16Bits>,
        rows: usize,
        layer: &DeviceLinear<Bf16Bits>,
        out: &mut impl cudarc::driver::DevicePtrMut<f32>,
    ) -> Result<()> {
        use cudarc::cublas::{result::gemm_ex, sys};
        use std::ffi::c_void;
        let stream = &self.device.stream;
        let (weight, _weight_read) = layer.weight.device_ptr(stream);
        let (input, _input_read) = x.device_ptr(stream);
        let (output, _output_written) = out.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major Y[rows,out] = X[rows,in] W[in,out] is column-major Yᵀ = Wᵀ Xᵀ.
        // SAFETY: the buffers hold rows×inputs and inputs×outputs bf16 values and
        // rows×outputs floats; alpha and beta live across the call (host pointer mode).
        unsafe {
            gemm_ex(
                *self.device.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                layer.outputs as i32,
                rows as i32,
                layer.inputs as i32,
                &alpha as *const f32 as *const c_void,
                weight as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                layer.outputs as i32,
                input as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                layer.inputs as i32,
                &beta as *const f32 as *const c_void,
                output as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                layer.outputs as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| cuda_error("bf16 gemm", e))
    }

    fn alloc<T: DeviceElement>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer is fully written by a kernel or gemm before it is read.
        unsafe { self.device.stream.alloc::<T>(n.max(1)) }.map_err(|e| cuda_error("allocating", e))
    }

    /// The grid of an elementwise kernel over `n` values.
    fn elementwise_shape(n: usize) -> LaunchConfig {
        let blocks = ((n as u64).div_ceil(THREADS as u64)).min(65_535) as u32;
        LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
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
        let cfg = Self::elementwise_shape(x.len());
        let mut launch = self.device.stream.launch_builder(f);
        launch.arg(x).arg(bias).arg(&width).arg(&n);
        // SAFETY: arguments match the kernel's signature.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("elementwise kernel", e))
    }

    /// `out = bf16(f(x + bias))` for the bf16 path's out-of-place elementwise kernels.
    fn elementwise_bf16(
        &self,
        f: &CudaFunction,
        x: &CudaView<'_, f32>,
        bias: &CudaSlice<f32>,
        out: &mut CudaSlice<Bf16Bits>,
        width: usize,
    ) -> Result<()> {
        let n = x.len() as i64;
        let width = width as i32;
        let cfg = Self::elementwise_shape(x.len());
        let mut launch = self.device.stream.launch_builder(f);
        launch.arg(x).arg(bias).arg(out).arg(&width).arg(&n);
        // SAFETY: arguments match the kernel's signature; out is as long as x.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("elementwise kernel", e))
    }

    /// The add-and-layer-norm kernel (`f`: fp32's or bf16's) over `rows` rows of `x`, with
    /// `residual` (fp32 or bf16, as `f` takes it) or none.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm<R: DeviceElement, O: DeviceElement>(
        &self,
        f: &CudaFunction,
        x: &CudaView<'_, f32>,
        bias: &CudaSlice<f32>,
        residual: Option<&CudaSlice<R>>,
        norm: &DeviceNorm,
        out: &mut CudaSlice<O>,
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
        let mut launch = self.device.stream.launch_builder(f);
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

    /// Check a pass's sequences against the model: lengths within its positions, ids
    /// within its vocabulary.
    fn check_batch(&self, batch: &PackedBatch) -> Result<()> {
        let cfg = &self.host.config;
        if let Some(&len) = batch.lengths.iter().find(|&&len| len > cfg.max_positions) {
            return Err(DataFusionError::Execution(format!(
                "embed(): sequence of {len} tokens exceeds the model's {} positions",
                cfg.max_positions
            )));
        }
        if let Some(bad) = batch.ids.iter().find(|&&id| id as usize >= cfg.vocab) {
            return Err(DataFusionError::Execution(format!(
                "embed(): token id {bad} outside the model's vocabulary of {}",
                cfg.vocab
            )));
        }
        Ok(())
    }

    /// One block per token: `embed(word, position, type) → out` (`f`: fp32's or bf16's).
    fn embed_tokens<T: DeviceElement>(
        &self,
        f: &CudaFunction,
        on: &DeviceBatch<'_>,
        model: &DeviceModel<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let width = self.host.config.hidden as i32;
        let cfg = LaunchConfig {
            grid_dim: (on.tokens as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.device.stream.launch_builder(f);
        launch
            .arg(&on.ids)
            .arg(&on.positions)
            .arg(&model.word)
            .arg(&model.position)
            .arg(&model.token_type)
            .arg(out)
            .arg(&width);
        // SAFETY: arguments match the kernel's signature.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("embedding kernel", e))
    }

    /// The embedding layer with `kernels` (embedding, layer norm: fp32's or bf16's): each
    /// token's embeddings summed into `sums` (fp32), then layer-normed into `x`.
    fn embedding_layer<T: DeviceElement, O: DeviceElement>(
        &self,
        (embed, norm): (&CudaFunction, &CudaFunction),
        on: &DeviceBatch<'_>,
        model: &DeviceModel<T>,
        sums: &mut CudaSlice<f32>,
        x: &mut CudaSlice<O>,
    ) -> Result<()> {
        let h = self.host.config.hidden;
        self.embed_tokens(embed, on, model, sums)?;
        let zeros = self
            .device
            .stream
            .alloc_zeros::<f32>(h)
            .map_err(|e| cuda_error("allocating", e))?;
        let no_residual: Option<&CudaSlice<O>> = None;
        self.layer_norm(
            norm,
            &sums.slice(0..on.tokens * h),
            &zeros,
            no_residual,
            &model.embedding_norm,
            x,
            on.tokens,
        )
    }

    /// One block per sequence: the mean of its rows of `x`, normalized, into `pooled`.
    fn mean_pool<T: DeviceElement>(
        &self,
        f: &CudaFunction,
        on: &DeviceBatch<'_>,
        x: &CudaSlice<T>,
        pooled: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let h = self.host.config.hidden;
        let width = h as i32;
        let cfg = LaunchConfig {
            grid_dim: (on.seqs as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (h as u32 + 32) * 4,
        };
        let mut launch = self.device.stream.launch_builder(f);
        launch
            .arg(x)
            .arg(&on.seq_start)
            .arg(&on.seq_len)
            .arg(pooled)
            .arg(&width);
        // SAFETY: arguments match the kernel's signature; shared memory as it requires.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| cuda_error("pooling kernel", e))
    }

    /// The fp32 forward pass: each sequence's pooled, normalized vector.
    fn forward_fp32(
        &self,
        model: &DeviceModel<f32>,
        on: &DeviceBatch<'_>,
    ) -> Result<CudaSlice<f32>> {
        let cfg = &self.host.config;
        let (h, tokens) = (cfg.hidden, on.tokens);
        let mut raw = self.alloc::<f32>(tokens * h)?;
        let mut x = self.alloc::<f32>(tokens * h)?;
        let norm = &self.kernels.add_layer_norm;
        self.embedding_layer(
            (&self.kernels.embed_tokens, norm),
            on,
            model,
            &mut raw,
            &mut x,
        )?;

        let mut qkv = self.alloc::<f32>(tokens * 3 * h)?;
        let mut context = self.alloc::<f32>(tokens * h)?;
        let mut projected = self.alloc::<f32>(tokens * h)?;
        let mut attended = self.alloc::<f32>(tokens * h)?;
        let mut inner = self.alloc::<f32>(tokens * cfg.intermediate)?;
        let heads = cfg.heads as i32;
        let head_dim = cfg.head_dim() as i32;
        let scale = 1.0 / (cfg.head_dim() as f32).sqrt();
        for layer in &model.layers {
            self.matmul(&x, tokens, &layer.qkv, &mut qkv)?;
            self.elementwise(&self.kernels.add_bias, &mut qkv, &layer.qkv.bias, 3 * h)?;
            // The tiled kernel where the head width has one, else a block per query token.
            let (kernel, shape) = match (&self.kernels.attention_tiled, &on.tiles) {
                (Some(kernel), Some((tiles, _))) => (
                    kernel,
                    LaunchConfig {
                        grid_dim: (*tiles as u32, heads as u32, 1),
                        block_dim: (ATTENTION_TILE, 1, 1),
                        shared_mem_bytes: 0,
                    },
                ),
                _ => (
                    &self.kernels.attention,
                    LaunchConfig {
                        grid_dim: (tokens as u32, heads as u32, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: (head_dim as u32 + on.max_len as u32 + THREADS) * 4,
                    },
                ),
            };
            let mut launch = self.device.stream.launch_builder(kernel);
            launch
                .arg(&qkv)
                .arg(&mut context)
                .arg(&on.token_seq)
                .arg(&on.seq_start)
                .arg(&on.seq_len);
            match &on.tiles {
                Some((_, firsts)) => launch.arg(firsts).arg(&heads).arg(&scale),
                None => launch
                    .arg(&heads)
                    .arg(&head_dim)
                    .arg(&on.max_len)
                    .arg(&scale),
            };
            // SAFETY: arguments match the kernel's signature; shared memory as it requires.
            unsafe { launch.launch(shape) }.map_err(|e| cuda_error("attention kernel", e))?;
            self.matmul(&context, tokens, &layer.attention_out, &mut projected)?;
            self.layer_norm(
                norm,
                &projected.as_view(),
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
                norm,
                &projected.as_view(),
                &layer.output.bias,
                Some(&attended),
                &layer.output_norm,
                &mut x,
                tokens,
            )?;
        }
        let mut pooled = self.alloc::<f32>(on.seqs * h)?;
        self.mean_pool(&self.kernels.mean_pool_normalize, on, &x, &mut pooled)?;
        Ok(pooled)
    }

    /// The bf16 forward pass: the fp32 pass's steps with bf16 weights and stored
    /// activations, each product on tensor cores into an fp32 buffer that the next kernel
    /// finishes and stores in bf16 (as `CpuEncoder::emulating_bf16` rounds).
    fn forward_bf16(
        &self,
        model: &DeviceModel<Bf16Bits>,
        half: &HalfKernels,
        on: &DeviceBatch<'_>,
    ) -> Result<CudaSlice<f32>> {
        let cfg = &self.host.config;
        let (h, tokens) = (cfg.hidden, on.tokens);
        let Some((tiles, firsts)) = &on.tiles else {
            return Err(cuda_error(
                "bf16 attention",
                "no tiled kernel for this head width",
            ));
        };
        // fp32 products (and the embedding sums) before their kernel stores them in bf16:
        // one buffer, its first rows × outputs values used by each product.
        let mut product = self.alloc::<f32>(tokens * cfg.intermediate.max(3 * h))?;
        let mut x = self.alloc::<Bf16Bits>(tokens * h)?;
        let norm = &half.add_layer_norm;
        self.embedding_layer((&half.embed_tokens, norm), on, model, &mut product, &mut x)?;

        let mut qkv = self.alloc::<Bf16Bits>(tokens * 3 * h)?;
        let mut context = self.alloc::<Bf16Bits>(tokens * h)?;
        let mut attended = self.alloc::<Bf16Bits>(tokens * h)?;
        let mut inner = self.alloc::<Bf16Bits>(tokens * cfg.intermediate)?;
        let heads = cfg.heads as i32;
        let scale = 1.0 / (cfg.head_dim() as f32).sqrt();
        let attention_shape = LaunchConfig {
            grid_dim: (*tiles as u32, heads as u32, 1),
            block_dim: (ATTENTION_TILE, 1, 1),
            shared_mem_bytes: 0,
        };
        let (qkv_width, inner_width) = (3 * h, cfg.intermediate);
        for layer in &model.layers {
            let rows = |width: usize| 0..tokens * width;
            self.matmul_bf16(
                &x,
                tokens,
                &layer.qkv,
                &mut product.slice_mut(rows(qkv_width)),
            )?;
            self.elementwise_bf16(
                &half.add_bias,
                &product.slice(rows(qkv_width)),
                &layer.qkv.bias,
                &mut qkv,
                qkv_width,
            )?;
            let mut launch = self.device.stream.launch_builder(&half.attention_tiled);
            launch
                .arg(&qkv)
                .arg(&mut context)
                .arg(&on.token_seq)
                .arg(&on.seq_start)
                .arg(&on.seq_len)
                .arg(firsts)
                .arg(&heads)
                .arg(&scale);
            // SAFETY: arguments match the kernel's signature.
            unsafe { launch.launch(attention_shape) }
                .map_err(|e| cuda_error("attention kernel", e))?;
            self.matmul_bf16(
                &context,
                tokens,
                &layer.attention_out,
                &mut product.slice_mut(rows(h)),
            )?;
            self.layer_norm(
                norm,
                &product.slice(rows(h)),
                &layer.attention_out.bias,
                Some(&x),
                &layer.attention_norm,
                &mut attended,
                tokens,
            )?;
            self.matmul_bf16(
                &attended,
                tokens,
                &layer.intermediate,
                &mut product.slice_mut(rows(inner_width)),
            )?;
            self.elementwise_bf16(
                &half.bias_gelu,
                &product.slice(rows(inner_width)),
                &layer.intermediate.bias,
                &mut inner,
                inner_width,
            )?;
            self.matmul_bf16(
                &inner,
                tokens,
                &layer.output,
                &mut product.slice_mut(rows(h)),
            )?;
            self.layer_norm(
                norm,
                &product.slice(rows(h)),
                &layer.output.bias,
                Some(&attended),
                &layer.output_norm,
                &mut x,
                tokens,
            )?;
        }
        let mut pooled = self.alloc::<f32>(on.seqs * h)?;
        self.mean_pool(&half.mean_pool_normalize, on, &x, &mut pooled)?;
        Ok(pooled)
    }

    /// Queue `batch`'s pass on the stream in the next slot: its layout up through the slot's
    /// pinned buffer, the forward pass, its vectors back into the slot's other pinned
    /// buffer, then the slot's event. Returns at once; [`finish_pass`](Self::finish_pass)
    /// waits for the vectors.
    fn start_pass(&mut self, batch: &PackedBatch) -> Result<StartedPass> {
        if batch.ids.is_empty() {
            return Ok(StartedPass::Done(vec![]));
        }
        self.check_batch(batch)?;
        let slot = self.next_slot;
        let queued = self.queue_pass(slot, batch);
        let values = match queued {
            Ok(values) => values,
            Err(e) => {
                // Copies already queued may still read the slot's pinned memory: let them end
                // before it is written again.
                let _ = self.device.stream.synchronize();
                self.slots[slot].pending = None;
                return Err(e);
            }
        };
        let number = self.passes_started;
        self.passes_started += 1;
        self.slots[slot].pending = Some((number, values));
        self.next_slot = (slot + 1) % PASS_SLOTS;
        Ok(StartedPass::OnDevice { slot, number })
    }

    /// Queue a pass in slot `slot` (see [`start_pass`](Self::start_pass)); the values its
    /// vectors hold.
    fn queue_pass(&mut self, slot: usize, batch: &PackedBatch) -> Result<usize> {
        // The slot's last pass is done with its memory (it finished two passes ago, or it
        // was left unfinished by a caller that failed: then this waits for it).
        self.slots[slot].wait()?;
        self.slots[slot].pending = None;
        let tile = self
            .kernels
            .attention_tiled
            .as_ref()
            .map(|_| ATTENTION_TILE as usize);
        let layout = TokenLayout::of(batch, tile);
        let ctx = Arc::clone(&self.device.ctx);
        let stream = &self.device.stream;
        let staged = pinned_at_least(&ctx, &mut self.slots[slot].layout, layout.len())?;
        let staged =
            &mut staged.as_mut_slice().map_err(|e| cuda_error("pinned", e))?[..layout.len()];
        layout.write(batch, tile, staged);
        // SAFETY: filled by the copy below before a kernel reads it.
        let mut uploaded = unsafe { stream.alloc::<u32>(layout.len()) }
            .map_err(|e| cuda_error("allocating", e))?;
        {
            let (to, _written) = uploaded.device_ptr_mut(stream);
            // SAFETY: `staged` is pinned, so the copy runs after the call returns; the slot's
            // event (recorded after this pass) guards it until then. The buffer holds
            // `layout.len()` values.
            unsafe { cudarc::driver::result::memcpy_htod_async(to, staged, stream.cu_stream()) }
                .map_err(|e| cuda_error("upload", e))?;
        }
        let on = DeviceBatch::view(&uploaded, &layout);
        let pooled = match (&self.weights, &self.half) {
            (Weights::Fp32(model), _) => self.forward_fp32(model, &on)?,
            (Weights::Bf16(model), Some(half)) => self.forward_bf16(model, half, &on)?,
            (Weights::Bf16(_), None) => {
                return Err(cuda_error("bf16", "the bf16 kernels were not loaded"));
            }
        };
        let values = on.seqs * self.host.config.hidden;
        let stream = &self.device.stream;
        let slot = &mut self.slots[slot];
        let back = pinned_at_least(&ctx, &mut slot.vectors, values)?;
        let back = &mut back.as_mut_slice().map_err(|e| cuda_error("pinned", e))?[..values];
        {
            let (from, _read) = pooled.device_ptr(stream);
            // SAFETY: `back` is pinned and `values` long, as many as `pooled` holds; the slot's
            // event, recorded next, says when the copy is done.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(back, from, stream.cu_stream()) }
                .map_err(|e| cuda_error("download", e))?;
        }
        slot.done
            .record(stream)
            .map_err(|e| cuda_error("recording an event", e))?;
        // `uploaded` and `pooled` are freed in the stream's order, after the copies.
        Ok(values)
    }

    /// The vectors of a pass [`start_pass`](Self::start_pass) queued, once they are back.
    fn finish_pass(&mut self, pass: StartedPass) -> Result<Vec<f32>> {
        let (slot, number) = match pass {
            StartedPass::Done(vectors) => return Ok(vectors),
            StartedPass::OnDevice { slot, number } => (slot, number),
        };
        let slot = &mut self.slots[slot];
        let Some((queued, values)) = slot.pending.filter(|(queued, _)| *queued == number) else {
            return Err(DataFusionError::Internal(format!(
                "embed() on CUDA: pass {number} is no longer in its slot (more than \
                 {PASS_SLOTS} passes were started before it was finished)"
            )));
        };
        debug_assert_eq!(queued, number);
        slot.wait()?;
        slot.pending = None;
        let vectors = slot.vectors.as_ref().expect("a queued pass has its buffer");
        Ok(vectors.as_slice().map_err(|e| cuda_error("pinned", e))?[..values].to_vec())
    }
}

impl Drop for CudaEncoder {
    /// Passes still queued (left by a caller that failed) end before the pinned buffers
    /// their copies use are freed.
    fn drop(&mut self) {
        let _ = self.device.stream.synchronize();
    }
}

impl SentenceEncoder for CudaEncoder {
    fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
        let pass = self.start_pass(batch)?;
        self.finish_pass(pass)
    }

    fn start(&mut self, batch: &PackedBatch) -> Result<StartedPass> {
        self.start_pass(batch)
    }

    fn finish(&mut self, pass: StartedPass) -> Result<Vec<f32>> {
        self.finish_pass(pass)
    }

    fn passes_in_flight(&self) -> usize {
        PASS_SLOTS
    }

    fn device(&self) -> String {
        match self.precision() {
            EmbedPrecision::Bf16 => format!("{} bf16", self.device.name),
            _ => self.device.name.clone(),
        }
    }

    fn bf16(&self) -> bool {
        self.precision() == EmbedPrecision::Bf16
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the encoder loads by name is an entry of the compiled module: a name
    /// misspelt on either side fails here, not first on a GPU.
    #[test]
    fn every_kernel_the_encoder_loads_is_in_the_module() {
        if !library_loaded(&["nvrtc"]) {
            return super::super::test_skip::skip_missing_tool(
                "libnvrtc.so.13 not found (no CUDA toolkit; .ci/run installs NVRTC)",
            );
        }
        use super::super::cuda_compile::{KernelCode, nvrtc_compile};
        let KernelCode::Ptx(ptx) = nvrtc_compile(None).unwrap() else {
            panic!("no PTX");
        };
        let entries: Vec<&str> = ptx
            .lines()
            .filter_map(|line| line.split(".entry ").nth(1))
            .map(|rest| rest.trim_end_matches(['(', ' ']))
            .collect();
        for name in KERNEL_NAMES {
            assert!(entries.contains(name), "{name} is not among {entries:?}");
        }
        let source_calls: Vec<&str> = {
            let code = include_str!("cuda.rs");
            let code = &code[..code.find("#[cfg(test)]").unwrap()];
            code.split("f(\"")
                .skip(1)
                .filter_map(|rest| rest.split('"').next())
                .collect()
        };
        for called in &source_calls {
            assert!(
                KERNEL_NAMES.contains(called),
                "{called} is loaded but not listed"
            );
        }
    }

    /// bf16 needs tensor cores (8.0+) and a tiled attention kernel; `auto` picks it where
    /// both hold; asking for it elsewhere is an error naming the way out.
    #[test]
    fn the_precision_resolves_by_the_device_and_the_head_width() {
        use EmbedPrecision::*;
        assert_eq!(resolve_precision(Auto, (9, 0), 32).unwrap(), Bf16);
        assert_eq!(resolve_precision(Auto, (8, 0), 64).unwrap(), Bf16);
        assert_eq!(resolve_precision(Auto, (7, 5), 32).unwrap(), Fp32);
        assert_eq!(resolve_precision(Auto, (9, 0), 48).unwrap(), Fp32);
        assert_eq!(resolve_precision(Fp32, (9, 0), 32).unwrap(), Fp32);
        assert_eq!(resolve_precision(Bf16, (8, 6), 32).unwrap(), Bf16);
        let old = resolve_precision(Bf16, (7, 5), 32).unwrap_err().to_string();
        assert!(
            old.contains("compute capability 8.0") && old.contains("7.5"),
            "{old}"
        );
        let wide = resolve_precision(Bf16, (9, 0), 48).unwrap_err().to_string();
        assert!(wide.contains("are 48"), "{wide}");
    }

    /// The weights' bf16 bits round to nearest, ties to even, as the kernels' stores do.
    #[test]
    fn weights_are_uploaded_as_rounded_bf16_bits() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        assert_eq!(bf16_bits(-2.0), 0xC000);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (down to 1).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (up).
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
        assert_eq!(bf16_bits(1.0 + 1.0 / 128.0 + 1.0 / 1024.0), 0x3F81);
    }
}
