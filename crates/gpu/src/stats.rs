//! The benchmarks' options and reports, and their statistics: what a step
//! must move (the floor), medians and percentiles, the prefill FLOP model.

use qmk_model::Config;

/// What a backend's `bench` runs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is reported).
    pub steps: usize,
    /// Token of position 0; later tokens are the kernel's own greedy picks
    /// (read on the device, no host round trip).
    pub first_token: u32,
    /// Size of the streaming-read buffer for the floor.
    pub stream_bytes: u64,
    /// Timed reads of that buffer (the median is the floor).
    pub stream_reps: usize,
    /// KV length the timed steps run at (`bench --context N`): the first
    /// timed step decodes position `max(context, warmup)`, after warm-up
    /// steps at the positions just before it. Positions below the first
    /// warm-up step hold synthetic KV values ([`KV_FILL_BF16`]). 0: start
    /// at position 0 (the short-context bench).
    pub context: usize,
    /// Extra `KernelParams::flags` bits for every step (A/B runs, e.g.
    /// `qmk_kernels::params::FLAG_ATTN_NO_SPLIT`).
    pub flags: u32,
}

/// `bench --profile`: (name, extra flags) of every variant, timed in the
/// same process at the same positions. Phase skips keep every barrier;
/// cost of a phase = full - skip. The A/B rows: attention without the
/// sequence split, and the split forced at any length (it is the default
/// from `ATTN_SPLIT_MIN_CONTEXT` on).
pub const PROFILE_VARIANTS: &[(&str, u32)] = {
    use qmk_kernels::params::{
        FLAG_ATTN_FORCE_SPLIT as FS, FLAG_ATTN_NO_SPLIT as NS, SKIP_SHIFT as K,
    };
    &[
        ("full", 0),
        ("barriers only", 63 << K),
        ("skip qkv_proj", 1 << K),
        ("skip attention", 2 << K),
        ("skip o_proj", 4 << K),
        ("skip mlp gate/up", 8 << K),
        ("skip mlp down", 16 << K),
        ("skip lm_head", 32 << K),
        ("full, attention no split", NS),
        ("skip attention, no split", NS | 2 << K),
        ("full, split forced", FS),
    ]
};

/// bf16 bits of the synthetic KV value a long-context bench fills the
/// cache with (0.0078125 = 2^-7: small, finite, so scores stay finite and
/// the softmax is well defined; never zeros to time).
pub const KV_FILL_BF16: u16 = 0x3C00;

/// The positions of a bench run: `(first, total)`: `total` steps decode
/// positions `first..first + total`, the last `opts.steps` of them timed.
pub fn bench_positions(opts: &BenchOptions) -> (usize, usize) {
    let total = opts.warmup + opts.steps;
    (opts.context.saturating_sub(opts.warmup), total)
}

/// KV-cache capacity a bench run needs ([`bench_positions`] + 1 spare).
pub fn bench_capacity(opts: &BenchOptions) -> Option<usize> {
    let (first, total) = bench_positions(opts);
    first.checked_add(total)?.checked_add(1)
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            warmup: 16,
            steps: 128,
            first_token: 9707,
            stream_bytes: 4 << 30,
            stream_reps: 10,
            context: 0,
            flags: 0,
        }
    }
}

/// Decode benchmark results, with the floor measured in the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// The device and its architecture.
    pub device: String,
    /// Tokens per second at the median step time.
    pub tok_per_s: f64,
    /// Median over the timed steps, device events.
    pub us_per_step: f64,
    /// 10th percentile step time, us.
    pub us_p10: f64,
    /// 90th percentile step time, us.
    pub us_p90: f64,
    /// Mean bytes one timed step must move.
    pub bytes_per_step: u64,
    /// bytes_per_step / us_per_step.
    pub gbps: f64,
    /// Streaming-read bandwidth, same cubin, same run.
    pub floor_gbps: f64,
    /// floor time / measured time, in percent.
    pub pct_of_floor: f64,
    /// Floor tok/s: floor_gbps / bytes_per_step.
    pub floor_tok_per_s: f64,
    /// Grid barriers per step, as the kernel counted them.
    pub barriers_per_step: u32,
    /// CTAs in the grid.
    pub grid: u32,
    /// CTAs per SM.
    pub ctas_per_sm: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Untimed steps.
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// `bench --context N` when given, else the last position decoded + 1.
    pub context: usize,
    /// First timed position.
    pub first_timed_pos: usize,
    /// Mean KV-cache bytes one timed step reads and writes (included in
    /// `bytes_per_step`).
    pub kv_bytes: u64,
}

/// Median (upper median for even lengths); sorts `v`. NaN for empty input.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Nearest-rank percentile `p` in 0..=1 of a sorted slice. NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize]
}

/// Mean bytes one timed step moves: the step's weights plus the KV cache
/// read (positions 0..=pos) and written (pos), averaged over positions
/// `warmup..warmup + steps`.
pub fn bench_bytes_per_step(
    config: &Config,
    weight_bytes_per_step: u64,
    warmup: usize,
    steps: usize,
) -> u64 {
    weight_bytes_per_step + bench_kv_bytes(config, warmup, steps)
}

/// Mean KV-cache bytes one step at positions `first..first + steps` reads
/// (K and V rows 0..=pos, every layer, bf16) and writes (row pos); the
/// integer mean (floor) of the exact sum, computed in u128.
pub fn bench_kv_bytes(config: &Config, first: usize, steps: usize) -> u64 {
    let kv_row = 2 * config.kv_dim() as u128 * config.num_hidden_layers as u128 * 2; // K and V, bf16
    let (a, n) = (first as u128, steps as u128);
    // sum over p in a..a+n of (p + 2) = n (a + 2) + n (n - 1) / 2
    let rows = n * (a + 2) + n * n.saturating_sub(1) / 2;
    u64::try_from(kv_row * rows / n.max(1)).unwrap_or(u64::MAX)
}

impl BenchReport {
    /// Assembles the report from per-step device times (microseconds).
    #[allow(clippy::too_many_arguments)]
    pub fn from_times(
        device: String,
        config: &Config,
        weight_bytes_per_step: u64,
        opts: &BenchOptions,
        mut us: Vec<f64>,
        floor_gbps: f64,
        barriers_per_step: u32,
        launch: &crate::plan::LaunchInfo,
    ) -> BenchReport {
        let us_med = median(&mut us);
        let (first, total) = bench_positions(opts);
        let first_timed = first + opts.warmup;
        let kv_bytes = bench_kv_bytes(config, first_timed, opts.steps);
        let bytes_per_step = weight_bytes_per_step.saturating_add(kv_bytes);
        let gbps = bytes_per_step as f64 / (us_med * 1e-6) / 1e9;
        BenchReport {
            device,
            tok_per_s: 1e6 / us_med,
            us_per_step: us_med,
            us_p10: percentile(&us, 0.1),
            us_p90: percentile(&us, 0.9),
            bytes_per_step,
            gbps,
            floor_gbps,
            pct_of_floor: 100.0 * gbps / floor_gbps,
            floor_tok_per_s: floor_gbps * 1e9 / bytes_per_step as f64,
            barriers_per_step,
            grid: launch.grid,
            ctas_per_sm: launch.ctas_per_sm,
            registers: launch.registers,
            warmup: opts.warmup,
            steps: opts.steps,
            context: if opts.context > 0 {
                opts.context
            } else {
                first + total
            },
            first_timed_pos: first_timed,
            kv_bytes,
        }
    }
}

/// Matrix FLOPs of a prefill of positions `start..start + n`: every layer's
/// projections for every position (2 x params x n), causal attention
/// (Q K^T and P V over positions 0..=p for each p: 4 x Q x (p + 1) per
/// layer) and the LM head for the last position only.
pub fn prefill_flops(config: &Config, start: usize, n: usize) -> f64 {
    let (h, i, q, kv) = (
        config.hidden_size as f64,
        config.intermediate_size as f64,
        config.q_dim() as f64,
        config.kv_dim() as f64,
    );
    let l = config.num_hidden_layers as f64;
    let per_token = 2.0 * l * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let (s, n_f) = (start as f64, n as f64);
    // sum over p in start..start+n of (p + 1)
    let ctx = n_f * s + n_f * (n_f + 1.0) / 2.0;
    per_token * n_f + 4.0 * l * q * ctx + 2.0 * config.vocab_size as f64 * h
}

/// Time to first token of the prefill kernel (`qwen-mk bench --prefill N`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillReport {
    /// The device and its architecture.
    pub device: String,
    /// Prompt length.
    pub tokens: usize,
    /// Positions per launch.
    pub chunk: u32,
    /// Kernel launches per prefill.
    pub launches: usize,
    /// Median over `reps` prefills of the whole prompt (device events
    /// around the launches: prompt ids already on the device).
    pub ms_median: f64,
    /// 10th percentile, ms.
    pub ms_p10: f64,
    /// 90th percentile, ms.
    pub ms_p90: f64,
    /// Timed prefills.
    pub reps: usize,
    /// [`prefill_flops`] / time.
    pub tflops: f64,
    /// CTAs in the prefill grid.
    pub grid: u32,
    /// Registers per thread of the prefill kernel.
    pub registers: u32,
    /// Dynamic shared memory per CTA, bytes.
    pub smem_bytes: u32,
    /// Grid barriers per launch, as the kernel counted them.
    pub barriers_per_launch: u32,
}

/// What one empty decode step costs: the megakernel launched with its real
/// parameter block and cooperative grid, at a position past the KV capacity,
/// so every CTA returns at once.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchOverhead {
    /// Launches timed per measure.
    pub launches: usize,
    /// Host time per launch when launches are queued back to back (host
    /// clock around the batch, closed by a stream synchronisation): the
    /// host-side cost of submitting one cooperative launch.
    pub submit_us: f64,
    /// Median host time of one launch + stream synchronisation.
    pub round_trip_us: f64,
    /// Median device time of one empty step (events).
    pub device_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_kv_bytes_and_positions() {
        let c7 = Config::preset("7b").unwrap();
        // K and V rows of every layer: 2 x 512 x 28 x 2 B = 57,344 B.
        let row = 2 * 512 * 28 * 2u64;
        // One step at position p reads p + 1 rows and writes one.
        assert_eq!(bench_kv_bytes(&c7, 0, 1), 2 * row);
        assert_eq!(bench_kv_bytes(&c7, 10, 1), 12 * row);
        // Mean over positions 8191..8191+200: rows p + 2.
        let brute: u64 = (8191..8191 + 200u64).map(|p| (p + 2) * row).sum::<u64>() / 200;
        assert_eq!(bench_kv_bytes(&c7, 8191, 200), brute);
        // 32k: about 1.9 GB per step.
        let kv32 = bench_kv_bytes(&c7, 32_768, 200);
        assert!(kv32 > 1_870_000_000 && kv32 < 1_890_000_000, "{kv32}");
        // The old helper is weights + the same KV mean.
        assert_eq!(
            bench_bytes_per_step(&c7, 1000, 16, 128),
            1000 + bench_kv_bytes(&c7, 16, 128)
        );
        // Positions: the timed steps start at max(context, warmup).
        let o = BenchOptions {
            warmup: 16,
            steps: 200,
            context: 8192,
            ..BenchOptions::default()
        };
        assert_eq!(bench_positions(&o), (8176, 216));
        assert_eq!(bench_capacity(&o), Some(8192 + 200 + 1));
        let short = BenchOptions {
            warmup: 16,
            steps: 200,
            ..BenchOptions::default()
        };
        assert_eq!(bench_positions(&short), (0, 216));
        assert_eq!(bench_capacity(&short), Some(217));
    }

    #[test]
    fn prefill_flop_model() {
        let c = Config::preset("7b").unwrap();
        // ~2 x 7.07e9 non-embedding params... per token, plus attention.
        let one = prefill_flops(&c, 0, 1);
        assert!((13.0e9..15.0e9).contains(&one), "{one}");
        let a = prefill_flops(&c, 0, 512);
        let b = prefill_flops(&c, 0, 256) + prefill_flops(&c, 256, 256);
        let lm = 2.0 * c.vocab_size as f64 * c.hidden_size as f64;
        assert!((a - (b - lm)).abs() < 1.0, "{a} vs {b}");
    }

    #[test]
    fn statistics() {
        let mut v = vec![3.0, 1.0, 2.0, 10.0];
        assert_eq!(median(&mut v), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 10.0);
        assert!(median(&mut []).is_nan());
    }
}
