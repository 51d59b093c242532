//! Support for the backend-comparison benches (`cargo bench -p qmk-benches`):
//! one [`GpuBench`] trait both CUDA backends implement, so every measure is
//! one generic function run for each backend side by side.
//!
//! Every time here is taken with device events or closed by a stream /
//! context synchronisation, never by a host clock around an asynchronous
//! call alone:
//! - decode step: host clock around `Backend::step`, which returns only once
//!   the step's completion event has fired (the latency a library user
//!   sees); plus the backends' own event-timed `bench()` for the table;
//! - weight upload: host clock from the first copy to a context
//!   synchronisation after the last (the backends' upload `Progress` hooks);
//! - launch overhead: N empty steps (the megakernel with its real parameter
//!   block and cooperative grid at a position past the KV capacity, so every
//!   CTA returns at once) queued back to back, closed by a stream
//!   synchronisation.

use std::time::{Duration, Instant};

use qmk_backend_cudarc::CudarcBackend;
use qmk_backend_cust::CustBackend;
use qmk_engine::Backend;
use qmk_model::Weights;

mod cudarc_empty;

/// Median device-event time of one decode step, and what it implies.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeRow {
    pub us_per_step: f64,
    pub us_p10: f64,
    pub us_p90: f64,
    pub tok_per_s: f64,
    pub gbps: f64,
    pub floor_gbps: f64,
    pub pct_of_floor: f64,
    pub grid: u32,
}

/// A CUDA backend as the benches drive it.
pub trait GpuBench: Backend + Sized {
    const NAME: &'static str;
    /// `Err(reason)` when there is no usable device.
    fn available() -> Result<(), String>;
    /// Opens the backend; returns it and the weight upload's duration.
    fn open(w: &Weights, capacity: usize) -> Result<(Self, Duration), String>;
    /// The backend's own event-timed decode benchmark.
    fn decode_report(&mut self, warmup: usize, steps: usize) -> Result<DecodeRow, String>;
    /// Host time of `n` empty steps queued back to back, closed by a stream
    /// synchronisation.
    fn empty_launches(&mut self, n: usize) -> Result<Duration, String>;
}

/// Times the upload between `begin` and `finish`, closing it with a
/// context synchronisation (`sync`).
struct UploadTimer<F: FnMut()> {
    start: Option<Instant>,
    took: Option<Duration>,
    sync: F,
}

impl<F: FnMut()> UploadTimer<F> {
    fn new(sync: F) -> Self {
        UploadTimer {
            start: None,
            took: None,
            sync,
        }
    }
    fn begin(&mut self) {
        self.start = Some(Instant::now());
    }
    fn finish(&mut self) {
        (self.sync)();
        self.took = self.start.map(|s| s.elapsed());
    }
}

impl<F: FnMut()> qmk_backend_cust::Progress for UploadTimer<F> {
    fn begin(&mut self, _: &str, _: u64) {
        UploadTimer::begin(self)
    }
    fn finish(&mut self) {
        UploadTimer::finish(self)
    }
}

/// `bench()` options for the table: a small stream buffer (the floor is
/// not what this compares).
fn stream_bytes() -> u64 {
    1 << 30
}

impl GpuBench for CudarcBackend {
    const NAME: &'static str = "cudarc";

    fn available() -> Result<(), String> {
        qmk_backend_cudarc::device_count()
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn open(w: &Weights, capacity: usize) -> Result<(Self, Duration), String> {
        let opts = qmk_backend_cudarc::Options {
            capacity,
            ..Default::default()
        };
        // The upload's context is current on this thread while `new` runs.
        let mut timer = UploadTimer::new(|| {
            let _ = cudarc::driver::result::ctx::synchronize();
        });
        let b = CudarcBackend::new(w, opts, &mut timer).map_err(|e| e.to_string())?;
        let took = timer.took.ok_or("the cudarc backend reported no upload")?;
        Ok((b, took))
    }

    fn decode_report(&mut self, warmup: usize, steps: usize) -> Result<DecodeRow, String> {
        let opts = qmk_backend_cudarc::BenchOptions {
            warmup,
            steps,
            stream_bytes: stream_bytes(),
            ..Default::default()
        };
        let r = self.bench(&opts).map_err(|e| e.to_string())?;
        Ok(DecodeRow {
            us_per_step: r.us_per_step,
            us_p10: r.us_p10,
            us_p90: r.us_p90,
            tok_per_s: r.tok_per_s,
            gbps: r.gbps,
            floor_gbps: r.floor_gbps,
            pct_of_floor: r.pct_of_floor,
            grid: r.grid,
        })
    }

    fn empty_launches(&mut self, n: usize) -> Result<Duration, String> {
        cudarc_empty::empty_launches(self, n).map_err(|e| e.to_string())
    }
}

impl GpuBench for CustBackend {
    const NAME: &'static str = "cust";

    fn available() -> Result<(), String> {
        qmk_backend_cust::device_count()
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn open(w: &Weights, capacity: usize) -> Result<(Self, Duration), String> {
        let opts = qmk_backend_cust::Options {
            capacity,
            ..Default::default()
        };
        // The backend synchronises the context before `finish`; the timer's
        // own synchronisation is then a no-op kept for symmetry.
        let mut timer = UploadTimer::new(|| {
            let _ = cust::context::CurrentContext::synchronize();
        });
        let b = CustBackend::new(w, opts, &mut timer).map_err(|e| e.to_string())?;
        let took = timer.took.ok_or("the cust backend reported no upload")?;
        Ok((b, took))
    }

    fn decode_report(&mut self, warmup: usize, steps: usize) -> Result<DecodeRow, String> {
        let opts = qmk_backend_cust::BenchOptions {
            warmup,
            steps,
            stream_bytes: stream_bytes(),
            ..Default::default()
        };
        let r = self.bench(&opts).map_err(|e| e.to_string())?;
        Ok(DecodeRow {
            us_per_step: r.us_per_step,
            us_p10: r.us_p10,
            us_p90: r.us_p90,
            tok_per_s: r.tok_per_s,
            gbps: r.gbps,
            floor_gbps: r.floor_gbps,
            pct_of_floor: r.pct_of_floor,
            grid: r.grid,
        })
    }

    fn empty_launches(&mut self, n: usize) -> Result<Duration, String> {
        CustBackend::empty_launches(self, n).map_err(|e| e.to_string())
    }
}

/// `Err(reason)` unless both backends see a device.
pub fn gpu_available() -> Result<(), String> {
    CustBackend::available().map_err(|e| format!("cust: {e}"))?;
    CudarcBackend::available().map_err(|e| format!("cudarc: {e}"))
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
    qmk_kernels::host::median(v)
}
