//! The decode step's timeline (`bench --profile`): with
//! [`qmk_kernels::params::FLAG_TRACE`] thread 0 of every CTA stamps its
//! start, each grid barrier's arrival and release, and (CTA 0) the step's
//! end with the device's global nanosecond timer. [`StepTrace`] holds one
//! step's stamps; [`Timeline`] splits steps into time per op kind.
//!
//! How a step is split: with `L_k` the last arrival at barrier `k` and `R_k`
//! the last release from it (`R_0`: the last CTA's start), barrier `k`'s op
//! takes `L_k - R_(k-1)` (from the last CTA leaving the previous barrier to
//! the last CTA arriving: the op's critical path) and the barrier
//! `R_k - L_k` (from the last arrival to the last release). The ops, the
//! barriers, the launch skew (first start to last start) and the tail after
//! the last barrier (the argmax on CTA 0) add up to the step, first start to
//! end. The mean time a CTA spends inside the op (`arrival - its own
//! release`) against the op's critical path shows the load imbalance.

use crate::error::{Error, Result};

/// Names of the five ops a layer's barriers close, in order.
const LAYER_OPS: [&str; 5] = ["qkv_proj", "attention", "o_proj", "mlp gate/up", "mlp down"];

/// One decode step's stamps, `%globaltimer` nanoseconds: `[grid, B + 1, 2]`
/// u64 with B grid barriers: slot 0 is (start, end; end on CTA 0 only),
/// slot k (arrival, release) of barrier k.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTrace {
    grid: u32,
    barriers: u32,
    // [grid, barriers + 1, 2] ns
    raw: Vec<u64>,
}

/// Time of one barrier's op and of the barrier itself in one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpSpan {
    /// Which op: the index into [`Timeline::OPS`].
    pub op: usize,
    /// Layer of the op (the LM head: the number of layers).
    pub layer: u32,
    /// Last release of the previous barrier to the last arrival, ns.
    pub critical_ns: u64,
    /// Mean over CTAs of (arrival - own release of the previous barrier), ns.
    pub busy_mean_ns: f64,
    /// Last arrival to last release, ns.
    pub barrier_ns: u64,
}

impl StepTrace {
    /// Wraps the buffer the kernel wrote; its length must be
    /// `grid * (barriers + 1) * 2`.
    pub fn from_raw(grid: u32, barriers: u32, raw: Vec<u64>) -> Result<Self> {
        let want = (grid as usize)
            .checked_mul(barriers as usize + 1)
            .and_then(|n| n.checked_mul(2));
        if grid == 0 || barriers == 0 || want != Some(raw.len()) {
            return Err(Error::Option {
                field: "trace",
                reason: format!(
                    "{} stamps do not fit a grid of {grid} CTAs with {barriers} barriers",
                    raw.len()
                ),
            });
        }
        Ok(Self {
            grid,
            barriers,
            raw,
        })
    }

    /// CTAs in the grid.
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// Grid barriers in the step.
    pub fn barriers(&self) -> u32 {
        self.barriers
    }

    fn at(&self, cta: u32, slot: u32, i: usize) -> u64 {
        self.raw[(cta as usize * (self.barriers as usize + 1) + slot as usize) * 2 + i]
    }

    /// When CTA `cta` started.
    pub fn start(&self, cta: u32) -> u64 {
        self.at(cta, 0, 0)
    }

    /// When CTA `cta` arrived at barrier `k` (1-based).
    pub fn arrival(&self, cta: u32, k: u32) -> u64 {
        self.at(cta, k, 0)
    }

    /// When CTA `cta` left barrier `k` (1-based).
    pub fn release(&self, cta: u32, k: u32) -> u64 {
        self.at(cta, k, 1)
    }

    /// When CTA 0 finished the step (after the argmax).
    pub fn end(&self) -> u64 {
        self.at(0, 0, 1)
    }

    /// Checks what any step must satisfy, up to `slack_ns` of timer skew
    /// between multiprocessors: every CTA's stamps are in order, no CTA
    /// leaves a barrier before the last one arrived, and the end comes
    /// after CTA 0's last release. Returns the first violation.
    pub fn check(&self, slack_ns: u64) -> std::result::Result<(), String> {
        let b = self.barriers;
        for c in 0..self.grid {
            let mut prev = self.start(c);
            if prev == 0 {
                return Err(format!("CTA {c} has no start stamp"));
            }
            for k in 1..=b {
                let (a, r) = (self.arrival(c, k), self.release(c, k));
                if a < prev || r < a {
                    return Err(format!(
                        "CTA {c}, barrier {k}: arrival {a} / release {r} out of order after {prev}"
                    ));
                }
                prev = r;
            }
        }
        for k in 1..=b {
            let last_in = (0..self.grid)
                .map(|c| self.arrival(c, k))
                .max()
                .unwrap_or(0);
            for c in 0..self.grid {
                if self.release(c, k) + slack_ns < last_in {
                    return Err(format!(
                        "CTA {c} left barrier {k} at {} before the last arrival at {last_in}",
                        self.release(c, k)
                    ));
                }
            }
        }
        if self.end() < self.release(0, b) {
            return Err(format!(
                "the end {} comes before CTA 0's last release {}",
                self.end(),
                self.release(0, b)
            ));
        }
        Ok(())
    }

    /// The op and barrier time of every barrier, in order (module docs).
    pub fn spans(&self) -> Vec<OpSpan> {
        let g = self.grid;
        let mut prev_release: Vec<u64> = (0..g).map(|c| self.start(c)).collect();
        let mut r_prev = prev_release.iter().copied().max().unwrap_or(0);
        let mut out = Vec::with_capacity(self.barriers as usize);
        for k in 1..=self.barriers {
            let l_k = (0..g).map(|c| self.arrival(c, k)).max().unwrap_or(0);
            let r_k = (0..g).map(|c| self.release(c, k)).max().unwrap_or(0);
            let busy: f64 = (0..g)
                .map(|c| self.arrival(c, k).saturating_sub(prev_release[c as usize]) as f64)
                .sum::<f64>()
                / f64::from(g);
            let (op, layer) = if k == self.barriers {
                (LAYER_OPS.len(), (k - 1) / 5)
            } else {
                (((k - 1) % 5) as usize, (k - 1) / 5)
            };
            out.push(OpSpan {
                op,
                layer,
                critical_ns: l_k.saturating_sub(r_prev),
                busy_mean_ns: busy,
                barrier_ns: r_k.saturating_sub(l_k),
            });
            for c in 0..g {
                prev_release[c as usize] = self.release(c, k);
            }
            r_prev = r_k;
        }
        out
    }

    /// First start to last start, ns.
    pub fn launch_skew_ns(&self) -> u64 {
        let starts = (0..self.grid).map(|c| self.start(c));
        let (lo, hi) = starts.fold((u64::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
        hi.saturating_sub(lo)
    }

    /// The last release of the last barrier to the end (the argmax), ns.
    pub fn tail_ns(&self) -> u64 {
        let r = (0..self.grid)
            .map(|c| self.release(c, self.barriers))
            .max()
            .unwrap_or(0);
        self.end().saturating_sub(r)
    }

    /// First start to end, ns.
    pub fn total_ns(&self) -> u64 {
        let first = (0..self.grid).map(|c| self.start(c)).min().unwrap_or(0);
        self.end().saturating_sub(first)
    }

    /// The smallest positive difference between two of the step's stamps:
    /// an upper bound on the timer's resolution.
    pub fn tick_ns(&self) -> u64 {
        let mut t: Vec<u64> = self.raw.iter().copied().filter(|&x| x != 0).collect();
        t.sort_unstable();
        t.windows(2)
            .map(|w| w[1] - w[0])
            .filter(|&d| d > 0)
            .min()
            .unwrap_or(0)
    }
}

/// One row of a [`Timeline`]: an op kind, summed over the layers of a
/// step, the median over the traced steps.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// The op kind ([`Timeline::OPS`]).
    pub name: &'static str,
    /// Its critical path, us per step.
    pub critical_us: f64,
    /// The mean CTA's time inside it, us per step.
    pub busy_mean_us: f64,
    /// The barriers after it, us per step.
    pub barrier_us: f64,
}

/// Where a decode step's time goes, per op kind (module docs), the median
/// of each figure over the traced steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Steps traced.
    pub steps: usize,
    /// One row per op kind, in [`Timeline::OPS`] order.
    pub rows: Vec<TimelineRow>,
    /// First CTA start to last, us.
    pub launch_skew_us: f64,
    /// After the last barrier (the argmax on CTA 0), us.
    pub tail_us: f64,
    /// First start to end, us.
    pub total_us: f64,
    /// The smallest step between two stamps seen, ns (the timer's
    /// resolution or finer).
    pub tick_ns: u64,
}

impl Timeline {
    /// The op kinds: a layer's five, then the LM head (the last barrier).
    pub const OPS: [&'static str; 6] = [
        LAYER_OPS[0],
        LAYER_OPS[1],
        LAYER_OPS[2],
        LAYER_OPS[3],
        LAYER_OPS[4],
        "lm_head",
    ];

    /// Summarises traced steps (at least one).
    pub fn from_traces(traces: &[StepTrace]) -> Result<Self> {
        if traces.is_empty() {
            return Err(Error::Option {
                field: "trace",
                reason: "no traced step to summarise".into(),
            });
        }
        let n = Self::OPS.len();
        // [step][op] (critical, busy, barrier), us
        let per_step: Vec<Vec<[f64; 3]>> = traces
            .iter()
            .map(|t| {
                let mut sums = vec![[0.0f64; 3]; n];
                for s in t.spans() {
                    sums[s.op][0] += s.critical_ns as f64 / 1e3;
                    sums[s.op][1] += s.busy_mean_ns / 1e3;
                    sums[s.op][2] += s.barrier_ns as f64 / 1e3;
                }
                sums
            })
            .collect();
        let med = |f: &dyn Fn(usize) -> f64| {
            let mut v: Vec<f64> = (0..traces.len()).map(f).collect();
            crate::stats::median(&mut v)
        };
        let rows = (0..n)
            .map(|op| TimelineRow {
                name: Self::OPS[op],
                critical_us: med(&|s| per_step[s][op][0]),
                busy_mean_us: med(&|s| per_step[s][op][1]),
                barrier_us: med(&|s| per_step[s][op][2]),
            })
            .collect();
        Ok(Self {
            steps: traces.len(),
            rows,
            launch_skew_us: med(&|s| traces[s].launch_skew_ns() as f64 / 1e3),
            tail_us: med(&|s| traces[s].tail_ns() as f64 / 1e3),
            total_us: med(&|s| traces[s].total_ns() as f64 / 1e3),
            tick_ns: traces.iter().map(StepTrace::tick_ns).min().unwrap_or(0),
        })
    }

    /// All barriers of the step, us (the sum of the rows').
    pub fn barrier_us(&self) -> f64 {
        self.rows.iter().map(|r| r.barrier_us).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of `grid` CTAs over one layer (6 barriers): CTA c starts at
    /// 100 + c, spends `work(k, c)` ns in op k, and every CTA leaves barrier
    /// k `lat` ns after the last arrival.
    fn synthetic(grid: u32, work: impl Fn(u32, u32) -> u64, lat: u64) -> StepTrace {
        let b = 6u32;
        let mut raw = vec![0u64; (grid * (b + 1) * 2) as usize];
        let idx = |c: u32, s: u32, i: u32| ((c * (b + 1) + s) * 2 + i) as usize;
        let mut t: Vec<u64> = (0..grid).map(|c| 100 + u64::from(c)).collect();
        for c in 0..grid {
            raw[idx(c, 0, 0)] = t[c as usize];
        }
        for k in 1..=b {
            let arrive: Vec<u64> = (0..grid).map(|c| t[c as usize] + work(k, c)).collect();
            let last = *arrive.iter().max().unwrap();
            for c in 0..grid {
                raw[idx(c, k, 0)] = arrive[c as usize];
                raw[idx(c, k, 1)] = last + lat;
                t[c as usize] = last + lat;
            }
        }
        raw[idx(0, 0, 1)] = t[0] + 7;
        StepTrace::from_raw(grid, b, raw).unwrap()
    }

    #[test]
    fn spans_split_the_step_exactly() {
        let t = synthetic(4, |k, c| 1000 * u64::from(k) + 10 * u64::from(c), 50);
        t.check(0).unwrap();
        let spans = t.spans();
        assert_eq!(spans.len(), 6);
        // Op 1: last start 103, last arrival 103 + 1030.
        assert_eq!(spans[0].critical_ns, 1030);
        assert_eq!(spans[0].barrier_ns, 50);
        // Later ops: everyone leaves together, the slowest takes 1000 k + 30.
        assert_eq!(spans[2].critical_ns, 3030);
        assert_eq!(spans[2].busy_mean_ns, 3015.0);
        assert_eq!((spans[5].op, spans[5].layer), (5, 1));
        assert_eq!((spans[1].op, spans[1].layer), (1, 0));
        let sum: u64 = spans.iter().map(|s| s.critical_ns + s.barrier_ns).sum();
        assert_eq!(t.launch_skew_ns(), 3);
        assert_eq!(t.tail_ns(), 7);
        assert_eq!(t.launch_skew_ns() + sum + t.tail_ns(), t.total_ns());
        let tl = Timeline::from_traces(&[t.clone(), t]).unwrap();
        assert_eq!(tl.rows[2].name, "o_proj");
        assert_eq!(tl.rows[2].critical_us, 3.03);
        assert!((tl.barrier_us() - 0.3).abs() < 1e-12);
        assert_eq!(tl.tick_ns, 1);
    }

    #[test]
    fn check_catches_an_early_release_and_disorder() {
        // CTA 2 is the fastest: at barrier 3 it arrives 200 ns before CTA 0.
        let mut t = synthetic(3, |_, c| 500 - 100 * u64::from(c), 20);
        t.check(0).unwrap();
        let last_in = t.arrival(0, 3);
        assert_eq!(t.arrival(2, 3) + 200, last_in);
        // It leaves 150 ns before CTA 0 arrives: caught unless the slack
        // covers it.
        t.raw[(2 * 7 + 3) * 2 + 1] = last_in - 150;
        let e = t.check(10).unwrap_err();
        assert!(e.contains("left barrier 3"), "{e}");
        t.check(150).unwrap();
        let mut u = synthetic(3, |_, _| 500, 20);
        u.raw[(7 + 2) * 2] = 1; // CTA 1 arrives at barrier 2 before it started
        assert!(u.check(0).unwrap_err().contains("out of order"));
        let mut v = synthetic(3, |_, _| 500, 20);
        v.raw[1] = 5;
        assert!(v.check(0).unwrap_err().contains("end"));
    }

    #[test]
    fn from_raw_refuses_a_wrong_length() {
        assert!(StepTrace::from_raw(2, 6, vec![0; 28]).is_ok());
        assert!(StepTrace::from_raw(2, 6, vec![0; 27]).is_err());
        assert!(StepTrace::from_raw(0, 6, vec![]).is_err());
        assert!(Timeline::from_traces(&[]).is_err());
    }
}
