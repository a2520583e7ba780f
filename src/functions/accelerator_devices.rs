//! Which GPU an accelerator worker computes on, on a host with several.
//!
//! A worker (a thread of the accelerator pool, or a worker process) is given its device the
//! first time one of its models opens CUDA ([`worker_device`]) and keeps it while it lives:
//! - a worker process started with `flumen worker --device cuda:N` uses device N;
//! - one a driver started as the i-th of its accelerator pool (`--device-slot I`) uses
//!   device i modulo the host's visible devices, so a pool of N workers covers N GPUs;
//! - any other worker (this process's pool threads) takes the device the fewest of this
//!   process's workers use now, and gives its place back when its thread ends.
//!
//! Ray Data does the same by giving each actor its own `CUDA_VISIBLE_DEVICES`; a process
//! setting its environment is not safe once threads run, so here the ordinal is chosen
//! explicitly and the driver's `CUDA_VISIBLE_DEVICES` still decides what is visible.

use std::cell::Cell;
use std::sync::{Mutex, OnceLock};

use datafusion::error::{DataFusionError, Result};

use crate::config::{Device, FlumenConfig};

/// What fixes this process's device (set once, when a worker process starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePin {
    /// `--device cuda:N`: device N.
    Device(usize),
    /// `--device-slot I`: the I-th accelerator worker of its driver on this host.
    Slot(usize),
}

static PIN: OnceLock<DevicePin> = OnceLock::new();

/// Workers of this process on each device, as [`worker_device`] gave them out.
static LOAD: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// The device a thread was given, handed back to [`LOAD`] when the thread ends.
struct Assigned(Cell<Option<(usize, bool)>>);

impl Drop for Assigned {
    fn drop(&mut self) {
        if let Some((device, counted)) = self.0.get()
            && counted
        {
            let mut load = LOAD.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(workers) = load.get_mut(device) {
                *workers = workers.saturating_sub(1);
            }
        }
    }
}

thread_local! {
    static ASSIGNED: Assigned = const { Assigned(Cell::new(None)) };
}

/// Fix this process's device (a worker process's `--device` or `--device-slot`); an error
/// when it was fixed already to something else.
pub fn pin_process(pin: DevicePin) -> Result<()> {
    let set = *PIN.get_or_init(|| pin);
    if set != pin {
        return Err(DataFusionError::Configuration(format!(
            "this process's device is already {set:?}, not {pin:?}"
        )));
    }
    Ok(())
}

/// CUDA devices this process sees (the driver's count, after `CUDA_VISIBLE_DEVICES`); 0
/// without a driver or a device. Asked once per process.
pub fn visible_cuda_devices() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT
        .get_or_init(|| crate::functions::embedding::cuda_driver::probe_device_count().unwrap_or(0))
}

/// Accelerator workers a session's model queries may run: `flumen.accelerator_slots`,
/// or where it is 0 one per CUDA device this process sees (each worker takes its own), at
/// least 1; 1 with `flumen.device = 'cpu'`. Asks the CUDA driver once per process, so
/// callers ask only for plans with a model.
pub fn accelerator_workers(config: &FlumenConfig) -> usize {
    match config.accelerator_slots {
        0 if config.device == Device::Cpu => 1,
        0 => visible_cuda_devices().max(1),
        n => n,
    }
}

/// The device this process is pinned to among `devices` (`--device`, or `--device-slot`
/// modulo `devices`), if it is.
pub fn process_device(devices: usize) -> Option<usize> {
    match PIN.get()? {
        DevicePin::Device(n) => Some(*n),
        DevicePin::Slot(slot) => Some(slot % devices.max(1)),
    }
}

/// The CUDA device ordinal this thread's models open: given on the first call (module
/// docs) and the same for the thread's life.
pub fn worker_device() -> Result<usize> {
    worker_device_among(visible_cuda_devices().max(1), PIN.get().copied())
}

fn worker_device_among(devices: usize, pin: Option<DevicePin>) -> Result<usize> {
    ASSIGNED.with(|assigned| {
        if let Some((device, _)) = assigned.0.get() {
            return Ok(device);
        }
        let mut load = LOAD.lock().unwrap_or_else(|e| e.into_inner());
        let (device, counted) = choose(pin, devices, &mut load)?;
        assigned.0.set(Some((device, counted)));
        Ok(device)
    })
}

/// The device for a new worker among `devices`, and whether it was counted in `load`
/// (chosen as the least used, so its thread's end gives the place back).
fn choose(pin: Option<DevicePin>, devices: usize, load: &mut Vec<usize>) -> Result<(usize, bool)> {
    match pin {
        Some(DevicePin::Device(n)) if n < devices => Ok((n, false)),
        Some(DevicePin::Device(n)) => Err(no_such_device(n, devices)),
        Some(DevicePin::Slot(slot)) => Ok((slot % devices, false)),
        None => {
            load.resize(load.len().max(devices), 0);
            let device = (0..devices)
                .min_by_key(|&d| (load[d], d))
                .expect("at least one device");
            load[device] += 1;
            Ok((device, true))
        }
    }
}

/// The error for `--device cuda:N` on a host with `devices` visible CUDA devices.
fn no_such_device(n: usize, devices: usize) -> DataFusionError {
    let visible = match devices {
        0 => "no visible CUDA device".to_string(),
        1 => "1 visible CUDA device (cuda:0)".to_string(),
        _ => format!(
            "{devices} visible CUDA devices (cuda:0 to cuda:{})",
            devices - 1
        ),
    };
    DataFusionError::Configuration(format!(
        "flumen worker --device cuda:{n}: this host has {visible}"
    ))
}

/// Check a worker process's `--device cuda:N` against this host's visible devices (at its
/// start, so a wrong ordinal is said at once, not at its first model).
pub fn check_device(n: usize) -> Result<()> {
    let devices = visible_cuda_devices();
    if n < devices {
        Ok(())
    } else {
        Err(no_such_device(n, devices))
    }
}

/// Parse `cuda:N` (or `N`) as a device ordinal.
pub fn parse_cuda_device(text: &str) -> std::result::Result<usize, String> {
    let digits = text.trim().strip_prefix("cuda:").unwrap_or(text.trim());
    digits
        .parse()
        .map_err(|_| format!("a CUDA device is cuda:N (N = 0, 1, ...), got '{text}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set number of accelerator workers is kept; 0 is one per visible GPU (at least 1),
    /// and 1 where models run on the CPU.
    #[test]
    fn accelerator_workers_default_to_one_per_gpu() {
        let mut config = FlumenConfig::default();
        assert_eq!(config.accelerator_slots, 0);
        assert_eq!(accelerator_workers(&config), visible_cuda_devices().max(1));
        config.device = Device::Cpu;
        assert_eq!(accelerator_workers(&config), 1);
        config.accelerator_slots = 3;
        assert_eq!(accelerator_workers(&config), 3);
    }

    #[test]
    fn a_pinned_device_is_kept_and_one_past_the_host_is_refused() {
        let mut load = vec![];
        assert_eq!(
            choose(Some(DevicePin::Device(1)), 2, &mut load).unwrap(),
            (1, false)
        );
        let err = choose(Some(DevicePin::Device(2)), 2, &mut load).unwrap_err();
        assert!(
            err.to_string().contains("cuda:2") && err.to_string().contains("cuda:0 to cuda:1"),
            "{err}"
        );
        let none = no_such_device(0, 0).to_string();
        assert!(none.contains("no visible CUDA device"), "{none}");
        assert_eq!(
            choose(Some(DevicePin::Slot(5)), 2, &mut load).unwrap(),
            (1, false)
        );
        assert_eq!(
            choose(Some(DevicePin::Slot(4)), 2, &mut load).unwrap(),
            (0, false)
        );
        assert!(
            load.iter().all(|&n| n == 0),
            "pinned workers are not counted"
        );
    }

    #[test]
    fn devices_parse_as_cuda_n() {
        assert_eq!(parse_cuda_device("cuda:3"), Ok(3));
        assert_eq!(parse_cuda_device("0"), Ok(0));
        assert!(parse_cuda_device("gpu1").unwrap_err().contains("cuda:N"));
    }

    /// Four threads over two devices get two each; a thread keeps its device on later
    /// calls; the places come back when the threads end, so the next two spread again.
    #[test]
    fn workers_spread_over_the_devices_and_give_their_place_back() {
        let take = |n: usize| -> Vec<usize> {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(n));
            let threads: Vec<_> = (0..n)
                .map(|_| {
                    let barrier = std::sync::Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        let device = worker_device_among(2, None).unwrap();
                        assert_eq!(worker_device_among(2, None).unwrap(), device);
                        // Every thread holds its device until all have one.
                        barrier.wait();
                        device
                    })
                })
                .collect();
            let mut devices: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            devices.sort();
            devices
        };
        assert_eq!(take(4), vec![0, 0, 1, 1]);
        assert_eq!(take(2), vec![0, 1]);
        assert!(LOAD.lock().unwrap().iter().all(|&n| n == 0));
    }
}
