use half::bf16;
use qmk_model::reference::matmul;
use std::time::Instant;
#[test]
fn perf() {
    for &(t, n, k) in &[(1usize, 4864usize, 896usize), (8, 4864, 896), (40, 4864, 896), (1, 151936, 896), (8, 151936, 896)] {
        let x: Vec<f32> = (0..t * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i % 11) as f32 * 0.01)).collect();
        let mut out = vec![0f32; t * n];
        matmul(&x, &w, k, &mut out);
        let it = 5;
        let t0 = Instant::now();
        for _ in 0..it { matmul(&x, &w, k, &mut out); }
        let dt = t0.elapsed().as_secs_f64() / it as f64;
        eprintln!("T={t} N={n} K={k}: {:.2} ms, {:.1} GMAC/s, {:.1} GB/s weights", dt * 1e3, (t * n * k) as f64 / dt / 1e9, (n * k * 2) as f64 / dt / 1e9);
    }
}
