//! Both CUDA backends behind one trait with the test hooks the hardening
//! tests need (faults.rs, endurance.rs include this file by path).
#![allow(dead_code)]

use std::time::Duration;

use qmk_engine::Backend;
use qmk_kernels::host::GpuOptions;
use qmk_model::Weights;

/// A CUDA backend with its test hooks and error kinds.
pub trait Hooks: Backend + Sized {
    const NAME: &'static str;
    fn open(w: &Weights, opts: GpuOptions) -> Result<Self, Self::Error>;
    fn describe(&self) -> String;
    fn set_debug_hang(&mut self, on: bool);
    fn set_debug_oob(&mut self, on: bool);
    fn set_spin_timeout(&mut self, t: Duration);
    fn set_step_deadline(&mut self, t: Duration);
    /// `n` greedy steps back to back (the kernel feeds its own pick), device
    /// time between events around the batch.
    fn timed_steps(&mut self, first: u32, start: usize, n: usize) -> Result<Duration, Self::Error>;
    /// Positions per prefill launch when the prefill kernel is enabled.
    fn prefill_chunk(&self) -> Option<u32>;
    fn is_timeout(e: &Self::Error) -> bool;
    fn is_kernel_error(e: &Self::Error) -> bool;
    fn is_unusable(e: &Self::Error) -> bool;
    fn is_cubin_arch(e: &Self::Error) -> bool;
}

macro_rules! impl_hooks {
    ($ty:ty, $name:literal, $krate:ident) => {
        impl Hooks for $ty {
            const NAME: &'static str = $name;
            fn open(w: &Weights, opts: GpuOptions) -> Result<Self, Self::Error> {
                <$ty>::new(w, opts, &mut ())
            }
            fn describe(&self) -> String {
                let l = self.launch_info();
                format!(
                    "{}: {} ({}), grid {} x {} threads, {} B dyn smem, {} regs",
                    $name,
                    self.device().name,
                    self.arch(),
                    l.grid,
                    l.block,
                    l.smem_bytes,
                    l.registers
                )
            }
            fn set_debug_hang(&mut self, on: bool) {
                <$ty>::set_debug_hang(self, on)
            }
            fn set_debug_oob(&mut self, on: bool) {
                <$ty>::set_debug_oob(self, on)
            }
            fn set_spin_timeout(&mut self, t: Duration) {
                <$ty>::set_spin_timeout(self, t)
            }
            fn set_step_deadline(&mut self, t: Duration) {
                <$ty>::set_step_deadline(self, t)
            }
            fn timed_steps(
                &mut self,
                first: u32,
                start: usize,
                n: usize,
            ) -> Result<Duration, Self::Error> {
                <$ty>::timed_steps(self, first, start, n)
            }
            fn prefill_chunk(&self) -> Option<u32> {
                self.prefill_launch().map(|(_, chunk)| chunk)
            }
            fn is_timeout(e: &Self::Error) -> bool {
                matches!(e, $krate::Error::Timeout { .. })
            }
            fn is_kernel_error(e: &Self::Error) -> bool {
                matches!(e, $krate::Error::Kernel { .. })
            }
            fn is_unusable(e: &Self::Error) -> bool {
                matches!(e, $krate::Error::Unusable { .. })
            }
            fn is_cubin_arch(e: &Self::Error) -> bool {
                matches!(e, $krate::Error::CubinArch { .. })
            }
        }
    };
}
impl_hooks!(
    qmk_backend_cudarc::CudarcBackend,
    "cudarc",
    qmk_backend_cudarc
);
impl_hooks!(qmk_backend_cust::CustBackend, "cust", qmk_backend_cust);

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
