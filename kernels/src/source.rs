//! The CUDA sources, embedded at build time and handed to NVRTC as
//! in-memory headers under their path below `kernels/cuda/`.
//!
//! `cuda/megakernel.cu` is the one translation unit; it includes every
//! header of [`HEADERS`] once, in dependency order, grouped by role:
//! `core/` (types, parameter structs, weight addressing, rotary, KV cache,
//! the grid barrier), `decode/` (the decode step's fused ops), `probes/`
//! (the bandwidth floor and the 32-bit trap probe) and `prefill/` (the
//! tensor-core prompt kernel). Every text here also feeds the cubin cache
//! key and the fingerprint ([`crate::KernelBuild`]).

/// The translation unit NVRTC compiles.
pub const MAIN: (&str, &str) = ("megakernel.cu", include_str!("../cuda/megakernel.cu"));

macro_rules! headers {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_str!(concat!("../cuda/", $path)))),*]
    };
}

/// Headers [`MAIN`] includes, by include name (their path below
/// `kernels/cuda/`). `qmk_plan.h` and `qmk_params_check.h` are rendered per
/// model (see [`crate::KernelBuild`]).
pub const HEADERS: &[(&str, &str)] = headers!(
    "core/common.cuh",
    "core/params.cuh",
    "core/tensors.cuh",
    "core/rotary.cuh",
    "core/kv_cache.cuh",
    "core/barrier.cuh",
    "decode/matvec.cuh",
    "decode/tc_phase.cuh",
    "decode/embed.cuh",
    "decode/tp.cuh",
    "decode/rms_norm.cuh",
    "decode/qkv_proj.cuh",
    "decode/attention.cuh",
    "decode/o_proj.cuh",
    "decode/mlp.cuh",
    "decode/lm_head.cuh",
    "decode/argmax.cuh",
    "decode/multi.cuh",
    "probes/stream.cuh",
    "probes/trap_probe.cuh",
    "prefill/mma.cuh",
    "prefill/gemm.cuh",
    "prefill/wgmma.cuh",
    "prefill/norm.cuh",
    "prefill/rope.cuh",
    "prefill/attention.cuh",
    "prefill/gemm_phases.cuh",
    "prefill/chunk.cuh",
);

/// Headers rendered per model by [`crate::KernelBuild`], included by
/// [`MAIN`] next to [`HEADERS`].
pub const RENDERED: [&str; 2] = ["qmk_plan.h", "qmk_params_check.h"];

/// Kernel entry points in the cubin.
pub mod entry {
    /// One decode step (`qmk::Params`), `megakernel.cu`.
    pub const DECODE_STEP: &str = "qmk_decode_step";
    /// One prompt chunk (`qmk::PrefillParams`), tensor cores,
    /// `prefill/chunk.cuh`.
    pub const PREFILL_CHUNK: &str = "qmk_prefill_chunk";
    /// The multi-token step for `t` tokens (`qmk::MultiParams`),
    /// `decode/multi.cuh`: `qmk_decode_multi_2` ..
    /// `qmk_decode_multi_8`, those up to
    /// [`crate::KernelBuild::multi_max_tokens`] for the arch.
    pub fn decode_multi(t: u32) -> String {
        format!("qmk_decode_multi_{t}")
    }
    /// The streaming-read bandwidth floor (`qmk::StreamParams`),
    /// `probes/stream.cuh`.
    pub const STREAM_READ: &str = "qmk_stream_read";
    /// Reads one element per layer through chunk bases
    /// (`qmk::ProbeParams`), `probes/trap_probe.cuh`.
    pub const TRAP_PROBE: &str = "qmk_trap_probe";
    /// Fills the trap probe's tensor (`qmk::ProbeFillParams`).
    pub const PROBE_FILL: &str = "qmk_probe_fill";
    /// `__device__` u64 identifying the model/plan/sources the cubin was
    /// built from.
    pub const FINGERPRINT: &str = "qmk_fingerprint";
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    /// `#include "..."` names of a source, in order.
    fn includes(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.trim_start().strip_prefix("#include"))
            .map(|rest| rest.trim_start().trim_start_matches('"'))
            .map(|rest| rest.split('"').next().unwrap_or(""))
            .collect()
    }

    fn cuda_files(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p: PathBuf = e.unwrap().path();
            if p.is_dir() {
                cuda_files(&p, root, out);
            } else if p.extension().is_some_and(|x| x == "cuh") {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy();
                out.push(rel.replace('\\', "/"));
            }
        }
    }

    #[test]
    fn main_includes_every_header_once_in_list_order() {
        let inc = includes(MAIN.1);
        let embedded: Vec<&str> = inc
            .iter()
            .copied()
            .filter(|n| !RENDERED.contains(n))
            .collect();
        let listed: Vec<&str> = HEADERS.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            embedded, listed,
            "megakernel.cu's includes and HEADERS differ"
        );
        for r in RENDERED {
            assert_eq!(inc.iter().filter(|n| **n == r).count(), 1, "{r}");
        }
        // Only the translation unit includes: a header that includes
        // another would make NVRTC resolve a name this list does not hold.
        for (name, text) in HEADERS {
            assert!(includes(text).is_empty(), "{name} includes a file");
        }
    }

    #[test]
    fn every_cuda_file_is_embedded() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut on_disk = Vec::new();
        cuda_files(&root, &root, &mut on_disk);
        on_disk.sort();
        let mut listed: Vec<String> = HEADERS.iter().map(|(n, _)| n.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
    }

    #[test]
    fn every_include_says_what_it_defines() {
        for line in MAIN.1.lines().filter(|l| l.starts_with("#include")) {
            let comment = line.split_once("//").map(|(_, c)| c.trim()).unwrap_or("");
            assert!(!comment.is_empty(), "no comment on `{line}`");
        }
    }

    #[test]
    fn each_header_names_itself_first() {
        for (name, text) in HEADERS {
            let first = text.lines().next().unwrap_or("");
            assert!(
                first.starts_with(&format!("// {name}:")),
                "{name} starts with `{first}`"
            );
        }
    }
}
