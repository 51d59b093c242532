//! `qwen-mk compile`: writes the megakernel cubin for a model and an arch,
//! for machines without NVRTC (load it with `--cubin`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use qmk_kernels::{Arch, Compiler, KernelBuild};
use qmk_model::Config;

#[derive(Args, Debug)]
pub struct CompileArgs {
    /// Model shape preset (0.5b ... 72b); or use --config.
    #[arg(long, default_value = "0.5b", conflicts_with = "config")]
    preset: String,
    /// A model's config.json instead of a preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Target architecture: sm_80, sm_89, sm_90, ...
    #[arg(long, default_value = "sm_90")]
    arch: String,
    /// Output file (default: qwen-mk-PRESET-ARCH.cubin, or
    /// qwen-mk-PRESET-tpN-ARCH.cubin with --tp).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// The cubin of a tensor-parallel rank of an N-way group (every rank
    /// loads the same one).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = crate::common::whole::<usize>(1..=qmk_kernels::TP_MAX_RANKS as i64))]
    tp: usize,
}

pub fn run(a: CompileArgs) -> Result<()> {
    let config = match &a.config {
        Some(p) => Config::from_file(p)?,
        None => Config::preset(&a.preset)?,
    };
    let arch = Arch::parse(&a.arch)?;
    let build = if a.tp > 1 {
        KernelBuild::for_rank(&config, a.tp).with_context(|| format!("--tp {}", a.tp))?
    } else {
        KernelBuild::new(&config)?
    };
    let compiler = Compiler::new()?;
    let cubin = compiler
        .compile(&build, arch)
        .with_context(|| format!("compiling the megakernel for {arch}"))?;
    let mut name = a
        .config
        .as_ref()
        .map_or(a.preset.clone(), |_| "config".into());
    if a.tp > 1 {
        name += &format!("-tp{}", a.tp);
    }
    let out = a
        .output
        .unwrap_or_else(|| PathBuf::from(format!("qwen-mk-{name}-{arch}.cubin")));
    cubin.write(&out)?;
    let mut text = format!(
        "{}: {} bytes for {arch}, fingerprint {:#018x}, {} barriers/step, {} B dynamic smem\n",
        out.display(),
        cubin.bytes.len(),
        build.fingerprint,
        build.barriers_per_step,
        build.smem_for(arch)
    );
    let resources = cubin.resources();
    for r in &resources {
        text.push_str(&format!("  {r}\n"));
    }
    // The decode step runs one CTA per SM: its shared memory picks the
    // SM's carveout, and the L1 its spills use is what is left.
    if let Some(r) = resources.iter().find(|r| r.function == "qmk_decode_step") {
        let cta = r.smem_bytes + u64::from(build.smem_for(arch));
        text.push_str(&match arch.carveout_for(cta) {
            Some((kb, l1)) => format!(
                "  qmk_decode_step: {cta} B of shared memory per CTA + {} B reserved: the {kb} KB carveout, {l1} KB of L1\n",
                Arch::RESERVED_SMEM_PER_CTA
            ),
            None => format!(
                "  qmk_decode_step: {cta} B of shared memory per CTA: past every {arch} carveout\n"
            ),
        });
    }
    crate::output::print(&text)
}
