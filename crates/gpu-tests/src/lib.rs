//! Support for the GPU tests in `tests/`: every test is one generic
//! function over [`Driver`] (the same [`GpuBackend`] through cudarc and
//! through cust), instantiated for both drivers by [`both!`]. Each test
//! skips with a printed `SKIPPED <test>: <reason>` line when there is no
//! device (with the CI's stub libcuda every driver call answers
//! CUDA_ERROR_NO_DEVICE).
//!
//! On the GPU machine, from the prebuilt test binaries:
//! `<binary> --test-threads=1 --nocapture [filter]`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use qmk_gpu::{Driver, GpuBackend, Options};
use qmk_model::{synthetic_weights, Config, Weights};

pub use qmk_backend_cudarc::CudarcDriver;
pub use qmk_backend_cust::CustDriver;
/// Lowest index of the maximum: the kernel's tie rule.
pub use qmk_engine::sampling::argmax;

/// Instantiates a generic test `$f::<D>($args)` for both drivers, as
/// `$name::cudarc` and `$name::cust`.
#[macro_export]
macro_rules! both {
    ($name:ident, $f:ident $(, $arg:expr)*) => {
        mod $name {
            #[test]
            fn cudarc() {
                super::$f::<$crate::CudarcDriver>($($arg),*);
            }
            #[test]
            fn cust() {
                super::$f::<$crate::CustDriver>($($arg),*);
            }
        }
    };
}

/// `n` deterministic synthetic prompt ids below Qwen's special tokens
/// (xorshift64 from `seed ^ n`).
pub fn synthetic_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed ^ n as u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 151_643) as u32
        })
        .collect()
}

/// Seed of every synthetic model these tests build.
pub const SEED: u64 = 20261129;

/// One GPU test at a time: each launch wants every SM.
static GPU: Mutex<()> = Mutex::new(());

/// Why there is no device to test on, if there is none (either driver).
pub fn no_device() -> Option<String> {
    match (
        qmk_gpu::device_count::<CustDriver>(),
        qmk_gpu::device_count::<CudarcDriver>(),
    ) {
        (Ok(_), Ok(_)) => None,
        (Err(e), _) => Some(format!("cust: {e}")),
        (_, Err(e)) => Some(format!("cudarc: {e}")),
    }
}

/// The GPU lock, or `None` after printing why the test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<MutexGuard<'static, ()>> {
    match no_device() {
        None => Some(GPU.lock().unwrap_or_else(|e| e.into_inner())),
        Some(reason) => {
            println!("SKIPPED {test}: {reason}");
            None
        }
    }
}

/// Synthetic weights of the last preset asked for (7B is 15 GB: keep one).
pub fn weights(preset: &str) -> Arc<Weights> {
    static CACHE: Mutex<Option<(String, Arc<Weights>)>> = Mutex::new(None);
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, w)) = c.as_ref() {
        if p == preset {
            return w.clone();
        }
    }
    *c = None;
    let t = Instant::now();
    let w = Arc::new(synthetic_weights(&Config::preset(preset).unwrap(), SEED));
    println!(
        "{preset}: synthetic weights in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    *c = Some((preset.to_string(), w.clone()));
    w
}

/// Opens the backend through `D` with `opts`, panicking with the driver's
/// name, and prints what it runs on.
pub fn open<D: Driver>(w: &Weights, opts: Options) -> GpuBackend<D> {
    let b = GpuBackend::<D>::new(w, opts, &mut ())
        .unwrap_or_else(|e| panic!("{}: opening the backend: {e}", D::NAME));
    println!("{}", describe(&b));
    b
}

/// [`Options`] with a `capacity`-position KV cache, the rest default.
pub fn with_capacity(capacity: usize) -> Options {
    Options {
        capacity,
        ..Default::default()
    }
}

/// The driver, device, launch shape and kernel resources, in one line.
pub fn describe<D: Driver>(b: &GpuBackend<D>) -> String {
    let l = b.launch_info();
    let mut s = format!(
        "{}: {} ({}), grid {} x {} threads ({} CTA/SM of max {}), {} B dyn smem, {} regs, {} barriers/step",
        D::NAME,
        b.device().name,
        b.arch(),
        l.grid,
        l.block,
        l.ctas_per_sm,
        l.max_ctas_per_sm,
        l.smem_bytes,
        l.registers,
        b.kernel_build().barriers_per_step
    );
    if let Some((pl, chunk)) = b.prefill_launch() {
        s += &format!(
            "; prefill grid {} ({} CTA/SM), {} B dyn smem, {} regs, chunk {chunk}",
            pl.grid, pl.ctas_per_sm, pl.smem_bytes, pl.registers
        );
    }
    s
}

/// ||gpu - cpu|| / ||cpu||, in f64.
pub fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Seconds from an environment variable (the sanitizer runs raise the spin
/// budget and the host deadline this way), else `default`.
pub fn env_secs(var: &str, default: Duration) -> Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(default)
}

/// One prompt of a golden file: transformers' greedy outputs.
pub struct Golden {
    /// The prompt's name.
    pub id: String,
    /// The prompt's token ids `[n]`.
    pub input_ids: Vec<u32>,
    /// transformers' greedy continuation `[steps]`.
    pub output_ids: Vec<u32>,
    /// The 5 most likely ids at each step `[steps, 5]`.
    pub top5: Vec<Vec<u32>>, // [steps, 5]
}

/// The golden file named by `var`; `None` after printing why not.
pub fn goldens(test: &str, var: &str) -> Option<Vec<Golden>> {
    let Some(path) = std::env::var_os(var).map(std::path::PathBuf::from) else {
        println!("SKIPPED {test}: {var} is not set (a golden .jsonl of transformers' outputs)");
        return None;
    };
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{test}: {}: {e}", path.display()));
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Some(
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let g: serde_json::Value = serde_json::from_str(l).unwrap();
                Golden {
                    id: g["id"].as_str().unwrap().to_string(),
                    input_ids: ids(&g["input_ids"]),
                    output_ids: ids(&g["output_ids"]),
                    top5: g["top5"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|s| {
                            s.as_array()
                                .unwrap()
                                .iter()
                                .map(|p| p[0].as_u64().unwrap() as u32)
                                .collect()
                        })
                        .collect(),
                }
            })
            .collect(),
    )
}
