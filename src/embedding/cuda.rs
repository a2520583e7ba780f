//! The CUDA backend (through `cudarc`, loaded at run time: builds and runs with no CUDA).

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};

use super::bert::{BertWeights, PackedBatch, SentenceEncoder};

/// True when the CUDA driver library loads and reports at least one device.
pub fn cuda_available() -> bool {
    probe_device_count().is_ok_and(|n| n > 0)
}

/// Number of CUDA devices, or why none can be used. Never panics.
pub fn probe_device_count() -> std::result::Result<usize, String> {
    // SAFETY: only checks whether the shared library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA device: libcuda.so.1 not found".into());
    }
    match std::panic::catch_unwind(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(n as usize),
        Ok(Ok(_)) => Err("no CUDA device: the driver reports none".into()),
        Ok(Err(e)) => Err(format!("no CUDA device: {e}")),
        Err(_) => Err("no CUDA device: the CUDA driver failed to load".into()),
    }
}

/// BERT sentence encoder on a CUDA device.
pub struct CudaEncoder {
    _weights: Arc<BertWeights>,
}

impl CudaEncoder {
    /// Move the weights to device 0.
    pub fn new(weights: Arc<BertWeights>) -> Result<Self> {
        probe_device_count().map_err(DataFusionError::Execution)?;
        let _ = weights;
        Err(DataFusionError::NotImplemented("CUDA backend for embed()".into()))
    }
}

impl SentenceEncoder for CudaEncoder {
    fn encode(&mut self, _batch: &PackedBatch) -> Result<Vec<f32>> {
        Err(DataFusionError::NotImplemented("CUDA backend for embed()".into()))
    }
    fn device(&self) -> String {
        "cuda:0".into()
    }
}
