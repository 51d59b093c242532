//! CPU reference decode speed on the real Qwen2.5-Coder-0.5B-Instruct
//! checkpoint (directory in `QMK_REAL_QWEN`, built by
//! `scripts/fetch-real-qwen.sh`; skipped with a message when unset).
//!
//! `decode_step`: one `Reference::step` at position 32 after a 32-token
//! prefill (the same cache slot is rewritten every iteration, so every
//! sample does identical work). Throughput is reported in tokens/s.
//! `prefill_32`: one batched 32-token prefill.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use qmk_model::reference::{argmax, Reference, ReferenceOptions};

const PROMPT_LEN: usize = 32;

fn bench(c: &mut Criterion) {
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!(
            "cpu_reference bench SKIPPED: QMK_REAL_QWEN is not set (run \
             scripts/fetch-real-qwen.sh and point QMK_REAL_QWEN at its output)"
        );
        return;
    };
    let weights = Arc::new(qmk_model::load_weights(&dir).expect("load QMK_REAL_QWEN"));
    // Arbitrary in-vocabulary ids: the cost does not depend on them.
    let prompt: Vec<u32> = (0..PROMPT_LEN as u32).map(|i| 1000 + 37 * i).collect(); // [P]
    let mut r = Reference::new(weights, ReferenceOptions::new(PROMPT_LEN + 1)).unwrap();
    let next = argmax(&r.prefill(&prompt).unwrap());

    let mut g = c.benchmark_group("cpu_reference_0.5b");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(15));
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode_step", |b| {
        b.iter(|| black_box(r.step(black_box(next), PROMPT_LEN).unwrap()))
    });
    g.throughput(Throughput::Elements(PROMPT_LEN as u64));
    g.bench_function("prefill_32", |b| {
        b.iter(|| black_box(r.prefill(black_box(&prompt)).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
