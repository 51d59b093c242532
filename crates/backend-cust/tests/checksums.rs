//! Per-step logit checksums of both backends at 0.5B and 7B shapes
//! (synthetic weights), written as text lines to `$QMK_CHECKSUMS_OUT`
//! (default: stdout only). A run of this program on the H200 is the record
//! that later kernel and host changes are compared against bit for bit.

#[macro_use]
mod common;
use common::*;

use std::io::Write;

use qmk_engine::Backend;
use qmk_model::Weights;

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

trait Open: Backend + Sized {
    const NAME: &'static str;
    fn open(w: &Weights, capacity: usize) -> Self;
}
impl Open for qmk_backend_cudarc::CudarcBackend {
    const NAME: &'static str = "cudarc";
    fn open(w: &Weights, capacity: usize) -> Self {
        let opts = qmk_backend_cudarc::Options {
            capacity,
            ..Default::default()
        };
        Self::new(w, opts, &mut ()).unwrap()
    }
}
impl Open for qmk_backend_cust::CustBackend {
    const NAME: &'static str = "cust";
    fn open(w: &Weights, capacity: usize) -> Self {
        let opts = qmk_backend_cust::Options {
            capacity,
            ..Default::default()
        };
        Self::new(w, opts, &mut ()).unwrap()
    }
}

fn record<B: Open>(preset: &str) {
    let Some(_gpu) = gpu_or_skip("checksums") else {
        return;
    };
    let w = weights(preset);
    let vocab = w.config.vocab_size;
    let mut lines = Vec::new();
    // 1 token: decode path; 17: prefill kernel (one chunk); 600: prefill
    // kernel with several tiles per GEMM.
    for (case, n) in [("p1", 1usize), ("p17", 17), ("p600", 600)] {
        let ids = prompt(n, vocab, n as u64);
        let mut b = B::open(&w, n + STEPS + 1);
        let mut out = b.prefill(&ids, 0).unwrap();
        let l = b.logits().unwrap();
        lines.push(format!(
            "{preset} {case} {} step=prefill argmax={} fnv={:016x}",
            B::NAME,
            out.argmax,
            fnv(&l)
        ));
        for s in 0..STEPS {
            out = b.step(out.argmax, n + s).unwrap();
            let l = b.logits().unwrap();
            lines.push(format!(
                "{preset} {case} {} step={s} argmax={} fnv={:016x}",
                B::NAME,
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
}

both!(a_0_5b, record, "0.5b");
both!(b_7b, record, "7b");
