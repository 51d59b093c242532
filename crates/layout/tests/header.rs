//! The rendered kernel header: deterministic byte for byte, equal to the
//! checked-in golden file, and accepted (static_asserts included) by a real
//! C++ compiler when one is installed. Set `QMK_UPDATE_GOLDEN=1` to rewrite
//! the golden file after an intended format change, and
//! `QMK_HEADER_DUMP_DIR=dir` to write every preset's header there (to check
//! them with nvcc or NVRTC where CUDA is installed).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{header_consts, preset, stacked_specs, PRESETS};
use qmk_layout::{
    plan_model, render_header, try_render_header, ModelPlan, OffsetModel, OffsetUnit,
    KERNEL_OFFSET_MODEL,
};

fn plan_for(name: &str, model: &OffsetModel) -> ModelPlan {
    plan_model(&stacked_specs(&preset(name)), model).unwrap()
}

fn header_for(name: &str) -> String {
    let p = preset(name);
    render_header(&plan_for(name, &KERNEL_OFFSET_MODEL), &header_consts(&p))
}

/// The 14B `gate_proj` section, exactly.
const GATE_14B: &str = r#"// gate_proj: (48,13824,5120):(70778880,5120,1) bf16, 6794772480 bytes (6.79 GB), 2 chunks.
namespace gate_proj {
constexpr unsigned int kRank = 3u;
constexpr unsigned long long kShape[] = {48ull, 13824ull, 5120ull};
constexpr unsigned long long kStride[] = {70778880ull, 5120ull, 1ull};  // elements
constexpr unsigned long long kElemBytes = 2ull;  // bf16
constexpr unsigned long long kBytes = 6794772480ull;  // byte span of the stacked tensor
constexpr unsigned int kNumChunks = 2u;
// Chunk c holds layers [kChunkStart[c], kChunkStart[c + 1]).
constexpr unsigned int kChunkStart[] = {0u, 24u, 48u};
// Byte offset of chunk c in the stacked tensor (host side, 64-bit).
constexpr unsigned long long kChunkOffsetBytes[] = {0ull, 3397386240ull};
// Byte span of chunk c from its own base pointer.
constexpr unsigned long long kChunkBytes[] = {3397386240ull, 3397386240ull};
"#;

const GATE_14B_FUNCTIONS: &str = r#"QMK_PLAN_HD constexpr unsigned long long shape(unsigned int mode) { return mode < 1u ? 48ull : mode < 2u ? 13824ull : 5120ull; }
QMK_PLAN_HD constexpr unsigned long long stride(unsigned int mode) { return mode < 1u ? 70778880ull : mode < 2u ? 5120ull : 1ull; }
QMK_PLAN_HD constexpr unsigned int chunk_start(unsigned int chunk) { return chunk < 1u ? 0u : chunk < 2u ? 24u : 48u; }
QMK_PLAN_HD constexpr unsigned long long chunk_offset_bytes(unsigned int chunk) { return chunk < 1u ? 0ull : 3397386240ull; }
QMK_PLAN_HD constexpr unsigned long long chunk_bytes(unsigned int chunk) { return chunk < 1u ? 3397386240ull : 3397386240ull; }
QMK_PLAN_HD constexpr unsigned int chunk_of(unsigned int layer) { return layer < 24u ? 0u : 1u; }
QMK_PLAN_HD constexpr unsigned int local_layer(unsigned int layer) { return layer - chunk_start(chunk_of(layer)); }
"#;

#[test]
fn golden_snippet_14b_gate_proj() {
    let h = header_for("14B");
    assert!(h.contains(GATE_14B), "{h}");
    assert!(h.contains(GATE_14B_FUNCTIONS), "{h}");
    assert!(h.contains("constexpr unsigned int kOffsetBits = 32u;\n"));
    assert!(h.contains("constexpr unsigned int kOffsetUnitBytes = 1u;\n"));
    assert!(h.contains("constexpr unsigned long long kMaxOffset = 4294967295ull;"));
    assert!(h.contains("constexpr unsigned long long kHidden = 5120ull;\n"));
    assert!(!h.contains("#include"));
}

#[test]
fn rendering_is_deterministic() {
    for p in &PRESETS {
        let a = header_for(p.name);
        let b = header_for(p.name);
        assert_eq!(a, b, "{}", p.name);
        // From an independently built plan, too.
        let again = plan_model(&stacked_specs(p), &KERNEL_OFFSET_MODEL).unwrap();
        assert_eq!(render_header(&again, &header_consts(p)), a, "{}", p.name);
        assert_eq!(try_render_header(&again, &header_consts(p)).unwrap(), a);
    }
}

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/qwen2.5-14b.h")
}

#[test]
fn golden_file_14b() {
    let h = header_for("14B");
    let path = golden_path();
    if std::env::var_os("QMK_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &h).unwrap();
    }
    let golden = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (QMK_UPDATE_GOLDEN=1 writes it)", path.display()));
    assert!(
        h == golden,
        "header differs from {}; QMK_UPDATE_GOLDEN=1 rewrites it",
        path.display()
    );
}

/// The C++ compiler to check headers with, if any.
fn cxx() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let ok = Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(cxx)
}

/// Compiles a translation unit that includes `header` twice (it must be
/// idempotent) and then `code` (C++17, warnings as errors); the compiler's
/// stderr on failure.
fn compile(cxx: &str, tag: &str, header: &str, code: &str) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("qmk-layout-header-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("qmk_plan.h"), header).unwrap();
    let main = dir.join("main.cpp");
    let source = format!(
        "#include \"qmk_plan.h\"\n#include \"qmk_plan.h\"\n{code}\nint main() {{ return 0; }}\n"
    );
    std::fs::write(&main, source).unwrap();
    let out = Command::new(cxx)
        .args([
            "-std=c++17",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
        ])
        .arg(&main)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Uses the helpers in constant expressions.
const USE_GATE: &str = r#"namespace g = qmk_plan::gate_proj;
static_assert(g::chunk_of(g::kChunkStart[g::kNumChunks - 1u]) == g::kNumChunks - 1u, "chunk_of");
static_assert(g::local_layer(g::kChunkStart[g::kNumChunks - 1u] + 1u) == 1u, "local_layer");
static_assert(g::local_layer(qmk_plan::kNumLayers - 1u) + 1u == g::kChunkStart[g::kNumChunks] - g::kChunkStart[g::kNumChunks - 1u], "last layer");
static_assert(qmk_plan::q_proj::chunk_start(qmk_plan::q_proj::chunk_of(5u)) <= 5u, "q_proj");
"#;

#[test]
fn every_preset_header_compiles() {
    let Some(cxx) = cxx() else {
        eprintln!("SKIPPED: no C++ compiler (set CXX) to check the rendered headers");
        return;
    };
    let models = [
        KERNEL_OFFSET_MODEL,
        OffsetModel::new(31, OffsetUnit::Bytes),
        OffsetModel::new(32, OffsetUnit::Elements),
        OffsetModel::new(28, OffsetUnit::Vector { bytes: 16 }),
        OffsetModel::new(64, OffsetUnit::Bytes),
    ];
    for p in &PRESETS {
        for model in &models {
            let h = render_header(&plan_for(p.name, model), &header_consts(p));
            // For checking with nvcc / NVRTC on a machine that has them.
            if let Some(dir) = std::env::var_os("QMK_HEADER_DUMP_DIR") {
                let file = format!(
                    "qwen2.5-{}-{}bit-unit{}.h",
                    p.name.to_lowercase(),
                    model.bits,
                    model.unit_bytes()
                );
                std::fs::write(Path::new(&dir).join(file), &h).unwrap();
            }
            compile(&cxx, &format!("{}-{}", p.name, model.bits), &h, USE_GATE)
                .unwrap_or_else(|e| panic!("{} under {model}:\n{e}", p.name));
        }
    }
}

/// The static_asserts bite: a header edited to disagree with itself, or with
/// the offset width, does not compile.
#[test]
fn corrupted_headers_do_not_compile() {
    let Some(cxx) = cxx() else {
        eprintln!("SKIPPED: no C++ compiler (set CXX) to check the rendered headers");
        return;
    };
    let h = header_for("14B");
    let cases = [
        // A chunk span that is not the layout's.
        (
            "span",
            h.replacen(
                "{3397386240ull, 3397386240ull}",
                "{3397386240ull, 3397386241ull}",
                1,
            ),
            "chunk 1: span disagrees",
        ),
        // Chunks moved without updating chunk_of.
        (
            "start",
            h.replacen("{0u, 24u, 48u}", "{0u, 23u, 48u}", 1),
            "gate_proj chunk 0",
        ),
        // The seed's bug: 14B's gate unsplit under 32-bit offsets.
        (
            "unsplit",
            {
                let unsplit = plan_for("14B", &OffsetModel::new(33, OffsetUnit::Bytes));
                render_header(&unsplit, &[])
                    .replacen("kOffsetBits = 33u", "kOffsetBits = 32u", 1)
                    .replacen(
                        "kMaxOffset = 8589934591ull",
                        "kMaxOffset = 4294967295ull",
                        1,
                    )
            },
            "gate_proj chunk 0: offsets overflow kOffsetBits",
        ),
        // A width that does not match kMaxOffset.
        (
            "bits",
            h.replacen("kOffsetBits = 32u", "kOffsetBits = 31u", 1),
            "kMaxOffset is not",
        ),
    ];
    for (tag, src, expect) in cases {
        assert_ne!(src, h, "{tag}: the edit did not apply");
        let err = compile(&cxx, tag, &src, "").expect_err(tag);
        assert!(
            err.contains(expect),
            "{tag}: expected `{expect}` in:\n{err}"
        );
    }
    // And the untouched header does compile.
    compile(&cxx, "ok", &h, USE_GATE).unwrap();
}
