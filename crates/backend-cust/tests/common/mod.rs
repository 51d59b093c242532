//! Helpers shared by the GPU test files of this crate (gpu.rs, prefill.rs,
//! scale.rs, long_context.rs, faults.rs, endurance.rs). Each uses a subset.
#![allow(dead_code)]

/// Instantiates a generic test `$f::<B>($args)` for both backends, as
/// `$name::cudarc` and `$name::cust` (`#[macro_use] mod common;`).
#[allow(unused_macros)]
macro_rules! both {
    ($name:ident, $f:ident $(, $arg:expr)*) => {
        mod $name {
            #[test]
            fn cudarc() {
                super::$f::<qmk_backend_cudarc::CudarcBackend>($($arg),*);
            }
            #[test]
            fn cust() {
                super::$f::<qmk_backend_cust::CustBackend>($($arg),*);
            }
        }
    };
}

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use qmk_model::{synthetic_weights, Config, Weights};

/// Seed of every synthetic model these tests build.
pub const SEED: u64 = 20261129;

/// Lowest index of the maximum: the kernel's tie rule.
#[allow(unused_imports)]
pub use qmk_engine::sampling::argmax;

/// One GPU test at a time: each launch wants every SM.
static GPU: Mutex<()> = Mutex::new(());

/// The lock, or `None` after printing why the test is skipped.
pub fn gpu_or_skip(test: &str) -> Option<MutexGuard<'static, ()>> {
    let reason = match (
        qmk_backend_cust::device_count(),
        qmk_backend_cudarc::device_count(),
    ) {
        (Ok(_), Ok(_)) => return Some(GPU.lock().unwrap_or_else(|e| e.into_inner())),
        (Err(e), _) => format!("cust: {e}"),
        (_, Err(e)) => format!("cudarc: {e}"),
    };
    println!("SKIPPED {test}: {reason}");
    None
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

/// ||gpu - cpu|| / ||cpu||, in f64.
pub fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
