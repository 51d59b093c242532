//! `qwen-mk bench`: decode speed of the megakernel on synthetic weights at a
//! preset's full shapes, against the bandwidth floor measured in the same
//! run (`docs/performance.md`), or time to first token (`--prefill N`).
//! `--json` prints one JSON object per context (`--context 0,8192,32768`
//! runs each in the same process, one upload). Both drivers run the same
//! [`GpuBackend`]. Every report also gives the weight upload's rate, the
//! kernel compile time and the process's peak resident memory (VmHWM).
//! The weights are generated piece by piece into the upload's pinned
//! buffers, or read from a checkpoint directory (`--model`).
//!
//! `--prompts FILE` instead decodes a real model's prompts plainly and
//! with speculation (`--speculate`, `--draft-model`) and compares the two
//! ([`crate::spec_bench`]).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use qmk_gpu::stats::median;
use qmk_gpu::{
    BenchOptions, BenchReport, Driver, GpuBackend, LaunchInfo, Options, Progress, Timeline,
    UploadOptions, WeightSource,
};
use qmk_model::{CheckpointSource, Config, SyntheticSource};

use crate::common::{whole, BackendChoice, SpeculateArgs, SpeculateChoice, MAX_POSITIONS};
use crate::output::{eprint_line, print, usage};

/// Most values a list flag (`--context`, `--ab`) may hold.
const MAX_LIST: usize = 64;
/// Most timed or untimed steps of one bench (the per-step times are kept).
const MAX_STEPS: i64 = 1_000_000;
/// Most timed prefills, and most `--ab` rounds.
const MAX_REPS: i64 = 10_000;
/// Largest streaming-read buffer, GiB (more than any GPU holds).
const MAX_STREAM_GIB: i64 = 1024;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model shape: 0.5b, 1.5b, 3b, 7b, 14b, 32b, 72b (synthetic weights).
    #[arg(long, default_value = "7b")]
    preset: String,
    /// Read the weights from this checkpoint directory instead (config.json
    /// and safetensors; e.g. one written by `qwen-mk write-synthetic`).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Pinned staging buffers of the weight upload.
    #[arg(long, default_value_t = qmk_gpu::upload::DEFAULT_UPLOAD_BUFFERS)]
    upload_buffers: usize,
    /// MiB of each staging buffer.
    #[arg(long, default_value_t = qmk_gpu::upload::DEFAULT_UPLOAD_BUFFER_BYTES >> 20)]
    upload_buffer_mib: usize,
    /// GPU backend: cudarc, or cust (a build with `--features cust`).
    #[arg(long, default_value = "cudarc")]
    backend: String,
    /// Untimed steps (at most 1,000,000).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true,
          value_parser = whole::<usize>(0..=MAX_STEPS))]
    warmup: usize,
    /// Timed steps (median reported; at most 1,000,000).
    #[arg(long, default_value_t = 200, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_STEPS))]
    steps: usize,
    /// KV length(s) the timed steps run at, comma-separated, at most 64
    /// (0: positions from 0, the short-context bench). Positions below the
    /// run hold synthetic KV values; the floor counts the KV bytes read.
    #[arg(long, value_delimiter = ',', default_value = "0", allow_negative_numbers = true,
          value_parser = whole::<usize>(0..=MAX_POSITIONS))]
    context: Vec<usize>,
    /// Extra kernel flag bits for every timed step (A/B: 32 attention
    /// without the sequence split, 64 the split forced).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    kernel_flags: u32,
    /// Size of the streaming-read buffer for the floor, GiB (1 to 1024;
    /// shrunk to the free device memory, down to 1 GiB).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = whole::<u64>(1..=MAX_STREAM_GIB))]
    stream_gib: u64,
    /// Synthetic-weight seed.
    #[arg(long, default_value_t = 20261129, allow_negative_numbers = true)]
    seed: u64,
    /// Load this cubin instead of compiling with NVRTC.
    #[arg(long)]
    cubin: Option<std::path::PathBuf>,
    /// Cap CTAs per SM (default: the occupancy API's answer).
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<u32>(1..=64))]
    ctas_per_sm: Option<u32>,
    /// Run the weight phases on tensor cores (7B and up, sm_90;
    /// other models and GPUs are unchanged): the multi-token step then
    /// costs about a one-token step. Not yet validated on a GPU, so off
    /// by default; it changes the logits' bits.
    #[arg(long, conflicts_with = "tp")]
    tensor_cores: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = whole::<usize>(0..=i32::MAX as i64))]
    device: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Also time the kernel with each phase skipped and with barriers only
    /// (where the time goes), and the attention A/B flag variants; then
    /// trace the step's timeline (each CTA's start, barrier arrivals and
    /// releases, marks inside the split attention) and split it per op:
    /// critical path, mean CTA busy time, barriers, and the split
    /// attention's parts where it runs.
    #[arg(long)]
    profile: bool,
    /// Also time the multi-token step (the verify step of speculative
    /// decoding) for every T the device takes, at the same positions: us
    /// per launch and its cost in one-token steps; with --profile also its
    /// step timeline per T.
    #[arg(long)]
    multi_tokens: bool,
    /// Timed steps of each profile variant (median reported).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_STEPS))]
    profile_steps: usize,
    /// Time to first token instead of decode speed: prefill of N synthetic
    /// prompt tokens with the tensor-core prefill kernel.
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_POSITIONS))]
    prefill: Option<usize>,
    /// Positions per prefill launch (with --prefill; the same default as
    /// `generate`).
    #[arg(long, default_value_t = qmk_gpu::DEFAULT_PREFILL_CHUNK, allow_negative_numbers = true,
          value_parser = whole::<u32>(1..=MAX_POSITIONS))]
    prefill_chunk: u32,
    /// Timed prefills (median reported; with --prefill; at most 10,000).
    #[arg(long, default_value_t = 10, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_REPS))]
    prefill_reps: usize,
    /// With --prefill: A/B of kernel-flag variants (comma-separated, at most
    /// 64, each added to --kernel-flags; 0 is the default build), timed
    /// interleaved in --ab-rounds rounds in one process, so clock and power
    /// drift hits every variant alike.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    ab: Vec<u32>,
    /// Rounds of the --ab variants (at most 10,000).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_REPS))]
    ab_rounds: usize,
    /// Plain against speculative greedy decoding of --model (Hub id or
    /// directory) on the prompts of this file, one JSON object per line:
    /// {"name": ..., "messages": [{"role": "user", "content": ...}]} or
    /// {"name": ..., "prompt": raw text} (e.g. benches/prompts/code-edit.jsonl).
    /// Reports both decode rates, the acceptance and tokens per step, and
    /// fails when the outputs differ. --backend may be cpu here.
    #[arg(long, value_name = "FILE", requires = "model")]
    prompts: Option<PathBuf>,
    /// With --prompts: most tokens generated per prompt.
    #[arg(long, value_name = "N", default_value_t = 256, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_STEPS))]
    max_new_tokens: usize,
    /// Tensor parallelism: the decode bench over N ranks, one per GPU
    /// (devices 0 .. N-1); the model's KV heads must divide by N.
    #[arg(long, value_name = "N", default_value_t = 1, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=qmk_kernels::TP_MAX_RANKS as i64),
          conflicts_with_all = ["profile", "multi_tokens", "prefill", "prompts"])]
    tp: usize,
    /// With --tp: every rank on --device, each on its share of the SMs (the
    /// group's protocol on one GPU; its floor is that GPU's).
    #[arg(long, requires = "tp")]
    tp_co_resident: bool,
    #[command(flatten)]
    speculate: SpeculateArgs,
}

impl BenchArgs {
    /// What the parser cannot check on one value: the lengths of the lists,
    /// speculation flags without --prompts.
    fn check(&self) -> Result<()> {
        let speculating = self.speculate.speculate != SpeculateChoice::Auto
            || self.speculate.draft_model.is_some();
        if speculating && self.prompts.is_none() {
            return Err(usage(
                "--speculate and --draft-model need --prompts (the synthetic bench times single steps)",
            ));
        }
        if self.tp > 1 && self.context.iter().any(|&c| c != 0) {
            return Err(usage(
                "--tp times steps from position 0 (--context 0): it has no KV fill",
            ));
        }
        for (flag, n) in [("--context", self.context.len()), ("--ab", self.ab.len())] {
            if n > MAX_LIST {
                return Err(usage(format!(
                    "{flag}: {n} values, at most {MAX_LIST} are allowed"
                )));
            }
        }
        Ok(())
    }
}

/// N synthetic prompt ids below the special tokens (deterministic).
fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    let limit = vocab.min(151_643) as u64;
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ n as u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % limit) as u32
        })
        .collect()
}

struct Bar(Option<indicatif::ProgressBar>);

impl Progress for Bar {
    fn begin(&mut self, what: &str, total: u64) {
        if let Some(b) = &self.0 {
            b.set_length(total);
            b.set_message(what.to_string());
        }
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
    fn step(&mut self, what: &str) {
        if let Some(b) = &self.0 {
            b.reset();
            b.set_length(0);
            b.set_message(what.to_string());
        }
    }
}

/// KV capacity a bench of these contexts needs (the largest).
fn bench_capacity(a: &BenchArgs) -> Result<usize> {
    let mut cap = 0usize;
    for &c in &a.context {
        let o = bench_options(a, c, 0);
        let need = qmk_gpu::stats::bench_capacity(&o)
            .with_context(|| format!("--context {c} overflows"))?;
        cap = cap.max(need);
    }
    Ok(cap.max(1))
}

fn bench_options(a: &BenchArgs, context: usize, stream_bytes: u64) -> BenchOptions {
    BenchOptions {
        warmup: a.warmup,
        steps: a.steps,
        stream_bytes,
        context,
        flags: a.kernel_flags,
        ..BenchOptions::default()
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    a.check()?;
    if let Some(prompts) = &a.prompts {
        let backend = match a.backend.as_str() {
            "cpu" => BackendChoice::Cpu,
            "cudarc" => BackendChoice::Cudarc,
            "cust" => BackendChoice::Cust,
            "auto" => BackendChoice::Auto,
            other => bail!(
                "bench --prompts supports --backend auto, cpu, cudarc or cust (got `{other}`)"
            ),
        };
        let model = a
            .model
            .as_ref()
            .expect("clap requires --model with --prompts");
        return crate::spec_bench::run(crate::spec_bench::SpecBench {
            model: &model.to_string_lossy(),
            backend,
            prompts,
            speculate: a.speculate.clone(),
            max_new_tokens: a.max_new_tokens,
            cubin: a.cubin.clone(),
            json: a.json,
        });
    }
    let cust = match a.backend.as_str() {
        "cudarc" => false,
        "cust" if cfg!(feature = "cust") => true,
        "cust" => bail!(
            "this qwen-mk was built without the cust backend (rebuild with `--features cust`)"
        ),
        other => bail!("bench supports --backend cudarc or cust (got `{other}`)"),
    };
    let say = |s: String| {
        if !a.json {
            eprint_line(&s);
        }
    };
    let capacity = match a.prefill {
        Some(n) => n.max(1) + 1,
        None => bench_capacity(&a)?,
    };
    let prefill_chunk = a.prefill.map(|n| a.prefill_chunk.min(n.max(1) as u32));
    // Weights from the files, or generated piece by piece during the upload.
    let source: Box<dyn WeightSource> = match &a.model {
        Some(dir) => {
            say(format!("streaming the weights of {}", dir.display()));
            Box::new(
                CheckpointSource::open(dir)
                    .with_context(|| format!("bench --model {}", dir.display()))?,
            )
        }
        None => {
            say(format!(
                "streaming synthetic {} weights (seed {})",
                a.preset, a.seed
            ));
            Box::new(SyntheticSource::new(&Config::preset(&a.preset)?, a.seed)?)
        }
    };
    if a.tp > 1 {
        qmk_model::tensor_parallel::check_ranks(source.config(), a.tp)
            .with_context(|| format!("bench {} --tp {}", a.label(), a.tp))?;
    }
    // Before uploading 100+ GB of weights: refuse what cannot fit.
    let gpu = crate::gpu::probe()?;
    if a.tp > 1 {
        crate::gpu::check_fits_tp(source.config(), capacity, a.tp, a.tp_co_resident, &gpu)
            .with_context(|| format!("bench {} --tp {}", a.label(), a.tp))?;
    } else {
        crate::gpu::check_fits(source.config(), capacity, prefill_chunk, &gpu)
            .with_context(|| format!("bench {}", a.label()))?;
    }
    let opts = Options {
        device: a.device,
        capacity,
        cubin: a.cubin.clone(),
        ctas_per_sm: a.ctas_per_sm,
        prefill_chunk,
        tensor_cores: a.tensor_cores,
        upload: UploadOptions {
            buffers: a.upload_buffers,
            buffer_bytes: a.upload_buffer_mib.saturating_mul(1 << 20),
        },
        ..Options::default()
    };
    #[cfg(feature = "cust")]
    if cust {
        return run_on::<qmk_backend_cust::CustDriver>(&a, source.as_ref(), opts);
    }
    debug_assert!(!cust);
    run_on::<qmk_backend_cudarc::CudarcDriver>(&a, source.as_ref(), opts)
}

impl BenchArgs {
    /// The model's name in reports: the preset, or the checkpoint
    /// directory's name.
    fn name(&self) -> String {
        match &self.model {
            Some(d) => d
                .file_name()
                .map_or_else(|| d.display().to_string(), |n| n.to_string_lossy().into()),
            None => self.preset.clone(),
        }
    }

    /// What the weights are: `--preset 7b` or `--model DIR`.
    fn label(&self) -> String {
        match &self.model {
            Some(d) => format!("--model {}", d.display()),
            None => format!("--preset {}", self.preset),
        }
    }
}

/// How the engine was set up: the weight upload, the kernel compile, and
/// the process's peak resident memory so far.
#[derive(Debug, Clone, PartialEq)]
struct Load {
    /// Where the weights came from: `synthetic` or the checkpoint directory.
    weights: String,
    upload: qmk_gpu::UploadStats,
    compile_s: f64,
    /// VmHWM, bytes (None where /proc is absent).
    peak_rss: Option<u64>,
}

impl Load {
    fn of<D: Driver>(a: &BenchArgs, b: &GpuBackend<D>) -> Load {
        Load {
            weights: a
                .model
                .as_ref()
                .map_or("synthetic".into(), |d| d.display().to_string()),
            upload: b.upload_report(),
            compile_s: b.compile_time().as_secs_f64(),
            peak_rss: peak_rss_bytes(),
        }
    }

    /// The JSON fields of every report.
    fn json(&self, v: &mut serde_json::Value) {
        let u = &self.upload;
        let fields = serde_json::json!({
            "weights": self.weights,
            "upload_bytes": u.bytes,
            "upload_s": u.time.as_secs_f64(),
            "upload_gbps": u.gbps(),
            "upload_read_s": u.read_time.as_secs_f64(),
            "upload_wait_s": u.wait_time.as_secs_f64(),
            "upload_buffers": u.buffers,
            "upload_buffer_bytes": u.buffer_bytes,
            "compile_s": self.compile_s,
            "peak_rss_bytes": self.peak_rss,
        });
        if let (Some(obj), serde_json::Value::Object(add)) = (v.as_object_mut(), fields) {
            obj.extend(add);
        }
    }

    /// The text lines of every report.
    /// The upload, compile and peak-RSS lines of the text report.
    fn text(&self) -> String {
        let u = &self.upload;
        let mut s = format!(
            "  upload         {:>10.2} GB/s  ({:.2} GB in {:.2} s: host reading {:.2} s, waiting on \
             copies {:.2} s; {} pinned buffers of {} MiB)\n",
            u.gbps(),
            u.bytes as f64 / 1e9,
            u.time.as_secs_f64(),
            u.read_time.as_secs_f64(),
            u.wait_time.as_secs_f64(),
            u.buffers,
            u.buffer_bytes >> 20
        );
        s += &format!(
            "  compile        {:>10.2} s     (alongside the upload; from {})\n",
            self.compile_s, self.weights
        );
        if let Some(r) = self.peak_rss {
            s += &format!(
                "  peak RSS       {:>10.2} GiB  (VmHWM, {r} bytes)\n",
                r as f64 / (1u64 << 30) as f64
            );
        }
        s
    }
}

/// The process's peak resident set (VmHWM in /proc/self/status), bytes.
fn peak_rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&text)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Streams the weights of `source` through driver `D` and runs the bench
/// `a` asks for.
fn run_on<D: Driver>(a: &BenchArgs, source: &dyn WeightSource, opts: Options) -> Result<()> {
    let bar = if a.json {
        None
    } else {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bytes}/{total_bytes} {bar:30}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(b)
    };
    if a.tp > 1 {
        return tensor_parallel::<D>(a, source, opts, Bar(bar));
    }
    let mut backend = GpuBackend::<D>::from_source(source, opts, &mut Bar(bar))
        .with_context(|| format!("setting up the {} backend for {}", D::NAME, a.label()))?;
    match a.prefill {
        Some(n) => prefill(a, &mut backend, n),
        None => decode(a, &mut backend),
    }
}

/// `bench --tp N`: greedy decode steps from position 0 queued back to back
/// on every rank (`--warmup` untimed, then `--steps` timed on rank 0's
/// stream: the mean step), against the floor of one rank's weight bytes
/// per step at rank 0's GPU's streaming bandwidth (co-resident: all ranks'
/// bytes, one GPU's bandwidth).
fn tensor_parallel<D: Driver>(
    a: &BenchArgs,
    source: &dyn WeightSource,
    opts: Options,
    mut bar: Bar,
) -> Result<()> {
    let tp = qmk_gpu::TpOptions {
        co_resident: a.tp_co_resident,
        ..qmk_gpu::TpOptions::new(a.tp)
    };
    let label = format!("{} --tp {}", a.label(), a.tp);
    let mut g = qmk_gpu::TpBackend::<D>::new(source, opts, &tp, &mut bar)
        .with_context(|| format!("setting up the {} backend for {label}", D::NAME))?;
    bar.finish();
    let first = synthetic_prompt(1, source.config().vocab_size)[0];
    let run = |g: &mut qmk_gpu::TpBackend<D>, n: usize| -> Result<std::time::Duration> {
        qmk_engine::Backend::reset(g)?;
        Ok(g.timed_steps(first, 0, n)?)
    };
    if a.warmup > 0 {
        run(&mut g, a.warmup).with_context(|| format!("bench {label}: warm-up"))?;
    }
    let t = run(&mut g, a.steps).with_context(|| format!("bench {label}"))?;
    let step_s = t.as_secs_f64() / a.steps as f64;
    let gbps = g
        .stream_bandwidth(a.stream_gib << 30, 10)
        .with_context(|| format!("bench {label}: the streaming-read floor"))?;
    let per_rank = g.ranks()[0].memory_plan().weight_bytes_per_step;
    let gpu_bytes = if a.tp_co_resident {
        per_rank.saturating_mul(a.tp as u64)
    } else {
        per_rank
    };
    let floor = gbps * 1e9 / gpu_bytes.max(1) as f64;
    let tok_s = 1.0 / step_s;
    let r0 = &g.ranks()[0];
    let l = r0.launch_info();
    if a.json {
        let v = serde_json::json!({
            "model": a.name(),
            "backend": D::NAME,
            "tp": a.tp,
            "co_resident": a.tp_co_resident,
            "device": r0.device().name,
            "grid_per_rank": l.grid,
            "steps": a.steps,
            "step_ms": step_s * 1e3,
            "tok_per_s": tok_s,
            "stream_gbps": gbps,
            "rank_bytes_per_step": per_rank,
            "floor_tok_per_s": floor,
            "fraction_of_floor": tok_s / floor,
        });
        println!("{v}");
    } else {
        println!(
            "bench {label} ({}): {} ranks {}, grid {} CTAs per rank",
            D::NAME,
            a.tp,
            if a.tp_co_resident {
                format!("co-resident on {}", r0.device().name)
            } else {
                format!("one per GPU ({})", r0.device().name)
            },
            l.grid
        );
        println!(
            "  decode         {tok_s:>10.1} tok/s  ({:.3} ms/step, mean of {} steps back to back from position 0)",
            step_s * 1e3,
            a.steps
        );
        println!(
            "  floor          {floor:>10.1} tok/s  ({:.2} GB read per GPU per step at {gbps:.0} GB/s): {:.1} % of it",
            gpu_bytes as f64 / 1e9,
            100.0 * tok_s / floor
        );
    }
    Ok(())
}

/// The decode bench (and `--profile`) at every `--context`.
fn decode<D: Driver>(a: &BenchArgs, backend: &mut GpuBackend<D>) -> Result<()> {
    for &context in &a.context {
        let r = backend
            .bench(&bench_options(a, context, a.stream_gib << 30))
            .with_context(|| format!("bench {} --context {context}", a.label()))?;
        let l = backend.launch_info();
        let (profile, timeline) = if a.profile {
            let mut o = bench_options(a, context, 0);
            o.steps = a.profile_steps.clamp(1, a.steps.max(1));
            (
                backend.bench_profile(&o)?,
                Some(backend.bench_timeline(&o)?),
            )
        } else {
            (Vec::new(), None)
        };
        let (multi, multi_timelines) = if a.multi_tokens {
            let o = bench_options(a, context, 0);
            let timelines = if a.profile {
                let mut o = o.clone();
                o.steps = a.profile_steps.clamp(1, a.steps.max(1));
                backend.bench_multi_timeline(&o)?
            } else {
                Vec::new()
            };
            (backend.bench_multi(&o)?, timelines)
        } else {
            (Vec::new(), Vec::new())
        };
        let load = Load::of(a, backend);
        print(&report_text(a, &r, &l, &profile, timeline.as_ref(), &load))?;
        if !multi.is_empty() {
            print(&multi_text(a, context, &multi, &multi_timelines))?;
        }
    }
    Ok(())
}

/// The multi-token step's cost per T (`--multi-tokens`): a line each, or
/// one JSON object with `--json`; with `--profile` also its timeline per T
/// (`timelines`).
fn multi_text(
    a: &BenchArgs,
    context: usize,
    multi: &[(usize, f64)],
    timelines: &[(usize, Timeline)],
) -> String {
    if a.json {
        return format!("{}\n", multi_json(a, context, multi, timelines));
    }
    let one = multi.first().map_or(1.0, |&(_, us)| us);
    let mut s = format!(
        "multi-token step, {} at {context} positions (median us per launch):\n",
        a.label()
    );
    for &(t, us) in multi {
        s += &format!("  T = {t}: {us:9.1} us = {:.3} one-token steps\n", us / one);
    }
    for (t, timeline) in timelines {
        s += &format!("  T = {t}, traced launches:\n");
        for l in timeline_text(timeline) {
            s += &l;
            s.push('\n');
        }
    }
    s
}

/// The JSON object of `--multi-tokens`: the cost per T, and with
/// `--profile` the timeline per T.
fn multi_json(
    a: &BenchArgs,
    context: usize,
    multi: &[(usize, f64)],
    timelines: &[(usize, Timeline)],
) -> serde_json::Value {
    let one = multi.first().map_or(1.0, |&(_, us)| us);
    let rows: Vec<_> = multi
        .iter()
        .map(|&(t, us)| serde_json::json!({"tokens": t, "us": us, "steps": us / one}))
        .collect();
    let mut v = serde_json::json!({"run": a.label(), "context": context, "multi_tokens": rows});
    if !timelines.is_empty() {
        v["timelines"] = timelines
            .iter()
            .map(|(t, tl)| serde_json::json!({"tokens": t, "timeline": timeline_json(tl)}))
            .collect();
    }
    v
}

/// The JSON object of one decode bench.
fn report_json(
    a: &BenchArgs,
    r: &BenchReport,
    l: &LaunchInfo,
    profile: &[(String, f64)],
    timeline: Option<&Timeline>,
    load: &Load,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "preset": a.name(),
        "backend": a.backend,
        "device": r.device,
        "tok_per_s": r.tok_per_s,
        "us_per_step": r.us_per_step,
        "us_p10": r.us_p10,
        "us_p90": r.us_p90,
        "gbps": r.gbps,
        "floor_gbps": r.floor_gbps,
        "pct_of_floor": r.pct_of_floor,
        "floor_tok_per_s": r.floor_tok_per_s,
        "bytes_per_step": r.bytes_per_step,
        "kv_bytes": r.kv_bytes,
        "context": r.context,
        "first_timed_pos": r.first_timed_pos,
        "kernel_flags": a.kernel_flags,
        "tensor_cores": a.tensor_cores,
        "barriers_per_step": r.barriers_per_step,
        "grid": r.grid,
        "ctas_per_sm": r.ctas_per_sm,
        "registers": r.registers,
        "smem_bytes": l.smem_bytes,
        "warmup": r.warmup,
        "steps": r.steps,
        "profile_steps": if profile.is_empty() { 0 } else { a.profile_steps.clamp(1, a.steps.max(1)) },
        "profile_us": profile.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    if let Some(t) = timeline {
        v["timeline"] = timeline_json(t);
    }
    load.json(&mut v);
    v
}

/// The report of one decode bench: one JSON line, or the table.
fn report_text(
    a: &BenchArgs,
    r: &BenchReport,
    l: &LaunchInfo,
    profile: &[(String, f64)],
    timeline: Option<&Timeline>,
    load: &Load,
) -> String {
    if a.json {
        return format!("{}\n", report_json(a, r, l, profile, timeline, load));
    }
    let mut s = format!(
        "{} on {} ({}), synthetic weights, context {} (timed positions {}..{}), flags {}\n",
        a.name(),
        r.device,
        a.backend,
        r.context,
        r.first_timed_pos,
        r.first_timed_pos + r.steps,
        a.kernel_flags
    );
    let mut line = |t: String| {
        s.push_str(&t);
        s.push('\n');
    };
    line(format!("  tok/s          {:>10.1}", r.tok_per_s));
    line(format!(
        "  us/step        {:>10.1}  (p10 {:.1}, p90 {:.1}, median of {})",
        r.us_per_step, r.us_p10, r.us_p90, r.steps
    ));
    line(format!(
        "  bytes/step     {:>10}  (of which KV {})",
        r.bytes_per_step, r.kv_bytes
    ));
    line(format!("  achieved GB/s  {:>10.1}", r.gbps));
    line(format!(
        "  floor GB/s     {:>10.1}  (streaming read, same cubin, same run)",
        r.floor_gbps
    ));
    line(format!(
        "  % of floor     {:>10.1}  (floor {:.0} tok/s)",
        r.pct_of_floor, r.floor_tok_per_s
    ));
    for (name, us) in profile {
        line(format!("  profile: {name:<32} {us:>10.1} us/step"));
    }
    if let Some(t) = timeline {
        for l in timeline_text(t) {
            line(l);
        }
    }
    line(format!(
        "  barriers/step  {:>10}  grid {} x {} threads, {} regs, {} B smem",
        r.barriers_per_step, r.grid, l.block, r.registers, l.smem_bytes
    ));
    s + &load.text()
}

/// The step timeline as JSON: per op kind its critical path, the mean
/// CTA's time in it and the barriers after it, us per step.
fn timeline_json(t: &Timeline) -> serde_json::Value {
    let ops: serde_json::Map<_, _> = t
        .rows
        .iter()
        .map(|r| {
            let v = serde_json::json!({
                "critical_us": r.critical_us,
                "busy_mean_us": r.busy_mean_us,
                "barrier_us": r.barrier_us,
            });
            (r.name.to_string(), v)
        })
        .collect();
    let mut v = serde_json::json!({
        "steps": t.steps,
        "total_us": t.total_us,
        "launch_skew_us": t.launch_skew_us,
        "tail_us": t.tail_us,
        "barrier_us": t.barrier_us(),
        "tick_ns": t.tick_ns,
        "ops": ops,
    });
    if let Some(a) = &t.attention {
        v["attention_parts"] = serde_json::json!({
            "items": a.items,
            "q_us": a.q_us,
            "stream_us": a.stream_us,
            "partial_us": a.partial_us,
            "combine_us": a.combine_us,
            "slowest_us": a.slowest_us,
            "to_last_partial_us": a.to_last_partial_us,
            "combine_tail_us": a.combine_tail_us,
            "to_arrival_us": a.to_arrival_us,
        });
    }
    v
}

/// The step timeline as table lines.
fn timeline_text(t: &Timeline) -> Vec<String> {
    let mut out = vec![
        format!(
            "  timeline: {:.1} us/step traced (median of {} steps; timer step <= {} ns): barriers {:.1}, launch skew {:.1}, argmax tail {:.1}",
            t.total_us, t.steps, t.tick_ns, t.barrier_us(), t.launch_skew_us, t.tail_us
        ),
        format!(
            "    {:<14} {:>14} {:>16} {:>12}",
            "op", "critical us", "mean CTA busy", "barrier us"
        ),
    ];
    for r in &t.rows {
        out.push(format!(
            "    {:<14} {:>14.1} {:>16.1} {:>12.1}",
            r.name, r.critical_us, r.busy_mean_us, r.barrier_us
        ));
    }
    if let Some(a) = &t.attention {
        out.push(format!(
            "    split attention, {:.0} items per layer: mean item q {:.1}, stream {:.1}, partial {:.1}, combine {:.1} us; \
             last item q {:.1}, stream {:.1}, partial {:.1}; critical = to last partial {:.1} + combine {:.1} + to barrier {:.1}",
            a.items,
            a.q_us,
            a.stream_us,
            a.partial_us,
            a.combine_us,
            a.slowest_us[0],
            a.slowest_us[1],
            a.slowest_us[2],
            a.to_last_partial_us,
            a.combine_tail_us,
            a.to_arrival_us
        ));
    }
    out
}

/// Prefill phases in skip-bit order (`qmk_prefill_chunk`, kernels/cuda/prefill.cuh).
const PREFILL_PHASES: [&str; 6] = ["qkv", "attention", "o_proj", "gate_up", "down", "lm_head"];

/// The order `bench --ab` times its variants in: `rounds` rounds, each
/// variant once per round, round r starting at variant r (mod n), so none
/// always runs first or last.
fn ab_schedule(variants: usize, rounds: usize) -> Vec<usize> {
    (0..rounds)
        .flat_map(|r| (0..variants).map(move |i| (i + r) % variants))
        .collect()
}

/// Sets exactly `flags` as the backend's kernel flags (clears the others).
fn set_only_flags<D: Driver>(backend: &mut GpuBackend<D>, flags: u32) {
    backend.set_kernel_flags(u32::MAX, false);
    backend.set_kernel_flags(flags, true);
}

/// `bench --prefill N`: time to first token.
fn prefill<D: Driver>(a: &BenchArgs, backend: &mut GpuBackend<D>, n: usize) -> Result<()> {
    let tokens = synthetic_prompt(n, backend.config().vocab_size);
    // --kernel-flags reach the prefill kernel too (e.g. FLAG_PF_MMA_SYNC).
    backend.set_kernel_flags(a.kernel_flags, true);
    let r = backend
        .bench_prefill(&tokens, a.prefill_reps)
        .with_context(|| format!("bench --prefill {n} {}", a.label()))?;
    // --profile: the same prefill with one phase skipped at a time (every
    // barrier kept; the results are garbage); full - skipped is the phase.
    // Then every phase skipped ("rest") and the GEMM A/B flags (absolute).
    // One prefill median with `extra` flags on top of --kernel-flags
    // (variants never mix: each sets its flags exactly).
    let mut timed = |extra: u32, what: &str| -> Result<f64> {
        set_only_flags(backend, a.kernel_flags | extra);
        let s = backend
            .bench_prefill(&tokens, a.prefill_reps)
            .with_context(|| format!("bench --prefill {n} {what}"))?;
        Ok(s.ms_median)
    };
    let mut profile: Vec<(&str, f64)> = Vec::new();
    if a.profile {
        let skip = |bits: u32| bits << qmk_kernels::params::SKIP_SHIFT;
        let mut variants: Vec<(&str, u32, bool)> = PREFILL_PHASES
            .iter()
            .enumerate()
            .map(|(i, &name)| (name, skip(1 << i), true))
            .collect();
        variants.extend([
            ("rest", skip(0x3f), false),
            (
                "ab_no_stream_k",
                qmk_kernels::params::FLAG_PF_NO_STREAM_K,
                false,
            ),
            ("ab_mma_sync", qmk_kernels::params::FLAG_PF_MMA_SYNC, false),
        ]);
        for (name, flags, delta) in variants {
            let ms = timed(flags, &format!("--profile, {name}"))?;
            profile.push((name, if delta { r.ms_median - ms } else { ms }));
        }
    }
    // --ab: every variant once per round (a prefill median each), in
    // rotated order (ab_schedule).
    let mut ab: Vec<(u32, Vec<f64>)> = a.ab.iter().map(|&f| (f, Vec::new())).collect();
    for v in ab_schedule(ab.len(), a.ab_rounds) {
        let ms = timed(ab[v].0, &format!("--ab {}", ab[v].0))?;
        ab[v].1.push(ms);
    }
    if a.profile || !ab.is_empty() {
        set_only_flags(backend, a.kernel_flags);
    }
    // Each --ab variant's median over its rounds.
    let ab: Vec<(u32, Vec<f64>, f64)> = ab
        .into_iter()
        .map(|(f, v)| {
            let m = median(&mut v.clone());
            (f, v, m)
        })
        .collect();
    let pf = backend
        .resources()
        .into_iter()
        .find(|x| x.function == qmk_kernels::source::entry::PREFILL_CHUNK);
    if a.json {
        let v = serde_json::json!({
            "preset": a.name(),
            "backend": a.backend,
            "device": r.device,
            "profile_ms": profile.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "ab_ms": ab.iter().map(|(f, v, m)| serde_json::json!({"flags": f, "round_medians_ms": v, "median_ms": m})).collect::<Vec<_>>(),
            "prefill_tokens": r.tokens,
            "chunk": r.chunk,
            "launches": r.launches,
            "ttft_ms": r.ms_median,
            "ttft_ms_p10": r.ms_p10,
            "ttft_ms_p90": r.ms_p90,
            "reps": r.reps,
            "tflops": r.tflops,
            "grid": r.grid,
            "registers": r.registers,
            "smem_bytes": r.smem_bytes,
            "barriers_per_launch": r.barriers_per_launch,
            "kernel_flags": a.kernel_flags,
            "spill_stores": pf.as_ref().map(|x| x.spill_stores),
            "spill_loads": pf.as_ref().map(|x| x.spill_loads),
        });
        let mut v = v;
        Load::of(a, backend).json(&mut v);
        print(&format!("{v}\n"))
    } else {
        let mut s = String::new();
        let mut line = |t: String| {
            s.push_str(&t);
            s.push('\n');
        };
        line(format!(
            "{} on {} ({}), synthetic weights, prefill of {} tokens in chunks of {} ({} launches)",
            a.name(),
            r.device,
            a.backend,
            r.tokens,
            r.chunk,
            r.launches
        ));
        line(format!(
            "  time to first token {:>10.3} ms  (p10 {:.3}, p90 {:.3}, median of {})",
            r.ms_median, r.ms_p10, r.ms_p90, r.reps
        ));
        line(format!("  matrix TFLOP/s      {:>10.1}", r.tflops));
        line(format!(
            "  grid {} x 512 threads, {} regs, {} B dyn smem, {} barriers/launch",
            r.grid, r.registers, r.smem_bytes, r.barriers_per_launch
        ));
        if let Some(x) = pf {
            line(format!("  ptxas: {x}"));
        }
        for (name, ms) in &profile {
            let what = match *name {
                "rest" => "every phase skipped (norms, rotary, barriers)",
                "ab_no_stream_k" => "whole prefill, FLAG_PF_NO_STREAM_K",
                "ab_mma_sync" => "whole prefill, FLAG_PF_MMA_SYNC",
                _ => "full - skipped",
            };
            line(format!("  profile {name:<10} {ms:>10.3} ms  ({what})"));
        }
        for (f, v, m) in &ab {
            let rounds: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
            line(format!(
                "  ab flags {f:<8} {m:>10.3} ms  (median of {} interleaved rounds: {})",
                v.len(),
                rounds.join(" ")
            ));
        }
        s += &Load::of(a, backend).text();
        print(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn parse(args: &[&str]) -> BenchArgs {
        T::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .unwrap()
            .a
    }

    #[test]
    fn peak_rss_is_read_from_vm_hwm() {
        let status = "Name:\tqwen-mk\nVmPeak:\t 9000 kB\nVmHWM:\t  204800 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(200 << 20));
        assert_eq!(parse_vm_hwm("VmRSS: 1 kB"), None);
        // This process has one (Linux).
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().is_some_and(|b| b > 0));
        }
        let a = parse(&["--upload-buffers", "4", "--upload-buffer-mib", "32"]);
        assert_eq!((a.upload_buffers, a.upload_buffer_mib), (4, 32));
        assert_eq!(parse(&[]).upload_buffers, 3);
    }

    #[test]
    fn ab_variants_interleave() {
        let a = parse(&["--prefill", "2048", "--ab", "0,2097152", "--ab-rounds", "3"]);
        assert_eq!((a.ab.clone(), a.ab_rounds), (vec![0, 2_097_152], 3));
        assert_eq!(ab_schedule(2, 3), vec![0, 1, 1, 0, 0, 1]);
        assert_eq!(ab_schedule(3, 2), vec![0, 1, 2, 1, 2, 0]);
        assert!(ab_schedule(0, 4).is_empty());
        assert_eq!(parse(&[]).ab, Vec::<u32>::new());
    }

    #[test]
    fn context_list_and_capacity() {
        let a = parse(&["--preset", "7b", "--context", "8192,32768", "--json"]);
        assert_eq!(a.context, vec![8192, 32768]);
        assert_eq!((a.warmup, a.steps), (16, 200));
        assert!(a.json);
        // The largest context: warm-up at 32752..32768, timed 32768..32968.
        assert_eq!(bench_capacity(&a).unwrap(), 32768 + 200 + 1);
        let o = bench_options(&a, 32768, 1 << 30);
        assert_eq!(qmk_gpu::stats::bench_positions(&o), (32768 - 16, 216));
        assert_eq!(o.stream_bytes, 1 << 30);
        // Default: the short-context bench from position 0.
        let a = parse(&[]);
        assert_eq!(a.context, vec![0]);
        assert_eq!(bench_capacity(&a).unwrap(), 217);
        assert_eq!(a.kernel_flags, 0);
        let a = parse(&["--kernel-flags", "48", "--context", "0"]);
        assert_eq!(bench_options(&a, 0, 0).flags, 48);
        assert!(T::try_parse_from(["bench", "--context", "x"]).is_err());
        // `bench --prefill N` chunks the prompt as `generate` does.
        assert_eq!(parse(&["--prefill", "2048"]).prefill_chunk, 2048);
        assert_eq!(parse(&[]).prefill_chunk, qmk_gpu::DEFAULT_PREFILL_CHUNK);
    }

    /// A timeline of 3 steps: every op `critical_us`, 30 us busy, 2.5 us of
    /// barrier; the split attention's parts partly set.
    fn sample_timeline(critical_us: f64) -> Timeline {
        Timeline {
            steps: 3,
            rows: Timeline::OPS
                .iter()
                .map(|&name| qmk_gpu::TimelineRow {
                    name,
                    critical_us,
                    busy_mean_us: 30.0,
                    barrier_us: 2.5,
                })
                .collect(),
            launch_skew_us: 1.0,
            tail_us: 3.0,
            total_us: 259.0,
            tick_ns: 32,
            attention: Some(qmk_gpu::AttentionParts {
                items: 64.0,
                stream_us: 12.5,
                combine_tail_us: 4.25,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn json_has_context_and_kv_bytes() {
        let a = parse(&["--preset", "0.5b", "--context", "8192"]);
        let config = Config::preset("0.5b").unwrap();
        let o = bench_options(&a, 8192, 0);
        let launch = LaunchInfo::from_occupancy(1, 132, None, 19456, 128).unwrap();
        let r = BenchReport::from_times(
            "test".into(),
            &config,
            1_000_000,
            &o,
            vec![250.0; 200],
            4500.0,
            121,
            &launch,
        );
        let kv = qmk_gpu::stats::bench_kv_bytes(&config, 8192, 200);
        assert_eq!(r.kv_bytes, kv);
        assert_eq!(r.bytes_per_step, 1_000_000 + kv);
        let load = Load {
            weights: "synthetic".into(),
            upload: qmk_gpu::UploadStats {
                bytes: 2_000_000_000,
                time: std::time::Duration::from_millis(250),
                buffers: 3,
                buffer_bytes: 64 << 20,
                ..Default::default()
            },
            compile_s: 1.5,
            peak_rss: Some(300 << 20),
        };
        let timeline = sample_timeline(40.0);
        let profile = [("full".into(), 250.0)];
        let v = report_json(&a, &r, &launch, &profile, Some(&timeline), &load);
        assert_eq!(v["timeline"]["barrier_us"], 15.0);
        assert_eq!(v["timeline"]["ops"]["attention"]["critical_us"], 40.0);
        assert_eq!(v["timeline"]["ops"]["lm_head"]["busy_mean_us"], 30.0);
        let text = timeline_text(&timeline).join("\n");
        assert!(text.contains("barriers 15.0"), "{text}");
        assert!(text.contains("mlp gate/up"), "{text}");
        assert!(text.contains("64 items per layer"), "{text}");
        assert!(text.contains("stream 12.5"), "{text}");
        assert_eq!(v["timeline"]["attention_parts"]["combine_tail_us"], 4.25);
        assert_eq!(v["upload_gbps"], 8.0);
        assert_eq!(v["peak_rss_bytes"], 300u64 << 20);
        assert_eq!(v["upload_buffers"], 3);
        assert_eq!(v["weights"], "synthetic");
        assert_eq!(v["context"], 8192);
        assert_eq!(v["kv_bytes"], kv);
        assert_eq!(v["first_timed_pos"], 8192);
        assert_eq!(v["profile_us"]["full"], 250.0);
        // 0.5B at 8k: 2 x 128 x 24 x 2 B per position, ~8.2k positions.
        assert!(kv > 100_000_000 && kv < 102_000_000, "{kv}");
    }

    #[test]
    fn multi_tokens_with_profile_add_a_timeline_per_t() {
        let a = parse(&["--preset", "0.5b", "--multi-tokens", "--profile", "--json"]);
        let multi = [(1, 200.0), (2, 250.0)];
        let timelines = [(1, sample_timeline(40.0)), (2, sample_timeline(55.0))];
        let v = multi_json(&a, 0, &multi, &timelines);
        assert_eq!(v["run"], "--preset 0.5b");
        assert_eq!(v["multi_tokens"][1]["steps"], 1.25);
        let tl = v["timelines"].as_array().unwrap();
        assert_eq!(tl.len(), 2);
        assert_eq!(tl[0]["tokens"], 1);
        assert_eq!(tl[1]["tokens"], 2);
        assert_eq!(tl[1]["timeline"], timeline_json(&timelines[1].1));
        assert_eq!(tl[1]["timeline"]["ops"]["mlp down"]["critical_us"], 55.0);
        assert_eq!(tl[1]["timeline"]["total_us"], 259.0);
        assert_eq!(tl[0]["timeline"]["barrier_us"], 15.0);
        // One JSON line, the same object.
        let line = multi_text(&a, 0, &multi, &timelines);
        assert_eq!(line.lines().count(), 1);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&line).unwrap(), v);
        // Without --profile: no `timelines` key.
        assert!(multi_json(&a, 0, &multi, &[]).get("timelines").is_none());
        // Text: one timeline block per T, headed by it.
        let a = parse(&["--preset", "0.5b", "--multi-tokens", "--profile"]);
        let text = multi_text(&a, 0, &multi, &timelines);
        assert!(
            text.contains("  T = 2:     250.0 us = 1.250 one-token steps"),
            "{text}"
        );
        let t2 = text.find("  T = 2, traced launches:").expect(&text);
        assert!(
            text[t2..].contains("  timeline: 259.0 us/step traced"),
            "{text}"
        );
        assert!(text[t2..].contains("55.0"), "{text}");
        assert_eq!(text.matches("timeline:").count(), 2, "{text}");
    }
}
