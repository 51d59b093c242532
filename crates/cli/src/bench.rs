//! `qwen-mk bench`: decode speed of the megakernel on synthetic weights at a
//! preset's full shapes, against the bandwidth floor measured in the same
//! run (DESIGN.md section 4). `--json` prints one JSON object.

use anyhow::{bail, Context, Result};
use clap::Args;
use qmk_backend_cudarc::{BenchOptions, CudarcBackend, Options, Progress};
use qmk_model::{synthetic_weights, Config};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model shape: 0.5b, 1.5b, 3b, 7b, 14b, 32b, 72b (synthetic weights).
    #[arg(long, default_value = "7b")]
    preset: String,
    /// GPU backend (cudarc; cust comes with its issue).
    #[arg(long, default_value = "cudarc")]
    backend: String,
    /// Untimed steps.
    #[arg(long, default_value_t = 16)]
    warmup: usize,
    /// Timed steps (median reported).
    #[arg(long, default_value_t = 128)]
    steps: usize,
    /// Size of the streaming-read buffer for the floor, GiB.
    #[arg(long, default_value_t = 4)]
    stream_gib: u64,
    /// Synthetic-weight seed.
    #[arg(long, default_value_t = 20261129)]
    seed: u64,
    /// Load this cubin instead of compiling with NVRTC.
    #[arg(long)]
    cubin: Option<std::path::PathBuf>,
    /// Cap CTAs per SM (default: the occupancy API's answer).
    #[arg(long)]
    ctas_per_sm: Option<u32>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Also time the kernel with each phase skipped and with barriers only
    /// (where the time goes).
    #[arg(long)]
    profile: bool,
    /// Time to first token instead of decode speed: prefill of N synthetic
    /// prompt tokens with the tensor-core prefill kernel (issue 9).
    #[arg(long, value_name = "N")]
    prefill: Option<usize>,
    /// Positions per prefill launch (with --prefill).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: u32,
    /// Timed prefills (median reported; with --prefill).
    #[arg(long, default_value_t = 10)]
    prefill_reps: usize,
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
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
        }
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.backend != "cudarc" {
        bail!("bench supports --backend cudarc (got `{}`)", a.backend);
    }
    let config = Config::preset(&a.preset)?;
    let say = |s: String| {
        if !a.json {
            eprintln!("{s}");
        }
    };
    let capacity = match a.prefill {
        Some(n) => n.max(1) + 1,
        None => a.warmup + a.steps + 1,
    };
    // Before generating 100+ GB of weights: refuse what cannot fit.
    let gpu = crate::gpu::probe()?;
    crate::gpu::check_fits(&config, capacity, &gpu, crate::common::available_memory())
        .with_context(|| format!("bench --preset {}", a.preset))?;
    say(format!(
        "generating synthetic {} weights (seed {})",
        a.preset, a.seed
    ));
    let weights = synthetic_weights(&config, a.seed);
    let opts = Options {
        device: a.device,
        capacity,
        cubin: a.cubin.clone(),
        ctas_per_sm: a.ctas_per_sm,
        prefill_chunk: a.prefill.map(|n| a.prefill_chunk.min(n.max(1) as u32)),
        ..Options::default()
    };
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
    let mut backend = CudarcBackend::new(&weights, opts, &mut Bar(bar))
        .with_context(|| format!("setting up the cudarc backend for {}", a.preset))?;
    drop(weights);
    if let Some(n) = a.prefill {
        return prefill(&a, &mut backend, n);
    }
    let r = backend.bench(&BenchOptions {
        warmup: a.warmup,
        steps: a.steps,
        stream_bytes: a.stream_gib << 30,
        ..BenchOptions::default()
    })?;
    let l = backend.launch_info();
    let profile = if a.profile {
        backend.bench_profile(&BenchOptions {
            warmup: a.warmup,
            steps: a.steps,
            ..BenchOptions::default()
        })?
    } else {
        Vec::new()
    };
    if a.json {
        let v = serde_json::json!({
            "preset": a.preset,
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
            "barriers_per_step": r.barriers_per_step,
            "grid": r.grid,
            "ctas_per_sm": r.ctas_per_sm,
            "registers": r.registers,
            "smem_bytes": l.smem_bytes,
            "warmup": r.warmup,
            "steps": r.steps,
            "context": r.context,
            "profile_us": profile.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        });
        println!("{v}");
    } else {
        println!(
            "{} on {} (cudarc), synthetic weights, positions 0..{}",
            a.preset, r.device, r.context
        );
        println!("  tok/s          {:>10.1}", r.tok_per_s);
        println!(
            "  us/step        {:>10.1}  (p10 {:.1}, p90 {:.1}, median of {})",
            r.us_per_step, r.us_p10, r.us_p90, r.steps
        );
        println!("  bytes/step     {:>10}", r.bytes_per_step);
        println!("  achieved GB/s  {:>10.1}", r.gbps);
        println!(
            "  floor GB/s     {:>10.1}  (streaming read, same cubin, same run)",
            r.floor_gbps
        );
        println!(
            "  % of floor     {:>10.1}  (floor {:.0} tok/s)",
            r.pct_of_floor, r.floor_tok_per_s
        );
        for (name, us) in &profile {
            println!("  profile: {name:<24} {us:>10.1} us/step");
        }
        println!(
            "  barriers/step  {:>10}  grid {} x {} threads, {} regs, {} B smem",
            r.barriers_per_step, r.grid, l.block, r.registers, l.smem_bytes
        );
    }
    Ok(())
}

/// `bench --prefill N`: time to first token.
fn prefill(a: &BenchArgs, backend: &mut CudarcBackend, n: usize) -> Result<()> {
    let tokens = synthetic_prompt(n, backend.config().vocab_size);
    let r = backend
        .bench_prefill(&tokens, a.prefill_reps)
        .with_context(|| format!("bench --prefill {n} --preset {}", a.preset))?;
    let pf = backend
        .resources()
        .into_iter()
        .find(|x| x.function == qmk_kernels::source::entry::PREFILL_CHUNK);
    if a.json {
        let v = serde_json::json!({
            "preset": a.preset,
            "backend": a.backend,
            "device": r.device,
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
            "spill_stores": pf.as_ref().map(|x| x.spill_stores),
            "spill_loads": pf.as_ref().map(|x| x.spill_loads),
        });
        println!("{v}");
    } else {
        println!(
            "{} on {} (cudarc), synthetic weights, prefill of {} tokens in chunks of {} ({} launches)",
            a.preset, r.device, r.tokens, r.chunk, r.launches
        );
        println!(
            "  time to first token {:>10.3} ms  (p10 {:.3}, p90 {:.3}, median of {})",
            r.ms_median, r.ms_p10, r.ms_p90, r.reps
        );
        println!("  matrix TFLOP/s      {:>10.1}", r.tflops);
        println!(
            "  grid {} x 512 threads, {} regs, {} B dyn smem, {} barriers/launch",
            r.grid, r.registers, r.smem_bytes, r.barriers_per_launch
        );
        if let Some(x) = pf {
            println!("  ptxas: {x}");
        }
    }
    Ok(())
}
