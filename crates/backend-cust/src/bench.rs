//! The bandwidth floor, the decode benchmark (DESIGN.md section 4) and the
//! host overhead of one launch; same method as the cudarc backend's, with
//! the statistics from [`qmk_kernels::host`].

use std::time::{Duration, Instant};

use cust::context::CurrentContext;
use cust::event::Event;
use cust::memory::mem_get_info;
use qmk_engine::Backend as _;
use qmk_kernels::host::{bench_positions, median, BenchOptions, BenchReport, KV_FILL_BF16};
use qmk_kernels::{StreamParams, FLAG_TOKEN_FROM_ARGMAX};

use crate::backend::{occupancy, CustBackend};
use crate::error::{check, cu, Error, Result};
use crate::mem::{addr, alloc};

/// What one empty decode step costs: the megakernel launched with its real
/// parameter block and cooperative grid, at a position past the KV capacity,
/// so every CTA returns at once.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchOverhead {
    pub launches: usize,
    /// Host time per launch when launches are queued back to back (host
    /// clock around the batch, closed by a stream synchronisation): the
    /// host-side cost of submitting one cooperative launch.
    pub submit_us: f64,
    /// Median host time of one launch + stream synchronisation.
    pub round_trip_us: f64,
    /// Median device time of one empty step (events).
    pub device_us: f64,
}

impl CustBackend {
    fn elapsed_us(&mut self, a: &Event, b: &Event) -> Result<f64> {
        b.elapsed_time_f32(a)
            .map(|ms| f64::from(ms) * 1e3)
            .map_err(|e| self.fail("cuEventElapsedTime", e))
    }

    fn sync_stream(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.fail("cuStreamSynchronize", e))
    }

    fn launch_empty(&mut self) -> Result<()> {
        let pos = self.capacity;
        self.launch_step(0, pos, 0)
    }

    /// `n` empty steps queued back to back, then a stream synchronisation;
    /// returns the host time of the whole (criterion's `iter_custom`).
    /// Leaves the engine reset.
    pub fn empty_launches(&mut self, n: usize) -> Result<Duration> {
        self.reset()?;
        let t0 = Instant::now();
        let r = (0..n).try_for_each(|_| self.launch_empty());
        let s = self.sync_stream();
        let t = t0.elapsed();
        self.reset()?;
        r.and(s).map(|()| t)
    }

    /// Host overhead of one launch, three ways (see [`LaunchOverhead`]).
    pub fn launch_overhead(&mut self, launches: usize) -> Result<LaunchOverhead> {
        let n = launches.max(1);
        let _warm = self.empty_launches(16)?;
        let submit = self.empty_launches(n)?;
        self.reset()?;
        let mut round = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            self.launch_empty()?;
            self.sync_stream()?;
            round.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        let evs = (0..=n)
            .map(|_| self.new_event())
            .collect::<Result<Vec<_>>>()?;
        self.record(&evs[0])?;
        for ev in &evs[1..] {
            self.launch_empty()?;
            self.record(ev)?;
        }
        self.sync_stream()?;
        let mut dev = Vec::with_capacity(n);
        for w in evs.windows(2) {
            dev.push(self.elapsed_us(&w[0], &w[1])?);
        }
        self.reset()?;
        Ok(LaunchOverhead {
            launches: n,
            submit_us: submit.as_secs_f64() * 1e6 / n as f64,
            round_trip_us: median(&mut round),
            device_us: median(&mut dev),
        })
    }

    /// `n` decode steps back to back from position `start` (the kernel feeds
    /// its own pick to the next step on the device, no host round trip);
    /// returns the device time between events around the batch.
    pub fn timed_steps(&mut self, first_token: u32, start: usize, n: usize) -> Result<Duration> {
        self.usable()?;
        let end = start
            .checked_add(n)
            .filter(|&e| e <= self.capacity && start <= self.next_pos);
        if n == 0 || end.is_none() {
            return Err(Error::Option {
                field: "steps",
                reason: format!(
                    "{n} steps from position {start} must be >= 1, start at or before {} and fit the {}-position KV cache",
                    self.next_pos, self.capacity
                ),
            });
        }
        let (a, b) = (self.new_event()?, self.new_event()?);
        self.record(&a)?;
        for pos in start..start + n {
            let flags = if pos == start {
                0
            } else {
                FLAG_TOKEN_FROM_ARGMAX
            };
            self.launch_step(first_token, pos, flags)?;
        }
        self.record(&b)?;
        let deadline = self.opts.step_deadline.saturating_mul(n as u32);
        self.wait(&b, deadline)?;
        self.next_pos = start + n;
        let us = self.elapsed_us(&a, &b)?;
        Ok(Duration::from_secs_f64(us * 1e-6))
    }

    /// Streaming-read bandwidth in GB/s (1e9 B/s): median of `reps` reads of
    /// a `bytes` buffer filled with a non-zero pattern.
    pub fn stream_bandwidth(&mut self, bytes: u64, reps: usize) -> Result<f64> {
        self.usable()?;
        let bytes = bytes & !15;
        let free = mem_get_info().map_err(|e| self.fail("cuMemGetInfo", e))?.0 as u64;
        if bytes + (256 << 20) > free {
            return Err(Error::OutOfMemory {
                what: "the streaming-read buffer".into(),
                needed: bytes,
                available: free,
            });
        }
        let buf = alloc(bytes, "stream buffer", false)?;
        // SAFETY: buf holds `bytes` bytes. Never time zeros: 0xA5 pattern.
        // Synchronise: the legacy-stream memset is not ordered before our
        // non-blocking stream.
        check("cuMemsetD8", unsafe {
            cust::sys::cuMemsetD8_v2(addr(&buf), 0xA5, bytes as usize)
        })
        .and_then(|()| CurrentContext::synchronize().map_err(cu("cuCtxSynchronize")))
        .map_err(|e| self.note(e))?;
        let occ = occupancy(self.funcs.stream_read, 0)?.max(1) as u32;
        let grid = occ * self.info.sms;
        let out = alloc(grid as u64 * 4, "stream checksums", true)?;
        let mut p = StreamParams {
            src: addr(&buf),
            n_vec16: bytes / 16,
            out: addr(&out),
        };
        let evs = (0..=reps + 1)
            .map(|_| self.new_event())
            .collect::<Result<Vec<_>>>()?;
        self.record(&evs[0])?;
        for ev in &evs[1..] {
            let mut args = [(&mut p as *mut StreamParams).cast::<std::ffi::c_void>()];
            // SAFETY: one StreamParams by value; buffers live until the end
            // (the wait below).
            let r = unsafe {
                cust::sys::cuLaunchKernel(
                    self.funcs.stream_read,
                    grid,
                    1,
                    1,
                    qmk_kernels::THREADS_PER_CTA,
                    1,
                    1,
                    0,
                    self.stream.as_inner(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check("cuLaunchKernel (stream read)", r).map_err(|e| self.note(e))?;
            self.record(ev)?;
        }
        let last = evs.last().expect("reps + 2 events");
        self.wait(last, Duration::from_secs(60))?;
        // The first launch is a warm-up.
        let mut times = Vec::with_capacity(reps);
        for w in evs[1..].windows(2) {
            times.push(self.elapsed_us(&w[0], &w[1])?);
        }
        let us = median(&mut times);
        Ok(bytes as f64 / (us * 1e-6) / 1e9)
    }

    /// Fills both KV caches with [`KV_FILL_BF16`] (the long-context bench:
    /// positions below its first step hold these synthetic values).
    pub fn fill_kv_cache(&mut self) -> Result<()> {
        self.usable()?;
        let n = (self.memory.kv_cache_bytes / 2) as usize;
        for cache in [self.params.k_cache, self.params.v_cache] {
            // SAFETY: each cache holds kv_cache_bytes; no step is running.
            // Synchronise: the legacy-stream memset is not ordered before
            // our non-blocking stream.
            check("cuMemsetD16", unsafe {
                cust::sys::cuMemsetD16_v2(cache, KV_FILL_BF16, n)
            })
            .and_then(|()| CurrentContext::synchronize().map_err(cu("cuCtxSynchronize")))
            .map_err(|e| self.note(e))?;
        }
        Ok(())
    }

    /// Per-step times (us) of the timed steps of one back-to-back run at
    /// the positions of [`bench_positions`] (KV filled first when they do
    /// not start at 0). `greedy`: the kernel feeds its own pick forward;
    /// else the token is fixed (profiling variants compute garbage).
    fn time_steps(
        &mut self,
        opts: &BenchOptions,
        extra_flags: u32,
        greedy: bool,
    ) -> Result<Vec<f64>> {
        let (first, total) = bench_positions(opts);
        if opts.steps == 0 || first + total > self.capacity {
            return Err(Error::Option {
                field: "steps",
                reason: format!(
                    "{} warm-up + {} timed steps from position {first} must be >= 1 and fit the \
                     {}-position KV cache",
                    opts.warmup, opts.steps, self.capacity
                ),
            });
        }
        self.reset()?;
        if first > 0 {
            self.fill_kv_cache()?;
        }
        let evs = (0..=total)
            .map(|_| self.new_event())
            .collect::<Result<Vec<_>>>()?;
        self.record(&evs[0])?;
        for i in 0..total {
            let mut flags = extra_flags | opts.flags;
            if greedy && i > 0 {
                flags |= FLAG_TOKEN_FROM_ARGMAX;
            }
            self.launch_step(opts.first_token, first + i, flags)?;
            self.record(&evs[i + 1])?;
        }
        let deadline = self.opts.step_deadline.saturating_mul(total as u32);
        self.wait(&evs[total], deadline)?;
        let mut us = Vec::with_capacity(opts.steps);
        for i in opts.warmup..total {
            us.push(self.elapsed_us(&evs[i], &evs[i + 1])?);
        }
        Ok(us)
    }

    /// Where the time goes: every variant of
    /// [`qmk_kernels::host::PROFILE_VARIANTS`] (phase skips and A/B flags)
    /// timed at the same positions, median us/step. Resets the engine after.
    pub fn bench_profile(&mut self, opts: &BenchOptions) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        for &(name, flags) in qmk_kernels::host::PROFILE_VARIANTS {
            let mut t = self.time_steps(opts, flags, false)?;
            out.push((name.to_string(), median(&mut t)));
        }
        self.reset()?;
        Ok(out)
    }

    /// Greedy decode of `warmup + steps` positions back to back (from
    /// [`bench_positions`]), timed per step with events, then the floor.
    /// Resets the engine before and after.
    pub fn bench(&mut self, opts: &BenchOptions) -> Result<BenchReport> {
        let us = self.time_steps(opts, 0, true)?;
        let barriers = self.barriers_last_step()?;
        self.reset()?;
        let floor_gbps = self.stream_bandwidth(opts.stream_bytes, opts.stream_reps)?;
        Ok(BenchReport::from_times(
            format!("{} ({})", self.info.name, self.info.arch),
            &self.config,
            self.memory.weight_bytes_per_step,
            opts,
            us,
            floor_gbps,
            barriers,
            &self.launch,
        ))
    }

    /// Synchronises the whole context (benches close host-clock timings
    /// with it).
    pub fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        CurrentContext::synchronize().map_err(cu("cuCtxSynchronize"))
    }
}
