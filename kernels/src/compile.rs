//! NVRTC compilation of a [`KernelBuild`] to a cubin (SASS for one arch, not
//! PTX: a driver cannot JIT PTX from a newer toolkit), with an on-disk cache.

use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{KernelsError, Result};
use crate::header::KernelBuild;
use crate::nvrtc::Nvrtc;
use crate::source;

/// A GPU architecture, `sm_<major><minor>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch(pub u32);

impl Arch {
    /// Ampere data center (A100), sm_80.
    pub const SM80: Arch = Arch(80);
    /// Ada Lovelace (L4, L40S, RTX 40xx), sm_89.
    pub const SM89: Arch = Arch(89);
    /// Hopper (H100, H200), sm_90; compiled as sm_90a.
    pub const SM90: Arch = Arch(90);
    /// The archs CI compiles for.
    pub const CI: [Arch; 3] = [Arch::SM80, Arch::SM89, Arch::SM90];

    /// From a compute capability.
    pub fn from_cc(major: i32, minor: i32) -> Result<Arch> {
        if !(5..=12).contains(&major) || !(0..=9).contains(&minor) {
            return Err(KernelsError::BadArch(format!("{major}.{minor}")));
        }
        Ok(Arch(major as u32 * 10 + minor as u32))
    }

    /// Parses `sm_90`, `90` or `9.0`.
    pub fn parse(s: &str) -> Result<Arch> {
        let bad = || KernelsError::BadArch(s.to_string());
        let t = s.trim();
        let t = t.strip_prefix("sm_").unwrap_or(t);
        if let Some((a, b)) = t.split_once('.') {
            return Arch::from_cc(a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        }
        let n: u32 = t.parse().map_err(|_| bad())?;
        if !(50..=129).contains(&n) {
            return Err(bad());
        }
        Ok(Arch(n))
    }

    /// Hopper (sm_90): the megakernel is compiled for the arch-specific
    /// target sm_90a, whose wgmma instructions the prefill GEMM uses
    /// (kernels/cuda/prefill/wgmma.cuh). Such a cubin loads on compute
    /// capability 9.0 only.
    pub fn has_wgmma(self) -> bool {
        self.0 == 90
    }

    /// Bulk tensor copies (`cp.async.bulk.tensor`, sm_90 and later): the
    /// decode split attention streams its K/V with them
    /// ([`crate::KernelParams::kv_maps`]).
    pub fn has_bulk_tensor_copies(self) -> bool {
        self.0 >= 90
    }

    /// The NVRTC `--gpu-architecture` value: `sm_90a` on Hopper, else
    /// `sm_XY`.
    pub fn target(self) -> String {
        if self.has_wgmma() {
            format!("{self}a")
        } else {
            self.to_string()
        }
    }

    /// Largest opt-in shared memory per CTA, bytes (for early, clear
    /// errors): the largest carveout less the system's reserve.
    pub fn max_smem_per_cta(self) -> u32 {
        let top = self.smem_carveouts_kb().last().copied().unwrap_or(0);
        (top * 1024).saturating_sub(Self::RESERVED_SMEM_PER_CTA)
    }

    /// Shared memory the system reserves per resident CTA, bytes.
    pub const RESERVED_SMEM_PER_CTA: u32 = 1024;

    /// The shared-memory carveouts an SM can be set to, KB, smallest first
    /// (the CUDA programming guide, per compute capability); the rest of
    /// [`Arch::unified_l1_smem_kb`] is L1.
    pub fn smem_carveouts_kb(self) -> &'static [u32] {
        match self.0 {
            90 => &[0, 8, 16, 32, 64, 100, 132, 164, 196, 228],
            80 | 87 => &[0, 8, 16, 32, 64, 100, 132, 164],
            _ => &[0, 8, 16, 32, 64, 100],
        }
    }

    /// L1 and shared memory together per SM, KB.
    pub fn unified_l1_smem_kb(self) -> u32 {
        match self.0 {
            90 => 256,
            80 | 87 => 192,
            _ => 128,
        }
    }

    /// For one resident CTA with `cta_smem_bytes` of static and dynamic
    /// shared memory: the smallest carveout that holds it with the system's
    /// reserve and the L1 that carveout leaves, KB; None past the largest.
    /// Kernels whose L1 matters (the decode step's spills live there) lose
    /// it in steps: a byte past a carveout costs the next step's difference.
    pub fn carveout_for(self, cta_smem_bytes: u64) -> Option<(u32, u32)> {
        let need = cta_smem_bytes + u64::from(Self::RESERVED_SMEM_PER_CTA);
        self.smem_carveouts_kb()
            .iter()
            .find(|&&kb| u64::from(kb) * 1024 >= need)
            .map(|&kb| (kb, self.unified_l1_smem_kb() - kb))
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

/// One kernel's resource use, from ptxas' verbose report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    /// The kernel's entry function name.
    pub function: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame per thread, bytes.
    pub stack_bytes: u64,
    /// Register spill stores, bytes.
    pub spill_stores: u64,
    /// Register spill loads, bytes.
    pub spill_loads: u64,
    /// Static shared memory (the megakernel also takes dynamic smem).
    pub smem_bytes: u64,
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} registers, {} B stack, {} B spill stores, {} B spill loads, {} B static smem",
            self.function,
            self.registers,
            self.stack_bytes,
            self.spill_stores,
            self.spill_loads,
            self.smem_bytes
        )
    }
}

fn number_before(text: &str, unit: &str) -> Option<u64> {
    let i = text.find(unit)?;
    text[..i].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas info` lines (`--ptxas-options=-v`) into one entry per kernel.
pub fn parse_ptxas_log(log: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    // Whether the last "Function properties" line named the entry (a
    // non-inlined callee's properties follow its caller's).
    let mut own = true;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(Resources {
                function: name,
                ..Default::default()
            });
            own = true;
        } else if let Some(r) = out.last_mut() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                own = f.trim() == r.function;
            } else if line.contains("bytes stack frame") {
                if !own {
                    continue;
                }
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                r.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                r.registers = number_before(line, "registers").unwrap_or(0) as u32;
                r.smem_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// A compiled megakernel module.
#[derive(Debug, Clone)]
pub struct Cubin {
    /// The architecture it was compiled for.
    pub arch: Arch,
    /// The cubin image.
    pub bytes: Vec<u8>,
    /// `qmk_fingerprint` of the build it came from (0 when loaded from a
    /// file without one known).
    pub fingerprint: u64,
    /// NVRTC's log (the ptxas report); empty for a file loaded directly.
    pub log: String,
    /// Where the cache holds it, if it was cached.
    pub cache_path: Option<PathBuf>,
    /// Whether it was read from the cache or a file rather than compiled.
    pub from_cache: bool,
}

impl Cubin {
    /// Per-kernel registers, spills and static shared memory.
    pub fn resources(&self) -> Vec<Resources> {
        parse_ptxas_log(&self.log)
    }

    /// Reads a cubin written by `qwen-mk compile` (for machines without
    /// NVRTC). The backend checks the fingerprint against the model.
    pub fn from_file(path: &Path, arch: Arch) -> Result<Cubin> {
        let bytes = std::fs::read(path).map_err(|source| KernelsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Cubin {
            arch,
            bytes,
            fingerprint: 0,
            log: String::new(),
            cache_path: Some(path.to_path_buf()),
            from_cache: true,
        })
    }

    /// Writes the cubin bytes to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, &self.bytes).map_err(|source| KernelsError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// `$QMK_CACHE_DIR`, else `~/.cache/qwen-mk/cubins`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("QMK_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/qwen-mk/cubins"))
}

/// `$QMK_CUDA_INCLUDE` (colon-separated), else `/usr/local/cuda/include` if
/// it exists. The kernel includes no CUDA header today; the folders are
/// passed so a future `#include <cuda_bf16.h>` works with the pip layout.
pub fn include_dirs() -> Vec<PathBuf> {
    match std::env::var_os("QMK_CUDA_INCLUDE") {
        Some(v) => std::env::split_paths(&v)
            .filter(|p| !p.as_os_str().is_empty())
            .collect(),
        None => {
            let p = PathBuf::from("/usr/local/cuda/include");
            if p.is_dir() {
                vec![p]
            } else {
                Vec::new()
            }
        }
    }
}

/// NVRTC plus a cubin cache.
#[derive(Debug)]
pub struct Compiler {
    nvrtc: Nvrtc,
    cache_dir: Option<PathBuf>,
    include_dirs: Vec<PathBuf>,
}

impl Compiler {
    /// Loads NVRTC; cache in [`default_cache_dir`].
    pub fn new() -> Result<Compiler> {
        Ok(Compiler::with_nvrtc(Nvrtc::load()?))
    }

    /// Uses an already loaded NVRTC; cache in [`default_cache_dir`].
    pub fn with_nvrtc(nvrtc: Nvrtc) -> Compiler {
        Compiler {
            nvrtc,
            cache_dir: default_cache_dir(),
            include_dirs: include_dirs(),
        }
    }

    /// None disables the cache.
    pub fn cache_dir(mut self, dir: Option<PathBuf>) -> Compiler {
        self.cache_dir = dir;
        self
    }

    /// The NVRTC library it compiles with.
    pub fn nvrtc(&self) -> &Nvrtc {
        &self.nvrtc
    }

    /// NVRTC options for `arch`.
    pub fn options(&self, arch: Arch) -> Vec<String> {
        let mut o = vec![
            format!("--gpu-architecture={}", arch.target()),
            "-std=c++17".to_string(),
            "--ptxas-options=-v".to_string(),
            // A device-only translation unit: unannotated constexpr helpers
            // (the plan header's) are device functions too.
            "-default-device".to_string(),
            // Source lines in compute-sanitizer / profiler reports; no cost.
            "--generate-line-info".to_string(),
        ];
        for d in &self.include_dirs {
            o.push(format!("--include-path={}", d.display()));
        }
        o
    }

    /// Cache key: sha256 of sources, rendered headers, arch, NVRTC version,
    /// options and this crate's version.
    pub fn cache_key(&self, build: &KernelBuild, arch: Arch) -> String {
        let mut h = Sha256::new();
        h.update(concat!("qmk-kernels ", env!("CARGO_PKG_VERSION")).as_bytes());
        for (name, text) in std::iter::once((source::MAIN.0, source::MAIN.1)).chain(build.headers())
        {
            h.update(name.as_bytes());
            h.update((text.len() as u64).to_le_bytes());
            h.update(text.as_bytes());
        }
        h.update(arch.to_string().as_bytes());
        let (maj, min) = self.nvrtc.version();
        h.update(format!("nvrtc {maj}.{min}").as_bytes());
        for o in self
            .options(arch)
            .into_iter()
            .chain(build.arch_options(arch))
        {
            h.update(o.as_bytes());
            h.update([0u8]);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Compiles (or fetches from the cache) the megakernel module.
    pub fn compile(&self, build: &KernelBuild, arch: Arch) -> Result<Cubin> {
        let key = self.cache_key(build, arch);
        let paths = self
            .cache_dir
            .as_ref()
            .map(|d| (d.join(format!("{key}.cubin")), d.join(format!("{key}.log"))));
        if let Some((cubin_path, log_path)) = &paths {
            if let Ok(bytes) = std::fs::read(cubin_path) {
                let log = std::fs::read_to_string(log_path).unwrap_or_default();
                return Ok(Cubin {
                    arch,
                    bytes,
                    fingerprint: build.fingerprint,
                    log,
                    cache_path: Some(cubin_path.clone()),
                    from_cache: true,
                });
            }
        }
        let mut options = self.options(arch);
        options.extend(build.arch_options(arch));
        let compiled = self.nvrtc.compile(
            source::MAIN.0,
            source::MAIN.1,
            &build.headers(),
            &options,
            &arch.target(),
        )?;
        let mut cubin = Cubin {
            arch,
            bytes: compiled.cubin,
            fingerprint: build.fingerprint,
            log: compiled.log,
            cache_path: None,
            from_cache: false,
        };
        if let Some((cubin_path, log_path)) = paths {
            // The cache is an optimisation: a read-only home is no error.
            if store(&cubin_path, &cubin.bytes).is_ok() {
                let _ = store(&log_path, cubin.log.as_bytes());
                cubin.cache_path = Some(cubin_path);
            }
        }
        Ok(cubin)
    }
}

/// Write-then-rename so a concurrent reader never sees half a cubin.
fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_carveout_is_the_smallest_that_holds_the_cta_and_its_reserve() {
        // 14B's decode step on sm_90: 133,632 B dynamic with 208 B static
        // (before the bulk K/V copies) or 512 B (their mbarriers, as now)
        // fits 132 KB (124 KB of L1); with 1,280 B static it needs 164 KB.
        assert_eq!(Arch::SM90.carveout_for(133_632 + 208), Some((132, 124)));
        assert_eq!(Arch::SM90.carveout_for(133_632 + 512), Some((132, 124)));
        assert_eq!(Arch::SM90.carveout_for(133_632 + 1_280), Some((164, 92)));
        // Exactly full counts as fitting; one byte more does not.
        assert_eq!(Arch::SM90.carveout_for(132 * 1024 - 1024), Some((132, 124)));
        assert_eq!(Arch::SM90.carveout_for(132 * 1024 - 1023), Some((164, 92)));
        assert_eq!(Arch::SM90.carveout_for(0), Some((8, 248)));
        assert_eq!(Arch::SM90.carveout_for(227 * 1024), Some((228, 28)));
        assert_eq!(Arch::SM90.carveout_for(228 * 1024), None);
        assert_eq!(Arch::SM89.carveout_for(99 * 1024), Some((100, 28)));
        assert_eq!(Arch::SM80.carveout_for(163 * 1024), Some((164, 28)));
        // The opt-in limits the driver reports: the largest carveout less
        // the reserve.
        assert_eq!(Arch::SM80.max_smem_per_cta(), 163 * 1024);
        assert_eq!(Arch(87).max_smem_per_cta(), 163 * 1024);
        assert_eq!(Arch(86).max_smem_per_cta(), 99 * 1024);
        assert_eq!(Arch::SM89.max_smem_per_cta(), 99 * 1024);
        assert_eq!(Arch::SM90.max_smem_per_cta(), 227 * 1024);
    }

    #[test]
    fn arch_parsing() {
        assert_eq!(Arch::parse("sm_90").unwrap(), Arch::SM90);
        assert_eq!(Arch::parse("89").unwrap(), Arch::SM89);
        assert_eq!(Arch::parse("8.0").unwrap(), Arch::SM80);
        assert!(Arch::parse("sm_x").is_err());
        assert_eq!(Arch::SM90.to_string(), "sm_90");
    }

    #[test]
    fn ptxas_report_parses() {
        let log = "ptxas info    : Compiling entry function 'qmk_decode_step' for 'sm_90'\n\
                   ptxas info    : Function properties for qmk_decode_step\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 78 registers, used 1 barriers, 208 bytes smem, 2416 bytes cmem[0]\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].function, "qmk_decode_step");
        assert_eq!(r[0].registers, 78);
        assert_eq!(
            (r[0].stack_bytes, r[0].spill_stores, r[0].spill_loads),
            (8, 4, 12)
        );
        assert_eq!(r[0].smem_bytes, 208);
        // A non-inlined callee's properties follow its caller's and are
        // not the caller's.
        let log = format!(
            "{log}ptxas info    : Function properties for _ZN3qmk2tc5phaseEv\n\
             ptxas         .     0 bytes stack frame, 264 bytes spill stores, 436 bytes spill loads\n\
             ptxas info    : Compiling entry function 'qmk_decode_multi_2' for 'sm_90'\n\
             ptxas info    : Function properties for qmk_decode_multi_2\n\
             ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        );
        let r = parse_ptxas_log(&log);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].stack_bytes, r[0].spill_stores), (8, 4));
        assert_eq!(
            (r[1].function.as_str(), r[1].stack_bytes),
            ("qmk_decode_multi_2", 16)
        );
    }
}
