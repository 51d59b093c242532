//! The bandwidth floor, the decode and prefill benchmarks, the profile and
//! the host overhead of one launch (`docs/performance.md` has the method).
//!
//! Floor: bytes one step must move (every weight but the embedding table,
//! one embedding row, the KV cache read and write) over the bandwidth a
//! streaming-read kernel from the same cubin measures in the same run.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use qmk_engine::{Backend as _, StepOutput};
use qmk_kernels::params::FLAG_TRACE;
use qmk_kernels::{StreamParams, FLAG_TOKEN_FROM_ARGMAX, THREADS_PER_CTA};

use crate::backend::{alloc, GpuBackend};
use crate::driver::{DeviceMemory, Driver, LaunchShape};
use crate::error::{Error, Result};
use crate::plan::{barriers_per_step, prefill_chunks, trace_bytes};
use crate::stats::{
    bench_positions, median, percentile, prefill_flops, BenchOptions, BenchReport, LaunchOverhead,
    PrefillReport, KV_FILL_BF16, PROFILE_VARIANTS,
};
use crate::trace::{StepTrace, Timeline};

/// The smallest streaming-read buffer the floor is measured with.
pub const MIN_STREAM_BYTES: u64 = 1 << 30;

impl<D: Driver> GpuBackend<D> {
    fn sync_stream(&mut self) -> Result<()> {
        let r = self.driver.stream_synchronize(&self.stream);
        r.map_err(|c| self.fail("cuStreamSynchronize", c))
    }

    /// One empty step: the real parameter block and grid at a position past
    /// the KV capacity, so every CTA returns at once.
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
            dev.push(self.elapsed_ms(&w[0], &w[1])? * 1e3);
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
                    "{n} steps from position {start} must be >= 1, start at or before {} and fit \
                     the {}-position KV cache",
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
        let deadline = self.deadline_of(n);
        self.wait(&b, deadline)?;
        self.next_pos = start + n;
        let ms = self.elapsed_ms(&a, &b)?;
        Ok(Duration::from_secs_f64(ms * 1e-3))
    }

    /// Streaming-read bandwidth in GB/s (1e9 B/s): median of `reps` reads of
    /// a `bytes` buffer filled with a non-zero pattern. Where the weights
    /// leave less free memory than that (72B on a 141 GB GPU), the buffer
    /// shrinks to what is free, down to [`MIN_STREAM_BYTES`] (still far
    /// larger than any L2, so the read streams from memory).
    pub fn stream_bandwidth(&mut self, bytes: u64, reps: usize) -> Result<f64> {
        self.usable()?;
        let free = self.driver.mem_info();
        let free = free.map_err(|c| self.fail("cuMemGetInfo", c))?.0;
        let room = free.saturating_sub(256 << 20) & !((256 << 20) - 1);
        let bytes = if bytes > room && room >= MIN_STREAM_BYTES {
            room
        } else {
            bytes & !15
        };
        if bytes + (256 << 20) > free {
            return Err(Error::OutOfMemory {
                what: "the streaming-read buffer".into(),
                needed: bytes,
                available: free,
            });
        }
        let buf = alloc(&self.driver, bytes, "stream buffer", false)?;
        // SAFETY: buf holds `bytes` bytes. Never time zeros: 0xA5 pattern.
        // Synchronise: the legacy-stream memset is not ordered before our
        // non-blocking stream.
        let r = unsafe { self.driver.memset_d8(buf.addr(), 0xA5, bytes as usize) }
            .and_then(|()| self.driver.synchronize());
        r.map_err(|c| self.fail("cuMemsetD8 (stream buffer)", c))?;
        let occ = self
            .driver
            .occupancy(self.funcs.stream_read, THREADS_PER_CTA, 0);
        let occ = occ.map_err(|c| self.fail("cuOccupancyMaxActiveBlocksPerMultiprocessor", c))?;
        let grid = occ.max(1) as u32 * self.info.sms;
        let out = alloc(&self.driver, u64::from(grid) * 4, "stream checksums", true)?;
        let mut p = StreamParams {
            src: buf.addr(),
            n_vec16: bytes / 16,
            out: out.addr(),
        };
        let evs = (0..=reps + 1)
            .map(|_| self.new_event())
            .collect::<Result<Vec<_>>>()?;
        self.record(&evs[0])?;
        for ev in &evs[1..] {
            let args = (&mut p as *mut StreamParams).cast::<c_void>();
            // SAFETY: one StreamParams by value; the buffers live until the
            // wait below.
            let r = unsafe {
                self.driver.launch(
                    self.funcs.stream_read,
                    LaunchShape::plain(grid),
                    &self.stream,
                    args,
                )
            };
            r.map_err(|c| self.fail("cuLaunchKernel (stream read)", c))?;
            self.record(ev)?;
        }
        let last = evs.last().expect("reps + 2 events");
        self.wait(last, Duration::from_secs(60))?;
        // The first launch is a warm-up.
        let mut times = Vec::with_capacity(reps);
        for w in evs[1..].windows(2) {
            times.push(self.elapsed_ms(&w[0], &w[1])?);
        }
        let ms = median(&mut times);
        Ok(bytes as f64 / (ms * 1e-3) / 1e9)
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
            let r = unsafe { self.driver.memset_d16(cache, KV_FILL_BF16, n) }
                .and_then(|()| self.driver.synchronize());
            r.map_err(|c| self.fail("cuMemsetD16 (KV cache)", c))?;
        }
        Ok(())
    }

    /// The positions of a bench run ([`bench_positions`]), checked against
    /// the KV capacity; resets the engine and fills the KV cache when they
    /// do not start at 0.
    fn start_bench(&mut self, opts: &BenchOptions) -> Result<(usize, usize)> {
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
        Ok((first, total))
    }

    /// The timeline the last traced step wrote.
    fn read_trace(&mut self) -> Result<StepTrace> {
        let grid = self.launch.grid;
        let words = trace_bytes(&self.config, grid)? / 8;
        let mut raw = vec![0u64; words as usize];
        // SAFETY: the trace buffer holds trace_bytes at params.trace; no
        // step is running.
        let r = unsafe {
            self.driver
                .dtoh(bytemuck::cast_slice_mut(&mut raw), self.params.trace)
        };
        r.map_err(|c| self.fail("cuMemcpyDtoH (trace)", c))?;
        let barriers = u32::try_from(barriers_per_step(&self.config))
            .map_err(|_| Error::Overflow("the barriers per step".into()))?;
        let layers = u32::try_from(self.config.num_hidden_layers)
            .map_err(|_| Error::Overflow("the layers".into()))?;
        StepTrace::from_raw(grid, barriers, layers, raw)
    }

    /// One decode step with the timeline on ([`FLAG_TRACE`]): the same pick,
    /// logits and KV cache as a plain step, and the step's stamps.
    pub fn step_traced(&mut self, token: u32, pos: usize) -> Result<(StepOutput, StepTrace)> {
        self.usable()?;
        self.check_inputs(token, pos)?;
        let ev = self.new_event()?;
        self.launch_step(token, pos, FLAG_TRACE)?;
        self.record(&ev)?;
        self.wait(&ev, self.opts.step_deadline)?;
        self.next_pos = pos + 1;
        let trace = self.read_trace()?;
        let out = StepOutput {
            argmax: self.last_argmax,
        };
        Ok((out, trace))
    }

    /// Where a step's time goes (`bench --profile`): greedy steps at the
    /// positions of [`bench_positions`], one launch and wait each, the timed
    /// ones traced ([`Timeline`]). Resets the engine before and after.
    pub fn bench_timeline(&mut self, opts: &BenchOptions) -> Result<Timeline> {
        let (first, total) = self.start_bench(opts)?;
        let mut traces = Vec::with_capacity(opts.steps);
        for i in 0..total {
            let mut flags = opts.flags | FLAG_TRACE;
            if i > 0 {
                flags |= FLAG_TOKEN_FROM_ARGMAX;
            }
            let ev = self.new_event()?;
            self.launch_step(opts.first_token, first + i, flags)?;
            self.record(&ev)?;
            self.wait(&ev, self.opts.step_deadline)?;
            if i >= opts.warmup {
                traces.push(self.read_trace()?);
            }
        }
        self.reset()?;
        Timeline::from_traces(&traces)
    }

    /// Per-step times (us) of the timed steps of one back-to-back run at
    /// the positions of [`bench_positions`] (KV filled first when they do
    /// not start at 0). `greedy`: the kernel feeds its own pick forward;
    /// else the token is fixed (profiling variants compute garbage, whose
    /// argmax may be no token at all).
    fn time_steps(
        &mut self,
        opts: &BenchOptions,
        extra_flags: u32,
        greedy: bool,
    ) -> Result<Vec<f64>> {
        let (first, total) = self.start_bench(opts)?;
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
        let deadline = self.deadline_of(total);
        self.wait(&evs[total], deadline)?;
        let mut us = Vec::with_capacity(opts.steps);
        for i in opts.warmup..total {
            us.push(self.elapsed_ms(&evs[i], &evs[i + 1])? * 1e3);
        }
        Ok(us)
    }

    /// Where the time goes: every variant of [`PROFILE_VARIANTS`] (the full
    /// kernel, barriers only, each phase skipped with every barrier kept,
    /// the attention A/B flags) timed at the same positions, median
    /// us/step. Resets the engine after.
    pub fn bench_profile(&mut self, opts: &BenchOptions) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        for &(name, flags) in PROFILE_VARIANTS {
            let mut t = self.time_steps(opts, flags, false)?;
            out.push((name.to_string(), median(&mut t)));
        }
        self.reset()?;
        Ok(out)
    }

    /// The positions and the largest T of a multi-token bench: `(first,
    /// max)`, checked against the KV capacity (see [`Self::start_bench`]).
    fn start_multi_bench(&mut self, opts: &BenchOptions) -> Result<(usize, usize)> {
        let (first, _) = self.start_bench(opts)?;
        let max = self.multi_max_tokens().max(1);
        if first + max > self.capacity {
            return Err(Error::Option {
                field: "context",
                reason: format!("{max} positions from {first} do not fit the KV cache"),
            });
        }
        Ok((first, max))
    }

    /// Queues one launch of a multi-token bench: `tokens` at positions
    /// `first..`, the one-token step when there is one token; `opts.flags`
    /// (`--kernel-flags`: the attention path, the debug hooks) and `extra`
    /// on either, so both sides of the cost ratio run the same variant.
    fn launch_multi_bench(
        &mut self,
        tokens: &[u32],
        first: usize,
        opts: &BenchOptions,
        extra: u32,
    ) -> Result<()> {
        match tokens {
            [token] => self.launch_step(*token, first, opts.flags | extra),
            _ => self.launch_multi(tokens, first, opts.flags | extra),
        }
    }

    /// What one launch of the multi-token step costs for each T = 1 ..=
    /// [`GpuBackend::multi_max_tokens`] (T = 1: the one-token step): at the
    /// positions of `opts` (KV filled first when they do not start at 0),
    /// `warmup + steps` launches of each T back to back, each rewriting
    /// positions `first..first + T` with `opts.first_token`, timed per
    /// launch with events; median us per launch, by T.
    pub fn bench_multi(&mut self, opts: &BenchOptions) -> Result<Vec<(usize, f64)>> {
        let (first, max) = self.start_multi_bench(opts)?;
        let total = opts.warmup + opts.steps;
        let mut out = Vec::with_capacity(max);
        for t in 1..=max {
            let tokens = vec![opts.first_token; t];
            let evs = (0..=total)
                .map(|_| self.new_event())
                .collect::<Result<Vec<_>>>()?;
            self.record(&evs[0])?;
            for i in 0..total {
                self.launch_multi_bench(&tokens, first, opts, 0)?;
                self.record(&evs[i + 1])?;
            }
            self.wait(&evs[total], self.deadline_of(total * t))?;
            let mut us = Vec::with_capacity(opts.steps);
            for i in opts.warmup..total {
                us.push(self.elapsed_ms(&evs[i], &evs[i + 1])? * 1e3);
            }
            out.push((t, median(&mut us)));
        }
        self.reset()?;
        Ok(out)
    }

    /// Where a multi-token launch's time goes (`bench --multi-tokens
    /// --profile`), for each T = 1 ..= [`GpuBackend::multi_max_tokens`]:
    /// the launches of [`Self::bench_multi`] at the same positions, with
    /// the timeline on ([`FLAG_TRACE`]), one launch and wait each, the
    /// timed ones traced ([`Timeline`]; the multi-token step has the
    /// one-token step's barriers and trace layout). Resets the engine after.
    pub fn bench_multi_timeline(&mut self, opts: &BenchOptions) -> Result<Vec<(usize, Timeline)>> {
        let (first, max) = self.start_multi_bench(opts)?;
        let total = opts.warmup + opts.steps;
        let mut out = Vec::with_capacity(max);
        for t in 1..=max {
            let tokens = vec![opts.first_token; t];
            let mut traces = Vec::with_capacity(opts.steps);
            for i in 0..total {
                let ev = self.new_event()?;
                self.launch_multi_bench(&tokens, first, opts, FLAG_TRACE)?;
                self.record(&ev)?;
                self.wait(&ev, self.deadline_of(t))?;
                // Every launch rewrites the same stamps: read each before
                // the next.
                if i >= opts.warmup {
                    traces.push(self.read_trace()?);
                }
            }
            out.push((t, Timeline::from_traces(&traces)?));
        }
        self.reset()?;
        Ok(out)
    }

    /// Greedy decode of `warmup + steps` positions back to back (the kernel
    /// feeds its own pick to the next step on the device), timed per step
    /// with events, then the floor. Resets the engine before and after.
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

    /// Time to first token of the tensor-core prefill (needs
    /// [`crate::Options::prefill_chunk`]): `reps` + 1 prefills of `tokens`
    /// at position 0 (the first untimed), each timed with device events
    /// around its chunk launches (the ids are uploaded once, before).
    /// Resets the engine before each and after.
    pub fn bench_prefill(&mut self, tokens: &[u32], reps: usize) -> Result<PrefillReport> {
        let Some((launch, chunk)) = self.prefill_launch() else {
            return Err(Error::Option {
                field: "prefill_chunk",
                reason: "bench_prefill needs the prefill kernel enabled".into(),
            });
        };
        if tokens.is_empty() || tokens.len() > self.capacity {
            return Err(Error::Option {
                field: "prefill",
                reason: format!(
                    "{} prompt tokens must be >= 1 and fit the {}-position KV cache",
                    tokens.len(),
                    self.capacity
                ),
            });
        }
        // Untimed first run through the kernel whatever the prompt length:
        // uploads the ids, checks the inputs and warms up.
        let min_tokens = self.opts.prefill_min_tokens;
        self.opts.prefill_min_tokens = 1;
        self.reset()?;
        let first = self.prefill(tokens, 0);
        self.opts.prefill_min_tokens = min_tokens;
        first?;
        let chunks = prefill_chunks(0, tokens.len(), chunk);
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            self.reset()?;
            let (a, b) = (self.new_event()?, self.new_event()?);
            self.record(&a)?;
            for &(s, len) in &chunks {
                self.launch_prefill(s, len)?;
            }
            self.record(&b)?;
            let deadline = self.deadline_of(chunks.len());
            self.wait(&b, deadline)?;
            ms.push(self.elapsed_ms(&a, &b)?);
        }
        let barriers = self.barriers_last_step()?;
        self.reset()?;
        let med = median(&mut ms);
        Ok(PrefillReport {
            device: format!("{} ({})", self.info.name, self.info.arch),
            tokens: tokens.len(),
            chunk,
            launches: chunks.len(),
            ms_median: med,
            ms_p10: percentile(&ms, 0.1),
            ms_p90: percentile(&ms, 0.9),
            reps: ms.len(),
            tflops: prefill_flops(&self.config, 0, tokens.len()) / (med * 1e-3) / 1e12,
            grid: launch.grid,
            registers: launch.registers,
            smem_bytes: launch.smem_bytes,
            barriers_per_launch: barriers,
        })
    }
}
