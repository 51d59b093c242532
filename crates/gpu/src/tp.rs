//! Tensor parallelism: one model over the GPUs of one host, one megakernel
//! launch per GPU per step.
//!
//! Each rank is a [`GpuBackend`] built for its shard of the model
//! ([`KernelBuild::for_rank`]: its heads, KV heads, MLP slice and
//! vocabulary rows; the embedding table whole). The ranks exchange partial
//! sums and argmax picks inside their steps through an exchange region in
//! each rank's device memory, mapped into every peer (peer access between
//! GPUs; one context when the ranks share a GPU). The kernel side is
//! `kernels/cuda/decode/tp.cuh`; the region's layout is
//! [`qmk_kernels::TpRegion`].
//!
//! Ranks are one per GPU, or co-resident on one GPU (each grid on its share
//! of the SMs): the same protocol, bounded waits and rank-ordered sums, run
//! on a one-GPU machine.

use std::collections::HashMap;
use std::time::Duration;

use qmk_engine::{Backend, BackendKind, StepOutput};
use qmk_kernels::params::err;
use qmk_kernels::{KernelBuild, TpRegion, FLAG_TOKEN_FROM_ARGMAX, TP_MAX_RANKS};
use qmk_layout::{ShardRule, ShardedTensor};
use qmk_model::tensor_parallel::{check_ranks, rank_config, tp_plan};
use qmk_model::Config;

use crate::backend::{alloc, GpuBackend, RankSetup};
use crate::driver::{device_count, device_info, DeviceMemory, Driver};
use crate::error::{Error, Result};
use crate::options::{Options, Progress};
use crate::staging::{PlannedChunk, WeightSource};

/// How the ranks of a tensor-parallel group are placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpOptions {
    /// Ranks in the group (2 ..= 8; the model's KV heads, intermediate size
    /// and vocabulary must divide among them).
    pub ranks: usize,
    /// The CUDA device of each rank, in rank order; empty: devices 0 ..
    /// ranks - 1. Ignored when co-resident.
    pub devices: Vec<usize>,
    /// Every rank on [`Options::device`], each grid on its share of the
    /// SMs: checks the group on a machine with one GPU (the exchanges then
    /// stay in that GPU's memory).
    pub co_resident: bool,
}

impl TpOptions {
    /// `ranks` ranks on devices 0 .. ranks - 1.
    pub fn new(ranks: usize) -> TpOptions {
        TpOptions {
            ranks,
            devices: Vec::new(),
            co_resident: false,
        }
    }
}

/// One rank's shards of a whole model's weights, read from the whole
/// model's [`WeightSource`] (a split tensor's shard is, per index before
/// its cut axis, one contiguous run of the whole tensor).
pub struct RankSource<'a> {
    whole: &'a dyn WeightSource,
    config: Config,
    tensors: HashMap<String, ShardedTensor>,
    rank: usize,
}

impl<'a> RankSource<'a> {
    /// Rank `rank` of `ranks` of the model `whole` holds.
    pub fn new(whole: &'a dyn WeightSource, ranks: usize, rank: usize) -> Result<Self> {
        let plan = tp_plan(whole.config(), ranks)?;
        if rank >= ranks {
            return Err(Error::Option {
                field: "rank",
                reason: format!("rank {rank} of a group of {ranks}"),
            });
        }
        Ok(RankSource {
            whole,
            config: rank_config(whole.config(), ranks),
            tensors: plan
                .tensors
                .into_iter()
                .map(|t| (t.spec.name.clone(), t))
                .collect(),
            rank,
        })
    }
}

impl WeightSource for RankSource<'_> {
    fn config(&self) -> &Config {
        &self.config
    }

    fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
        let bad = |reason: String| Error::Weights {
            tensor: chunk.tensor.clone(),
            reason,
        };
        let t = self
            .tensors
            .get(&chunk.tensor)
            .ok_or_else(|| bad("not in the tensor-parallel plan".into()))?;
        let whole_bytes = t.spec.byte_span()?.0;
        // The whole tensor as one chunk of the whole model's source.
        let whole = PlannedChunk {
            tensor: chunk.tensor.clone(),
            chunk: 0,
            offset: 0,
            bytes: whole_bytes,
            tensor_bytes: whole_bytes,
            // Sources give row-major bytes.
            tile: None,
        };
        let start = chunk
            .offset
            .checked_add(offset)
            .filter(|s| s % 2 == 0 && dst.len() % 2 == 0)
            .ok_or_else(|| {
                bad(format!(
                    "bytes {offset}.. of chunk {} are not whole elements",
                    chunk.chunk
                ))
            })?;
        let ShardRule::Split { axis, .. } = t.rule else {
            return self.whole.read(&whole, start, dst);
        };
        let shard = &t.shards[self.rank];
        let (s, w) = (shard.spec.layout.shape(), t.spec.layout.shape());
        let inner: u64 = s[axis + 1..].iter().product();
        let run_len = s[axis] * inner; // elements of one run in the shard
        let (skip, stride) = (shard.range.start * inner, w[axis] * inner);
        let mut e = start / 2;
        let mut out = dst;
        while !out.is_empty() {
            let (outer, within) = (e / run_len, e % run_len);
            let n = (run_len - within).min(out.len() as u64 / 2);
            let at = outer
                .checked_mul(stride)
                .and_then(|b| b.checked_add(skip + within))
                .and_then(|x| x.checked_mul(2))
                .ok_or_else(|| Error::Overflow(format!("{}: a shard offset", chunk.tensor)))?;
            let (head, tail) = out.split_at_mut(n as usize * 2);
            self.whole.read(&whole, at, head)?;
            out = tail;
            e += n;
        }
        Ok(())
    }
}

/// A Qwen2.5 model split over the ranks of a tensor-parallel group, one
/// megakernel launch per rank per step; implements [`Backend`] like the
/// one-GPU engine (greedy picks, whole-vocabulary logits, bounded waits,
/// sticky errors). Prompts run as decode steps queued back to back (a rank
/// has no prefill kernel), and there is no multi-token step.
pub struct TpBackend<D: Driver> {
    config: Config,
    /// Dropped before the ranks (whose contexts they live in).
    regions: Vec<D::Memory>,
    ranks: Vec<GpuBackend<D>>,
    region: TpRegion,
    capacity: usize,
    next_pos: usize,
    /// Epoch before the next step's first exchange.
    epoch: u32,
    /// Exchanges per step: two per layer and the argmax.
    per_step: u32,
    co_resident: bool,
    dead: Option<String>,
    needs_reset: Option<String>,
    last_argmax: u32,
    debug_flags: Vec<u32>,
}

// SAFETY: as for GpuBackend: every entry point binds the rank's context on
// the calling thread before using it, and `&mut self` serialises all use.
unsafe impl<D: Driver> Send for TpBackend<D> {}

impl<D: Driver> TpBackend<D> {
    /// Splits the model `source` holds over `tp.ranks` ranks, uploads each
    /// rank's shards, compiles (once; the ranks share the cubin) and maps
    /// the exchange regions. `opts` applies to every rank (its `device`
    /// only when co-resident). Refuses, naming what is missing: a group the
    /// model cannot be split into, fewer devices than ranks, devices that
    /// cannot map each other's memory.
    pub fn new(
        source: &dyn WeightSource,
        opts: Options,
        tp: &TpOptions,
        progress: &mut dyn Progress,
    ) -> Result<Self> {
        let config = source.config().clone();
        let n = tp.ranks;
        if !(2..=TP_MAX_RANKS).contains(&n) {
            return Err(Error::Option {
                field: "tp",
                reason: format!("{n} ranks: tensor parallelism takes 2 ..= {TP_MAX_RANKS}"),
            });
        }
        check_ranks(&config, n)?;
        let devices = rank_devices::<D>(&opts, tp)?;
        // Co-resident ranks divide the GPU's SMs and its free memory.
        let mut held = None;
        let (sms, free_share) = if tp.co_resident {
            let all = device_info::<D>(opts.device)?.sms;
            let d = D::open(opts.device).map_err(Error::at("cuDevicePrimaryCtxRetain"))?;
            let free = d.mem_info().map_err(Error::at("cuMemGetInfo"))?.0;
            held = Some(d);
            let share = all / n as u32;
            if share == 0 {
                return Err(Error::Option {
                    field: "tp",
                    reason: format!("{n} co-resident ranks on a GPU of {all} SMs"),
                });
            }
            (Some(share), Some(free / n as u64))
        } else {
            (None, None)
        };
        let build = KernelBuild::for_rank(&config, n)?;
        let region = TpRegion::new(config.hidden_size as u64)?;
        let mut ranks: Vec<GpuBackend<D>> = Vec::with_capacity(n);
        for (rank, &device) in devices.iter().enumerate() {
            progress.step(&format!(
                "tensor-parallel rank {rank} of {n} (GPU {device})"
            ));
            let src = RankSource::new(source, n, rank)?;
            let setup = RankSetup {
                build: build.clone(),
                rank,
                sms,
                free_share,
            };
            let o = Options {
                device,
                ..opts.clone()
            };
            ranks.push(GpuBackend::open(&src, o, progress, Some(setup))?);
        }
        drop(held);
        // Every rank maps every other rank's memory (one context per GPU;
        // co-resident ranks share theirs).
        if !tp.co_resident {
            for i in 0..n {
                for j in 0..n {
                    if i != j {
                        ranks[i]
                            .driver
                            .enable_peer_access(&ranks[j].driver)
                            .map_err(Error::at("cuCtxEnablePeerAccess"))?;
                    }
                }
            }
        }
        let mut regions = Vec::with_capacity(n);
        for r in &ranks {
            r.bind()?;
            regions.push(alloc(
                &r.driver,
                region.bytes,
                "tensor-parallel exchange region",
                true,
            )?);
        }
        let addrs: Vec<u64> = regions.iter().map(|m| m.addr()).collect();
        for r in &mut ranks {
            r.params.tp_peer = [0; TP_MAX_RANKS];
            r.params.tp_peer[..n].copy_from_slice(&addrs);
        }
        let capacity = ranks.iter().map(|r| r.capacity).min().unwrap_or(0);
        let per_step = u32::try_from(config.num_hidden_layers)
            .ok()
            .and_then(|l| l.checked_mul(2))
            .and_then(|x| x.checked_add(1))
            .ok_or_else(|| Error::Overflow("exchanges per step".into()))?;
        Ok(TpBackend {
            config,
            regions,
            ranks,
            region,
            capacity,
            next_pos: 0,
            epoch: 0,
            per_step,
            co_resident: tp.co_resident,
            dead: None,
            needs_reset: None,
            last_argmax: 0,
            debug_flags: vec![0; n],
        })
    }

    /// The whole model.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The ranks, in rank order (device, launch shape, build per rank).
    pub fn ranks(&self) -> &[GpuBackend<D>] {
        &self.ranks
    }

    /// Whether the ranks share one GPU.
    pub fn co_resident(&self) -> bool {
        self.co_resident
    }

    /// Bytes of each rank's exchange region.
    pub fn region_bytes(&self) -> u64 {
        self.region.bytes
    }

    /// Sets or clears kernel flag bits on one rank (test hooks, such as
    /// [`qmk_kernels::FLAG_DEBUG_TP_STOP`]).
    pub fn set_rank_flags(&mut self, rank: usize, mask: u32, on: bool) {
        if let Some(f) = self.debug_flags.get_mut(rank) {
            if on {
                *f |= mask;
            } else {
                *f &= !mask;
            }
        }
    }

    /// Every rank's spin-wait budget.
    pub fn set_spin_timeout(&mut self, t: Duration) {
        self.ranks.iter_mut().for_each(|r| r.set_spin_timeout(t));
    }

    /// Every rank's host deadline per step.
    pub fn set_step_deadline(&mut self, t: Duration) {
        self.ranks.iter_mut().for_each(|r| r.set_step_deadline(t));
    }

    /// `n` greedy steps from position `start` queued back to back on every
    /// rank (each rank reads the group's pick of the step before from its
    /// own memory: no host round trip), one wait; returns the device time
    /// on rank 0's stream between events around its launches.
    pub fn timed_steps(&mut self, first_token: u32, start: usize, n: usize) -> Result<Duration> {
        self.usable()?;
        if n == 0 {
            return Err(Error::Option {
                field: "steps",
                reason: "must be at least 1".into(),
            });
        }
        let tokens = vec![first_token; n];
        self.check(&tokens, start)?;
        self.ranks[0].bind()?;
        let a = self.ranks[0].new_event()?;
        self.ranks[0].record(&a)?;
        let mut events = Vec::with_capacity(self.ranks.len());
        let launched = self.launch_all(&tokens, start, true, &mut events);
        let waited = self.wait_all(&events, n);
        launched.and(waited)?;
        self.next_pos = start + n;
        self.ranks[0].bind()?;
        let ms = self.ranks[0].elapsed_ms(&a, &events[0])?;
        Ok(Duration::from_secs_f64(ms * 1e-3))
    }

    /// Rank 0's GPU's streaming-read bandwidth, GB/s
    /// ([`GpuBackend::stream_bandwidth`]).
    pub fn stream_bandwidth(&mut self, bytes: u64, reps: usize) -> Result<f64> {
        self.usable()?;
        self.ranks[0].stream_bandwidth(bytes, reps)
    }

    fn usable(&self) -> Result<()> {
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        if let Some(r) = &self.needs_reset {
            return Err(Error::NeedsReset(r.clone()));
        }
        Ok(())
    }

    fn check(&self, tokens: &[u32], start: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Position {
                pos: start,
                reason: "no tokens".into(),
            });
        }
        if let Some(&token) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(Error::Token {
                token,
                vocab: self.config.vocab_size,
            });
        }
        if start > self.next_pos {
            return Err(Error::Position {
                pos: start,
                reason: format!("positions must be fed in order; next is {}", self.next_pos),
            });
        }
        if start.saturating_add(tokens.len()) > self.capacity {
            return Err(Error::Position {
                pos: start + tokens.len() - 1,
                reason: format!("the KV cache holds {} positions", self.capacity),
            });
        }
        Ok(())
    }

    /// Queues `tokens` at `start..` on every rank, then waits for all of
    /// them: the ranks' kernels must run at the same time, so nothing waits
    /// before every launch is queued.
    fn run(&mut self, tokens: &[u32], start: usize) -> Result<u32> {
        self.usable()?;
        self.check(tokens, start)?;
        let mut events = Vec::with_capacity(self.ranks.len());
        let launched = self.launch_all(tokens, start, false, &mut events);
        // Whatever was queued is waited for (bounded) before returning.
        let waited = self.wait_all(&events, tokens.len());
        launched.and(waited)?;
        self.next_pos = start + tokens.len();
        Ok(self.last_argmax)
    }

    /// Queues `tokens` at `start..` on every rank (with `from_argmax`, every
    /// step after the first reads its token from the step before on the
    /// device), then records an event per rank into `events`.
    fn launch_all(
        &mut self,
        tokens: &[u32],
        start: usize,
        from_argmax: bool,
        events: &mut Vec<D::Event>,
    ) -> Result<()> {
        for (i, &t) in tokens.iter().enumerate() {
            let epoch = self.epoch;
            let fed = if from_argmax && i > 0 {
                FLAG_TOKEN_FROM_ARGMAX
            } else {
                0
            };
            for (r, flags) in self.ranks.iter_mut().zip(&self.debug_flags) {
                // Each rank's context current for its own launch (one per
                // GPU; co-resident ranks share one).
                r.usable()?;
                r.params.tp_epoch = epoch;
                r.launch_step(t, start + i, fed | *flags)?;
            }
            self.epoch = self.epoch.wrapping_add(self.per_step);
        }
        for r in &mut self.ranks {
            r.bind()?;
            let ev = r.new_event()?;
            r.record(&ev)?;
            events.push(ev);
        }
        Ok(())
    }

    /// Waits for every rank's queued steps. After the first failure the
    /// others are told to stop (their abort flags); the error reported is
    /// the root cause where there is one (a rank's own failure rather than
    /// a peer's failure or an abort it caused), named by rank.
    fn wait_all(&mut self, events: &[D::Event], steps: usize) -> Result<()> {
        let mut errors: Vec<(usize, Error)> = Vec::new();
        for (i, ev) in events.iter().enumerate() {
            let deadline = self.ranks[i].deadline_of(steps);
            let waited = self.ranks[i]
                .bind()
                .and_then(|()| self.ranks[i].wait(ev, deadline));
            if let Err(e) = waited {
                if errors.is_empty() {
                    for (j, r) in self.ranks.iter().enumerate() {
                        if j != i {
                            let _ = r.bind();
                            let _ = r.status.set_abort(&r.driver, 1);
                        }
                    }
                }
                errors.push((i, e));
            }
        }
        if errors.is_empty() && events.len() == self.ranks.len() {
            let picks: Vec<u32> = self.ranks.iter().map(|r| r.last_argmax).collect();
            if picks.iter().any(|&p| p != picks[0]) {
                let reason = format!("the ranks picked different tokens: {picks:?}");
                self.needs_reset = Some(reason.clone());
                return Err(Error::Rank {
                    rank: 0,
                    source: Box::new(Error::NeedsReset(reason)),
                });
            }
            self.last_argmax = picks[0];
            return Ok(());
        }
        for r in &self.ranks {
            let _ = r.bind();
            let _ = r.status.set_abort(&r.driver, 0);
        }
        let consequence = |e: &Error| {
            matches!(e, Error::Kernel { code, .. }
                if *code == err::TP_PEER_FAILED || *code == err::ABORTED)
        };
        let pick = errors
            .iter()
            .position(|(_, e)| !consequence(e))
            .unwrap_or(0);
        let Some((rank, e)) = errors.into_iter().nth(pick) else {
            // A launch failed before any event was recorded.
            self.needs_reset = Some("a launch failed".into());
            return Ok(());
        };
        if let Error::Unusable { reason } = &e {
            let reason = format!("rank {rank}: {reason}");
            self.dead = Some(reason.clone());
            return Err(Error::Unusable { reason });
        }
        self.needs_reset = Some(format!("rank {rank}: {e}"));
        Err(Error::Rank {
            rank,
            source: Box::new(e),
        })
    }
}

/// The device of each rank, checked: present, distinct, and able to map
/// one another's memory.
fn rank_devices<D: Driver>(opts: &Options, tp: &TpOptions) -> Result<Vec<usize>> {
    let n = tp.ranks;
    if tp.co_resident {
        device_info::<D>(opts.device)?;
        return Ok(vec![opts.device; n]);
    }
    let devices: Vec<usize> = if tp.devices.is_empty() {
        (0..n).collect()
    } else {
        tp.devices.clone()
    };
    let count = device_count::<D>()?;
    if devices.len() != n {
        return Err(Error::Option {
            field: "tp devices",
            reason: format!("{} devices given for {n} ranks", devices.len()),
        });
    }
    if count < n {
        return Err(Error::Devices {
            wanted: n,
            found: count,
        });
    }
    for (i, &d) in devices.iter().enumerate() {
        if d >= count {
            return Err(Error::DeviceIndex { index: d, count });
        }
        if devices[..i].contains(&d) {
            return Err(Error::Option {
                field: "tp devices",
                reason: format!(
                    "device {d} is given twice (one rank per GPU; co-resident ranks share one)"
                ),
            });
        }
    }
    for &a in &devices {
        for &b in &devices {
            if a != b && !D::can_access_peer(a, b).map_err(Error::at("cuDeviceCanAccessPeer"))? {
                return Err(Error::Option {
                    field: "tp devices",
                    reason: format!("GPU {a} cannot map GPU {b}'s memory (no peer access)"),
                });
            }
        }
    }
    Ok(devices)
}

impl<D: Driver> Backend for TpBackend<D> {
    type Error = Error;

    fn kind(&self) -> BackendKind {
        D::KIND
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput> {
        let argmax = self.run(&[token], pos)?;
        Ok(StepOutput { argmax })
    }

    /// Decode steps for the whole prompt on every rank, queued back to back
    /// with one wait.
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput> {
        let argmax = self.run(tokens, start)?;
        Ok(StepOutput { argmax })
    }

    /// The whole vocabulary's logits: each rank's rows in rank order.
    fn logits(&mut self) -> Result<Vec<f32>> {
        self.usable()?;
        let mut out = Vec::with_capacity(self.config.vocab_size);
        for r in &mut self.ranks {
            out.extend(r.logits()?);
        }
        Ok(out)
    }

    fn reset(&mut self) -> Result<()> {
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        for r in &mut self.ranks {
            r.reset()?;
        }
        // Every kernel has stopped: the flags, failure marks and picks
        // start over, and so do the epochs.
        for (r, m) in self.ranks.iter().zip(&self.regions) {
            r.bind()?;
            // SAFETY: m holds region.bytes bytes; the ranks are idle.
            unsafe { r.driver.memset_d8(m.addr(), 0, m.bytes()) }
                .and_then(|()| r.driver.synchronize())
                .map_err(Error::at("cuMemsetD8 (exchange region)"))?;
        }
        self.epoch = 0;
        self.next_pos = 0;
        self.needs_reset = None;
        Ok(())
    }
}

impl<D: Driver> Drop for TpBackend<D> {
    fn drop(&mut self) {
        // Each region is freed with its own rank's context current.
        for (r, m) in self.ranks.iter().zip(self.regions.drain(..)) {
            let _ = r.bind();
            drop(m);
        }
    }
}

impl<D: Driver> std::fmt::Debug for TpBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpBackend")
            .field("model", &self.config.model_type)
            .field("ranks", &self.ranks.len())
            .field("co_resident", &self.co_resident)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qmk_model::{synthetic_weights, Weights};

    use crate::staging::tests::tiny;

    /// Every byte a rank's plan holds, read through RankSource, equals the
    /// same element of the whole tensor (the shard's coordinates mapped
    /// back), for every tensor, rank and chunk, read in odd pieces.
    #[test]
    fn rank_sources_read_exactly_their_shards() {
        for tied in [true, false] {
            let c = tiny(tied);
            assert_eq!(c.tie_word_embeddings, tied);
            let w: Weights = synthetic_weights(&c, 3);
            let plan = tp_plan(&c, 2).unwrap();
            for rank in 0..2 {
                let src = RankSource::new(&w, 2, rank).unwrap();
                assert_eq!(src.config().num_attention_heads, 2);
                for (t, rp) in plan.tensors.iter().zip(&plan.rank_plans[rank].tensors) {
                    let shard = &t.shards[rank];
                    let bytes = rp.spec.byte_span().unwrap().0;
                    let chunk = PlannedChunk {
                        tensor: t.spec.name.clone(),
                        chunk: 0,
                        offset: 0,
                        bytes,
                        tensor_bytes: bytes,
                        tile: None,
                    };
                    let mut got = vec![0u8; bytes as usize];
                    // Pieces of 6 bytes: runs split mid-row and across rows.
                    for (i, piece) in got.chunks_mut(6).enumerate() {
                        src.read(&chunk, i as u64 * 6, piece).unwrap();
                    }
                    let whole_elems = bytes_of(&w, &t.spec.name);
                    let got: &[u16] = bytemuck::cast_slice(&got);
                    for i in 0..got.len() as u64 {
                        // Every coordinate of the shard, and where the shard
                        // and the whole tensor store it.
                        let crd = shard.spec.layout.idx2crd(i).unwrap();
                        let at = shard.spec.layout.crd2idx(&crd).unwrap() as usize;
                        let mut wc = crd.clone();
                        if let ShardRule::Split { axis, .. } = t.rule {
                            wc[axis] += shard.range.start;
                        }
                        let wi = t.spec.layout.crd2idx(&wc).unwrap() as usize;
                        assert_eq!(
                            got[at], whole_elems[wi],
                            "{} rank {rank} at {crd:?}",
                            t.spec.name
                        );
                    }
                }
            }
        }
    }

    fn bytes_of(w: &Weights, name: &str) -> Vec<u16> {
        let kind = qmk_model::inventory::WeightKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .unwrap();
        w.get(kind).unwrap().iter().map(|b| b.to_bits()).collect()
    }

    #[test]
    fn rank_sources_refuse_a_rank_outside_the_group() {
        let w = synthetic_weights(&tiny(true), 3);
        assert!(RankSource::new(&w, 2, 2).is_err());
        // 2 KV heads among 4 ranks: named.
        let e = RankSource::new(&w, 4, 0).err().unwrap().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }
}
