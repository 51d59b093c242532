//! Compiles the megakernel with NVRTC for sm_80, sm_89 and sm_90 for every
//! preset and prints registers, spills and shared memory per arch. Needs no
//! GPU. Skips (saying why) when NVRTC is absent, unless QMK_REQUIRE_NVRTC=1.

use qmk_kernels::{Arch, Compiler, KernelBuild};
use qmk_model::Config;

fn compiler() -> Option<Compiler> {
    match Compiler::new() {
        Ok(c) => Some(c.cache_dir(None)),
        Err(e) => {
            if std::env::var("QMK_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("QMK_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}");
            }
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

#[test]
fn megakernel_compiles_for_every_preset_and_arch() {
    let Some(c) = compiler() else { return };
    let (maj, min) = c.nvrtc().version();
    println!("NVRTC {maj}.{min} from {}", c.nvrtc().path().display());
    // Every preset on every arch, then the tensor-core phases where they
    // run (7B up, sm_90).
    let jobs: Vec<(&str, Arch, bool)> = ["0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b"]
        .into_iter()
        .flat_map(|preset| Arch::CI.into_iter().map(move |arch| (preset, arch, false)))
        .chain(["7b", "14b", "32b", "72b"].map(|p| (p, Arch::SM90, true)))
        .collect();
    // The compiles are independent and single-threaded each: one per core
    // (CI's two cores take about half the time of one after another).
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let reports: Vec<std::sync::Mutex<String>> = jobs.iter().map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(preset, arch, tc)) = jobs.get(i) else {
                    break;
                };
                *reports[i].lock().unwrap() = compile_report(&c, preset, arch, tc);
            });
        }
    });
    for r in reports {
        print!("{}", r.into_inner().unwrap());
    }
}

/// Compiles `preset` for `arch` and describes its kernels' resources
/// (panics naming both on failure).
fn compile_report(c: &Compiler, preset: &str, arch: Arch, tensor_cores: bool) -> String {
    let config = Config::preset(preset).unwrap();
    let build = KernelBuild::new(&config)
        .unwrap()
        .with_tensor_cores(tensor_cores)
        .unwrap();
    assert_eq!(
        build.tensor_core_phases(arch).is_some(),
        tensor_cores,
        "{preset} {arch}"
    );
    let tc = if tensor_cores { " tc" } else { "" };
    let cubin = c
        .compile(&build, arch)
        .unwrap_or_else(|e| panic!("{preset} {arch}: {e}"));
    assert!(!cubin.bytes.is_empty());
    let res = cubin.resources();
    let main = res
        .iter()
        .find(|r| r.function == "qmk_decode_step")
        .unwrap_or_else(|| panic!("{preset} {arch}: no ptxas report:\n{}", cubin.log));
    let mut out = format!(
        "{preset:>5} {arch}{tc}: {} regs, {} B spill st, {} B spill ld, {} B stack, {} B static smem + {} B dynamic, {} barriers/step\n",
        main.registers,
        main.spill_stores,
        main.spill_loads,
        main.stack_bytes,
        main.smem_bytes,
        build.smem_for(arch),
        build.barriers_per_step
    );
    for r in res.iter().filter(|r| r.function != "qmk_decode_step") {
        out += &format!("        {r}\n");
    }
    out
}

#[test]
fn cache_hits_on_the_second_compile() {
    let Some(c) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let c = c.cache_dir(Some(dir.path().to_path_buf()));
    let build = KernelBuild::new(&Config::preset("0.5b").unwrap()).unwrap();
    let a = c.compile(&build, Arch::SM90).unwrap();
    assert!(!a.from_cache);
    let b = c.compile(&build, Arch::SM90).unwrap();
    assert!(b.from_cache);
    // The backend refuses a cubin built for another model by this symbol.
    assert!(a.bytes.windows(15).any(|w| w == b"qmk_fingerprint"));
    assert_eq!(a.bytes, b.bytes);
    assert_eq!(a.resources(), b.resources());
    // A different arch is a different key.
    assert_ne!(
        c.cache_key(&build, Arch::SM80),
        c.cache_key(&build, Arch::SM90)
    );
}

#[test]
fn a_broken_plan_fails_to_compile_with_the_tensor_named() {
    let Some(c) = compiler() else { return };
    let config = Config::preset("0.5b").unwrap();
    let mut build = KernelBuild::new(&config).unwrap();
    // A parameter block that disagrees with the C++ twin must not compile.
    build.params_check = build
        .params_check
        .replace("qmk_off_Params_pos() == ", "qmk_off_Params_pos() == 4 + ");
    let err = c.compile(&build, Arch::SM90).unwrap_err().to_string();
    assert!(err.contains("qmk::Params::pos"), "{err}");
}

/// The prefill kernel is in every cubin: its ptxas report for the 0.5B and
/// 7B shapes on sm_90 (`-- --nocapture` prints it).
#[test]
fn prefill_kernel_is_in_the_cubin() {
    let Some(c) = compiler() else { return };
    for preset in ["0.5b", "7b"] {
        let build = KernelBuild::new(&Config::preset(preset).unwrap()).unwrap();
        let cubin = c.compile(&build, Arch::SM90).unwrap();
        let r = cubin
            .resources()
            .into_iter()
            .find(|r| r.function == qmk_kernels::source::entry::PREFILL_CHUNK)
            .unwrap_or_else(|| panic!("{preset}: no prefill kernel in the ptxas report"));
        println!(
            "{preset:>5} sm_90a prefill: {r}, + {} B dynamic smem, {} barriers/chunk",
            build.prefill_smem_for(Arch::SM90),
            build.prefill_barriers
        );
        assert!(r.registers > 0 && r.registers <= 128, "{r}");
    }
}

/// A tensor-parallel rank's build compiles with its exchanges, holds the
/// one-token step only (no prefill, no multi-token entries) and keeps the
/// decode step's registers within the cap.
#[test]
fn rank_builds_compile_with_the_decode_step_only() {
    let Some(c) = compiler() else { return };
    let jobs = [
        ("0.5b", 2, Arch::SM90),
        ("72b", 8, Arch::SM90),
        ("32b", 4, Arch::SM80),
    ];
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(preset, ranks, arch)| {
                let c = &c;
                s.spawn(move || {
                    let config = Config::preset(preset).unwrap();
                    let build = KernelBuild::for_rank(&config, ranks).unwrap();
                    let cubin = c
                        .compile(&build, arch)
                        .unwrap_or_else(|e| panic!("{preset} TP {ranks} {arch}: {e}"));
                    let res = cubin.resources();
                    let names: Vec<&str> = res.iter().map(|r| r.function.as_str()).collect();
                    let step = res
                        .iter()
                        .find(|r| r.function == "qmk_decode_step")
                        .unwrap_or_else(|| {
                            panic!("{preset} TP {ranks}: no decode step: {names:?}")
                        });
                    assert!(
                        !names.iter().any(|n| n.starts_with("qmk_decode_multi")
                            || *n == qmk_kernels::source::entry::PREFILL_CHUNK),
                        "{preset} TP {ranks}: {names:?}"
                    );
                    assert!(step.registers > 0 && step.registers <= 128, "{step}");
                    println!(
                        "{preset:>5} TP {ranks} {arch}: {step}, {} barriers/step",
                        build.barriers_per_step
                    );
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}
