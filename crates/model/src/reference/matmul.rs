//! `out = x · wᵀ` over bf16 weights with f32 accumulation: the one hot loop of
//! the CPU reference, and so the only code here written for speed.
//!
//! The arithmetic, whatever the path: each output `out[t, n]` is summed over
//! `k` in 16 interleaved lanes (lane `i` takes `k ≡ i mod 16`), the lanes are
//! added in a fixed tree (`i + 8`, `i + 4`, `i + 2`, `i + 1`), then the
//! `K mod 16` tail in order. So a row's result does not depend on the thread
//! count or on which other rows share the call (batch invariance). The AVX2
//! path fuses multiply-adds (FMA), so it differs from the portable path in
//! the last bits; it is picked at run time when the CPU has AVX2 and FMA.
//!
//! Work split: rayon tasks over blocks of weight rows; inside a task, tiles
//! of a few weight rows × a few input rows keep their accumulators in
//! registers, so each widened weight chunk serves several input rows (prefill
//! and batched decode are compute-bound, decode is memory-bound).

use half::bf16;
use rayon::prelude::*;

/// Interleaved accumulators per dot product (two 8-lane AVX2 registers).
const LANES: usize = 16;
/// Weight rows per rayon task at least (keeps scheduling overhead small).
const ROWS_PER_TASK: usize = 32;
/// Input rows per pass over the weights: bounds the `x` block a tile streams
/// (64 rows x K f32 stays in L2) when a long prompt is prefilled.
const T_BLOCK: usize = 64;

/// bf16 is the top half of an f32: widening is exact (a shift).
#[inline(always)]
fn widen(w: bf16) -> f32 {
    f32::from_bits(u32::from(w.to_bits()) << 16)
}

/// Sums 16 lanes in the fixed tree order described in the module docs.
#[inline(always)]
fn sum_lanes(mut v: [f32; LANES]) -> f32 {
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            v[i] += v[i + n];
        }
    }
    v[0]
}

/// Portable dot product of `x` `[K]` and `w` `[K]`, in the common order.
fn dot_portable(x: &[f32], w: &[bf16]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut xc = x.chunks_exact(LANES);
    let mut wc = w.chunks_exact(LANES);
    for (xs, ws) in (&mut xc).zip(&mut wc) {
        for i in 0..LANES {
            acc[i] += xs[i] * widen(ws[i]);
        }
    }
    let mut s = sum_lanes(acc);
    for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
        s += a * widen(*b);
    }
    s
}

/// Portable block: `out_t[n, t] = x[t] · w[n]`.
///
/// * `x` `[T, K]`, `w` `[nb, K]`, `out_t` `[nb, T]`
fn block_portable(x: &[f32], w: &[bf16], k: usize, out_t: &mut [f32]) {
    let t = x.len() / k;
    for (wn, on) in w.chunks_exact(k).zip(out_t.chunks_exact_mut(t)) {
        for (xt, o) in x.chunks_exact(k).zip(on) {
            *o = dot_portable(xt, wn);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The same sums with AVX2 + FMA intrinsics, tiled over rows.
    use std::arch::x86_64::*;

    use half::bf16;

    // Loads go through arrays and `transmute` rather than raw pointers:
    // tests run with debug assertions, whose pointer precondition checks
    // would otherwise sit in the inner loop and spill every load.

    /// `s[..8]` as a vector.
    #[inline(always)]
    fn load8(s: &[f32]) -> __m256 {
        let a: [f32; 8] = s[..8].try_into().unwrap();
        // SAFETY: [f32; 8] and __m256 are both 32 plain bytes.
        unsafe { std::mem::transmute::<[f32; 8], __m256>(a) }
    }

    /// `s[..8]` widened from bf16 to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen8(s: &[bf16]) -> __m256 {
        let a: [bf16; 8] = s[..8].try_into().unwrap();
        // SAFETY: [bf16; 8] and __m128i are both 16 plain bytes.
        let h = std::mem::transmute::<[bf16; 8], __m128i>(a);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    /// Lanes 0..8 in `lo`, 8..16 in `hi`, summed in `sum_lanes`' tree order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum16(lo: __m256, hi: __m256) -> f32 {
        let v = _mm256_add_ps(lo, hi); // lane i + lane i+8
        let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v)); // + i+4
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v)); // + i+2
        let v = _mm_add_ss(v, _mm_movehdup_ps(v)); // + i+1
        _mm_cvtss_f32(v)
    }

    /// A `RW` weight rows x `RT` input rows tile:
    /// `out_t[(r0 + i) * t + t0 + j] = x[t0 + j] · w[r0 + i]`.
    ///
    /// * `x` `[T, K]`, `w` `[nb, K]`, `out_t` `[nb, T]`
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn tile<const RW: usize, const RT: usize>(
        x: &[f32],
        w: &[bf16],
        k: usize,
        r0: usize,
        t0: usize,
        t: usize,
        out_t: &mut [f32],
    ) {
        let wr: [&[bf16]; RW] = std::array::from_fn(|i| &w[(r0 + i) * k..(r0 + i + 1) * k]);
        let xr: [&[f32]; RT] = std::array::from_fn(|j| &x[(t0 + j) * k..(t0 + j + 1) * k]);
        let mut acc = [[[_mm256_setzero_ps(); 2]; RT]; RW]; // [RW, RT, 16 lanes]
        let full = k / 16 * 16;
        let mut c = 0;
        while c < full {
            for i in 0..RW {
                let ws = &wr[i][c..c + 16];
                let (w0, w1) = (widen8(ws), widen8(&ws[8..]));
                for j in 0..RT {
                    let xs = &xr[j][c..c + 16];
                    acc[i][j][0] = _mm256_fmadd_ps(load8(xs), w0, acc[i][j][0]);
                    acc[i][j][1] = _mm256_fmadd_ps(load8(&xs[8..]), w1, acc[i][j][1]);
                }
            }
            c += 16;
        }
        for i in 0..RW {
            for j in 0..RT {
                let mut s = sum16(acc[i][j][0], acc[i][j][1]);
                for (a, b) in xr[j][full..].iter().zip(&wr[i][full..]) {
                    s = a.mul_add(super::widen(*b), s);
                }
                out_t[(r0 + i) * t + t0 + j] = s;
            }
        }
    }

    /// The AVX2 block: `out_t[n, t] = x[t] · w[n]`.
    ///
    /// * `x` `[T, K]`, `w` `[nb, K]`, `out_t` `[nb, T]`
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(x: &[f32], w: &[bf16], k: usize, out_t: &mut [f32]) {
        let t = x.len() / k;
        let nb = w.len() / k;
        let mut r0 = 0;
        if t == 1 {
            // Decode: 4 rows share each x chunk; bound by reading weights.
            while r0 + 4 <= nb {
                tile::<4, 1>(x, w, k, r0, 0, t, out_t);
                r0 += 4;
            }
        } else {
            // Prefill / batched: 2 weight rows x 3 input rows = 6 sums of 2
            // registers each; 12 accumulators + 2 widened weights fit in
            // AVX2's 16 registers.
            while r0 + 2 <= nb {
                let mut t0 = 0;
                while t0 + 3 <= t {
                    tile::<2, 3>(x, w, k, r0, t0, t, out_t);
                    t0 += 3;
                }
                while t0 < t {
                    tile::<2, 1>(x, w, k, r0, t0, t, out_t);
                    t0 += 1;
                }
                r0 += 2;
            }
        }
        for r in r0..nb {
            for t0 in 0..t {
                tile::<1, 1>(x, w, k, r, t0, t, out_t);
            }
        }
    }
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[t, n] = Σ_k x[t, k] · w[n, k]`, i.e. `x · wᵀ` as `nn.Linear` does.
///
/// * `x`   `[T, K]` f32 activations
/// * `w`   `[N, K]` bf16 weights (row-major, PyTorch `[out, in]`)
/// * `out` `[T, N]` f32
///
/// Panics if the lengths are not multiples of `k` or disagree (callers size
/// every buffer from the config; a mismatch is a bug, not an input error).
pub fn matmul(x: &[f32], w: &[bf16], k: usize, out: &mut [f32]) {
    assert!(
        k > 0 && x.len() % k == 0 && w.len() % k == 0,
        "matmul: bad K"
    );
    let t = x.len() / k;
    let n = w.len() / k;
    assert_eq!(out.len(), t * n, "matmul: out is not [T, N]");
    if t == 0 || n == 0 {
        return;
    }
    let fma = has_avx2_fma();
    let run = |xb: &[f32], wb: &[bf16], ob: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if fma {
            // SAFETY: AVX2 and FMA were detected on this CPU above.
            unsafe { avx2::block(xb, wb, k, ob) };
            return;
        }
        let _ = fma;
        block_portable(xb, wb, k, ob)
    };
    if t == 1 {
        // outᵀ `[N, 1]` is `out` itself.
        out.par_chunks_mut(ROWS_PER_TASK)
            .zip(w.par_chunks(ROWS_PER_TASK * k))
            .for_each(|(o, wb)| run(x, wb, o));
        return;
    }
    for (xb, ob) in x.chunks(T_BLOCK * k).zip(out.chunks_mut(T_BLOCK * n)) {
        let tb = xb.len() / k;
        let mut out_t = vec![0f32; n * tb]; // [N, tb]
        out_t
            .par_chunks_mut(ROWS_PER_TASK * tb)
            .zip(w.par_chunks(ROWS_PER_TASK * k))
            .for_each(|(o, wb)| run(xb, wb, o));
        // [N, tb] -> [tb, N]
        ob.par_chunks_mut(n).enumerate().for_each(|(ti, row)| {
            for (ni, v) in row.iter_mut().enumerate() {
                *v = out_t[ni * tb + ti];
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[bf16], k: usize) -> Vec<f32> {
        let t = x.len() / k;
        let n = w.len() / k;
        let mut out = vec![0f32; t * n];
        for ti in 0..t {
            for ni in 0..n {
                let mut s = 0f64;
                for ki in 0..k {
                    s += f64::from(x[ti * k + ki]) * f64::from(w[ni * k + ki].to_f32());
                }
                out[ti * n + ni] = s as f32;
            }
        }
        out
    }

    fn data(t: usize, n: usize, k: usize) -> (Vec<f32>, Vec<bf16>) {
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 11 % 17) as f32 - 8.0) / 7.0))
            .collect();
        (x, w)
    }

    #[test]
    fn matches_naive_for_odd_shapes() {
        // K with a tail past the lanes; N and T not multiples of any tile;
        // T past one T_BLOCK.
        for &(t, n, k) in &[
            (1, 1, 1),
            (1, 37, 21),
            (3, 37, 21),
            (1, 133, 64),
            (5, 70, 100),
            (7, 9, 48),
            (T_BLOCK + 5, 11, 40),
        ] {
            let (x, w) = data(t, n, k);
            let mut out = vec![0f32; t * n];
            matmul(&x, &w, k, &mut out);
            let want = naive(&x, &w, k);
            for (a, b) in out.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{t}x{n}x{k}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_batch() {
        // Batch invariance: row t of a T-row call equals a 1-row call, bit
        // for bit (same lanes, same tree, same tail order on every path).
        let (t, n, k) = (7, 45, 100);
        let (x, w) = data(t, n, k);
        let mut all = vec![0f32; t * n];
        matmul(&x, &w, k, &mut all);
        for ti in 0..t {
            let mut one = vec![0f32; n];
            matmul(&x[ti * k..(ti + 1) * k], &w, k, &mut one);
            assert_eq!(&all[ti * n..(ti + 1) * n], &one[..], "row {ti}");
        }
    }

    #[test]
    fn portable_path_is_the_same_sum_order() {
        let (t, n, k) = (3, 10, 75);
        let (x, w) = data(t, n, k);
        let mut a = vec![0f32; t * n];
        let mut out_t = vec![0f32; n * t];
        matmul(&x, &w, k, &mut a);
        block_portable(&x, &w, k, &mut out_t);
        for ti in 0..t {
            for ni in 0..n {
                let (p, q) = (a[ti * n + ni], out_t[ni * t + ti]);
                // Equal up to FMA rounding.
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
            }
        }
    }
}
