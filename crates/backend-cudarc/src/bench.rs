//! The bandwidth floor and the decode benchmark (DESIGN.md section 4).
//!
//! Floor: bytes one step must move (every weight but the embedding table,
//! one embedding row, the KV cache read and write) over the bandwidth a
//! streaming-read kernel from the same cubin measures in the same run.

use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::{result, sys};
use qmk_engine::Backend;
use qmk_kernels::host::{
    bench_positions, median, percentile, prefill_chunks, prefill_flops, BenchOptions, BenchReport,
    PrefillReport, KV_FILL_BF16,
};
use qmk_kernels::{StreamParams, FLAG_TOKEN_FROM_ARGMAX, THREADS_PER_CTA};

use crate::backend::CudarcBackend;
use crate::error::{Error, Result};
use crate::mem::DeviceBuffer;

impl CudarcBackend {
    fn elapsed_ms(&mut self, a: sys::CUevent, b: sys::CUevent) -> Result<f64> {
        // SAFETY: both events recorded and complete.
        unsafe { result::event::elapsed(a, b) }
            .map(f64::from)
            .map_err(|e| self.fail("cuEventElapsedTime", e))
    }

    /// Streaming-read bandwidth in GB/s (1e9 B/s): median of `reps` reads of
    /// a `bytes` buffer filled with a non-zero pattern.
    pub fn stream_bandwidth(&mut self, bytes: u64, reps: usize) -> Result<f64> {
        self.usable()?;
        let bytes = bytes & !15;
        let (free, _) = result::mem_get_info().map_err(|e| self.fail("cuMemGetInfo", e))?;
        if bytes + (256 << 20) > free as u64 {
            return Err(Error::OutOfMemory {
                what: "the streaming-read buffer".into(),
                needed: bytes,
                available: free as u64,
            });
        }
        let buf = DeviceBuffer::alloc(bytes, "stream buffer")?;
        // SAFETY: buf holds `bytes` bytes. Never time zeros: 0xA5 pattern.
        unsafe { result::memset_d8_sync(buf.ptr, 0xA5, bytes as usize) }
            .and_then(|_| result::ctx::synchronize())
            .map_err(|e| self.fail("cuMemsetD8", e))?;
        // SAFETY: valid function handle.
        let occ = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                self.funcs.stream_read,
                THREADS_PER_CTA as i32,
                0,
            )
        }
        .map_err(|e| self.fail("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
        .max(1) as u32;
        let grid = occ * self.info.sms;
        let out = DeviceBuffer::zeroed(grid as u64 * 4, "stream checksums")?;
        let mut p = StreamParams {
            src: buf.ptr,
            n_vec16: bytes / 16,
            out: out.ptr,
        };
        let mut times = Vec::new();
        let evs = (0..=reps + 1)
            .map(|_| self.new_event())
            .collect::<Result<Vec<_>>>()?;
        self.record(evs[0])?;
        for (i, &ev) in evs.iter().enumerate().skip(1) {
            let mut args = [(&mut p as *mut StreamParams).cast::<c_void>()];
            // SAFETY: one StreamParams by value; buffers live until the end.
            unsafe {
                result::launch_kernel(
                    self.funcs.stream_read,
                    (grid, 1, 1),
                    (THREADS_PER_CTA, 1, 1),
                    0,
                    self.stream,
                    &mut args,
                )
            }
            .map_err(|e| self.fail("cuLaunchKernel (stream read)", e))?;
            self.record(ev)?;
            let _ = i;
        }
        let last = *evs.last().expect("reps + 2 events");
        let r = self.wait(last, Duration::from_secs(60));
        if r.is_ok() {
            // The first launch is a warm-up.
            for w in evs[1..].windows(2) {
                times.push(self.elapsed_ms(w[0], w[1])?);
            }
        }
        for ev in evs {
            // SAFETY: live events, no longer used.
            let _ = unsafe { result::event::destroy(ev) };
        }
        r?;
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
            unsafe { sys::cuMemsetD16_v2(cache, KV_FILL_BF16, n) }
                .result()
                .and_then(|_| result::ctx::synchronize())
                .map_err(|e| self.fail("cuMemsetD16 (KV cache)", e))?;
        }
        Ok(())
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
        let run = (|| -> Result<Vec<f64>> {
            self.record(evs[0])?;
            for i in 0..total {
                let mut flags = extra_flags | opts.flags;
                if greedy && i > 0 {
                    flags |= FLAG_TOKEN_FROM_ARGMAX;
                }
                self.launch_step(opts.first_token, first + i, flags)?;
                self.record(evs[i + 1])?;
            }
            let deadline = self.opts.step_deadline.saturating_mul(total as u32);
            self.wait(evs[total], deadline)?;
            let mut t = Vec::with_capacity(opts.steps);
            for i in opts.warmup..total {
                t.push(self.elapsed_ms(evs[i], evs[i + 1])? * 1e3);
            }
            Ok(t)
        })();
        for ev in evs {
            // SAFETY: live events, no longer used.
            let _ = unsafe { result::event::destroy(ev) };
        }
        run
    }

    /// Where the time goes: the median step time of the full kernel, of
    /// the barriers alone, and with each phase skipped (every barrier kept),
    /// plus the A/B variants of [`qmk_kernels::host::PROFILE_VARIANTS`], all
    /// at the same positions. Resets the engine after.
    pub fn bench_profile(&mut self, opts: &BenchOptions) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        for &(name, flags) in qmk_kernels::host::PROFILE_VARIANTS {
            let mut t = self.time_steps(opts, flags, false)?;
            out.push((name.to_string(), median(&mut t)));
        }
        self.reset()?;
        Ok(out)
    }

    /// Time to first token of the tensor-core prefill (needs
    /// `GpuOptions::prefill_chunk`): `reps` + 1 prefills of `tokens` at
    /// position 0 (the first untimed), each timed with device events
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
        // Untimed first run: uploads the ids, checks the inputs and warms up.
        self.reset()?;
        self.prefill(tokens, 0)?;
        let chunks = prefill_chunks(0, tokens.len(), chunk);
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            self.reset()?;
            let (a, b) = (self.new_event()?, self.new_event()?);
            let r = (|| -> Result<f64> {
                self.record(a)?;
                for &(s, len) in &chunks {
                    self.launch_prefill(s, len)?;
                }
                self.record(b)?;
                let deadline = self
                    .opts
                    .step_deadline
                    .saturating_mul(chunks.len().min(u32::MAX as usize) as u32);
                self.wait(b, deadline)?;
                self.elapsed_ms(a, b)
            })();
            for ev in [a, b] {
                // SAFETY: live events, no longer used.
                let _ = unsafe { result::event::destroy(ev) };
            }
            ms.push(r?);
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
}
