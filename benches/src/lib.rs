//! Support for the driver-comparison benches (`cargo bench -p qmk-benches`):
//! every measure is one generic function over [`qmk_gpu::Driver`], run on
//! the same [`GpuBackend`] through cudarc and through cust side by side.
//!
//! Every time here is taken with device events or closed by a stream /
//! context synchronisation, never by a host clock around an asynchronous
//! call alone:
//! - decode step: host clock around `Backend::step`, which returns only once
//!   the step's completion event has fired (the latency a library user
//!   sees); plus the backend's own event-timed `bench()` for the table;
//! - weight upload: the backend's [`GpuBackend::upload_stats`] (host clock
//!   from the first copy to a context synchronisation after the last);
//! - launch overhead: [`GpuBackend::empty_launches`], N empty steps (the
//!   megakernel with its real parameter block and cooperative grid at a
//!   position past the KV capacity, so every CTA returns at once) queued
//!   back to back, closed by a stream synchronisation.

use std::time::{Duration, Instant};

use qmk_engine::Backend;
use qmk_gpu::{BenchOptions, BenchReport, Driver, GpuBackend, Options};
use qmk_model::Weights;

pub use qmk_backend_cudarc::CudarcDriver;
pub use qmk_backend_cust::CustDriver;

/// `Err(reason)` unless both drivers see a device.
pub fn gpu_available() -> Result<(), String> {
    qmk_gpu::device_count::<CustDriver>().map_err(|e| format!("cust: {e}"))?;
    qmk_gpu::device_count::<CudarcDriver>()
        .map(|_| ())
        .map_err(|e| format!("cudarc: {e}"))
}

/// Opens the backend through `D` with a `capacity`-position KV cache;
/// returns it and the weight upload's duration.
pub fn open<D: Driver>(w: &Weights, capacity: usize) -> (GpuBackend<D>, Duration) {
    let opts = Options {
        capacity,
        ..Default::default()
    };
    let b = GpuBackend::<D>::new(w, opts, &mut ()).unwrap_or_else(|e| panic!("{}: {e}", D::NAME));
    let took = b.upload_stats().0;
    (b, took)
}

/// The backend's own event-timed decode benchmark, with a small stream
/// buffer (the floor is not what the table compares).
pub fn decode_report<D: Driver>(b: &mut GpuBackend<D>, warmup: usize, steps: usize) -> BenchReport {
    let opts = BenchOptions {
        warmup,
        steps,
        stream_bytes: 1 << 30,
        ..Default::default()
    };
    b.bench(&opts)
        .unwrap_or_else(|e| panic!("{} bench(): {e}", D::NAME))
}

/// Decode steps through the `Backend` trait, positions cycling through
/// `0..capacity` (a reset between cycles, outside the timed region);
/// returns the summed host time of the `iters` steps, each closed by the
/// step's own completion wait.
pub fn time_steps<B: Backend>(b: &mut B, pos: &mut usize, token: &mut u32, iters: u64) -> Duration
where
    B::Error: std::fmt::Display,
{
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        if *pos >= b.capacity() {
            b.reset().unwrap_or_else(|e| panic!("reset: {e}"));
            *pos = 0;
        }
        let t = Instant::now();
        let out = b
            .step(*token, *pos)
            .unwrap_or_else(|e| panic!("step at {pos}: {e}"));
        total += t.elapsed();
        *token = out.argmax;
        *pos += 1;
    }
    total
}

/// Median of `v` (sorts it).
pub fn median(v: &mut [f64]) -> f64 {
    qmk_gpu::stats::median(v)
}
