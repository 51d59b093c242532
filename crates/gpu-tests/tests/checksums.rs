//! Per-step logit checksums of both drivers at 0.5B, 7B and 14B shapes
//! (synthetic weights), written as text lines to `$QMK_CHECKSUMS_OUT`
//! (default: stdout only). A run on an H200 is the record that later kernel
//! and host changes are compared against bit for bit: when the device is an
//! H200 and `data/logit-checksums-h200.txt` holds lines, every line this
//! test produces must equal the recorded line for its key (preset, case,
//! driver, step).

use std::collections::HashMap;
use std::io::Write;

use qmk_engine::Backend;
use qmk_gpu::{Driver, GpuBackend};
use qmk_gpu_tests::*;

/// FNV-1a over the logits' f32 bit patterns.
fn fnv(logits: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in logits {
        for b in x.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Deterministic prompt ids below `vocab`.
fn prompt(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

const STEPS: usize = 16;

/// The recorded H200 checksums.
const RECORD: &str = include_str!("../data/logit-checksums-h200.txt");

/// The key of a checksum line: everything before ` argmax=`.
fn key(line: &str) -> &str {
    line.split(" argmax=").next().unwrap_or(line)
}

/// The recorded lines by key (comments and blank lines skipped).
fn recorded() -> HashMap<&'static str, &'static str> {
    RECORD
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| (key(l), l))
        .collect()
}

/// Lines of `lines` that differ from (or are missing in) `record`.
fn mismatches<'a>(lines: &'a [String], record: &HashMap<&str, &str>) -> Vec<(&'a str, String)> {
    lines
        .iter()
        .filter_map(|l| match record.get(key(l)) {
            Some(&r) if r == l => None,
            Some(&r) => Some((l.as_str(), r.to_string())),
            None => Some((l.as_str(), "(not recorded)".to_string())),
        })
        .collect()
}

fn record<D: Driver>(preset: &str) {
    let test = format!("checksums {preset} {}", D::NAME);
    let Some(_gpu) = gpu_or_skip(&test) else {
        return;
    };
    let w = weights(preset);
    let vocab = w.config.vocab_size;
    let mut lines = Vec::new();
    let mut device = String::new();
    // 1 token: decode path; 17: prefill kernel (one chunk); 600: prefill
    // kernel with several tiles per GEMM.
    for (case, n) in [("p1", 1usize), ("p17", 17), ("p600", 600)] {
        let ids = prompt(n, vocab, n as u64);
        let mut b: GpuBackend<D> = open(&w, with_capacity(n + STEPS + 1));
        device = b.device().name.clone();
        let mut out = b.prefill(&ids, 0).unwrap();
        let l = b.logits().unwrap();
        lines.push(format!(
            "{preset} {case} {} step=prefill argmax={} fnv={:016x}",
            D::NAME,
            out.argmax,
            fnv(&l)
        ));
        for s in 0..STEPS {
            out = b.step(out.argmax, n + s).unwrap();
            let l = b.logits().unwrap();
            lines.push(format!(
                "{preset} {case} {} step={s} argmax={} fnv={:016x}",
                D::NAME,
                out.argmax,
                fnv(&l)
            ));
        }
    }
    for l in &lines {
        println!("CHECKSUM {l}");
    }
    if let Ok(path) = std::env::var("QMK_CHECKSUMS_OUT") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        for l in &lines {
            writeln!(f, "{l}").unwrap();
        }
    }
    let record = recorded();
    if record.is_empty() {
        println!("{test}: not compared: data/logit-checksums-h200.txt holds no record yet");
        return;
    }
    if !device.contains("H200") {
        println!("{test}: not compared: the record is from an H200, this is {device}");
        return;
    }
    let bad = mismatches(&lines, &record);
    assert!(
        bad.is_empty(),
        "{test}: {} of {} checksums differ from the H200 record; first ones:\n{}",
        bad.len(),
        lines.len(),
        bad.iter()
            .take(5)
            .map(|(got, want)| format!("  got  {got}\n  want {want}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!("{test}: {} checksums equal the H200 record", lines.len());
}

both!(a_0_5b, record, "0.5b");
both!(b_7b, record, "7b");
// 14B: a larger model's shapes (its own split plan, 5,120-wide rows).
both!(c_14b, record, "14b");

/// The comparison itself, on the CPU: equal lines pass, a changed hash and
/// a missing key are reported.
#[test]
fn record_comparison_finds_changed_and_missing_lines() {
    let rec: HashMap<&str, &str> = [
        "0.5b p1 cudarc step=0 argmax=5 fnv=00000000000000aa",
        "0.5b p1 cudarc step=1 argmax=7 fnv=00000000000000bb",
    ]
    .into_iter()
    .map(|l| (key(l), l))
    .collect();
    let lines = vec![
        "0.5b p1 cudarc step=0 argmax=5 fnv=00000000000000aa".to_string(),
        "0.5b p1 cudarc step=1 argmax=7 fnv=00000000000000bc".to_string(),
        "0.5b p1 cudarc step=2 argmax=7 fnv=00000000000000bb".to_string(),
    ];
    let bad = mismatches(&lines, &rec);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert_eq!(
        bad[0].1,
        "0.5b p1 cudarc step=1 argmax=7 fnv=00000000000000bb"
    );
    assert_eq!(bad[1].1, "(not recorded)");
    // The shipped record parses (comments skipped).
    for (k, l) in recorded() {
        assert!(l.starts_with(k) && l.contains(" fnv="), "{l}");
    }
}
