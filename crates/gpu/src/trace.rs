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
//!
//! Inside the split attention, thread 0 of each CTA with an item also marks
//! when q is staged, when the item's K/V stream is done and when its partial
//! is out (its ticket released), and every CTA when its share of the
//! combine is done ([`AttentionParts`]).

use crate::error::{Error, Result};
use qmk_kernels::params::ATTN_MARKS;

/// Names of the five ops a layer's barriers close, in order.
const LAYER_OPS: [&str; 5] = ["qkv_proj", "attention", "o_proj", "mlp gate/up", "mlp down"];

/// One decode step's stamps, `%globaltimer` nanoseconds: `[grid, B + 1, 2]`
/// u64 with B grid barriers: slot 0 is (start, end; end on CTA 0 only),
/// slot k (arrival, release) of barrier k; then the split attention's
/// marks, `[grid, L, ATTN_MARKS]` u64 (0: no item in that layer).
#[derive(Debug, Clone, PartialEq)]
pub struct StepTrace {
    grid: u32,
    barriers: u32,
    layers: u32,
    // [grid, barriers + 1, 2] ns
    raw: Vec<u64>,
    // [grid, layers, ATTN_MARKS] ns
    marks: Vec<u64>,
}

/// Where the split attention's time goes, per step (summed over the
/// layers), from the marks inside it. "Mean" figures average over the CTAs
/// with an item; the critical path (the attention op's) splits into the
/// time to the last partial, from there to the last CTA's end of its
/// combine share, and the rest to the last arrival at the barrier.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionParts {
    /// Items (CTAs with marks) per layer, the mean over the layers.
    pub items: f64,
    /// Mean item: previous barrier's release to q staged, us.
    pub q_us: f64,
    /// Mean item: q staged to its K/V stream done (every warp), us.
    pub stream_us: f64,
    /// Mean item: stream done to partial out and ticket released, us.
    pub partial_us: f64,
    /// Mean item: partial out to the end of its CTA's combine share (the
    /// wait for the kv heads' last partials included), us.
    pub combine_us: f64,
    /// The item whose partial came last: its q, stream and partial, us.
    pub slowest_us: [f64; 3],
    /// Last release of the previous barrier to the last partial, us.
    pub to_last_partial_us: f64,
    /// Last partial to the last CTA's end of its combine share, us.
    pub combine_tail_us: f64,
    /// From there to the last arrival at the barrier, us.
    pub to_arrival_us: f64,
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
    /// Wraps the buffer the kernel wrote for `layers` layers and `barriers`
    /// grid barriers; its length must be `grid * (barriers + 1) * 2 + grid
    /// * layers * ATTN_MARKS`.
    pub fn from_raw(grid: u32, barriers: u32, layers: u32, mut raw: Vec<u64>) -> Result<Self> {
        let slots = (grid as usize)
            .checked_mul(barriers as usize + 1)
            .and_then(|n| n.checked_mul(2));
        let marks = (grid as usize)
            .checked_mul(layers as usize)
            .and_then(|n| n.checked_mul(ATTN_MARKS as usize));
        let want = slots.zip(marks).and_then(|(a, b)| a.checked_add(b));
        let (Some(slots), true) = (slots, grid > 0 && barriers > 0 && want == Some(raw.len()))
        else {
            return Err(Error::Option {
                field: "trace",
                reason: format!(
                    "{} stamps do not fit a grid of {grid} CTAs with {barriers} barriers and \
                     {layers} layers",
                    raw.len()
                ),
            });
        };
        let marks = raw.split_off(slots);
        Ok(Self {
            grid,
            barriers,
            layers,
            raw,
            marks,
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

    /// The split attention's marks of CTA `cta` in `layer`: q staged, stream
    /// done, partial out, its combine share done (0: not reached).
    pub fn attention_marks(&self, cta: u32, layer: u32) -> [u64; 4] {
        let i = (cta as usize * self.layers as usize + layer as usize) * ATTN_MARKS as usize;
        [
            self.marks[i],
            self.marks[i + 1],
            self.marks[i + 2],
            self.marks[i + 3],
        ]
    }

    /// The split attention's time, summed over the layers ([`AttentionParts`]);
    /// `None` when no layer has marks (the one-CTA-per-head path ran).
    pub fn attention_parts(&self) -> Option<AttentionParts> {
        let us = |ns: u64| ns as f64 / 1e3;
        let mut a = AttentionParts::default();
        let mut layers = 0u32;
        for layer in 0..self.layers {
            // The attention op ends at barrier 5 layer + 2; it starts at the
            // releases of barrier 5 layer + 1.
            let k = 5 * layer + 2;
            if k > self.barriers {
                break;
            }
            let items: Vec<(u32, [u64; 4])> = (0..self.grid)
                .map(|c| (c, self.attention_marks(c, layer)))
                .filter(|(_, m)| m[0] != 0 && m[1] != 0 && m[2] != 0)
                .collect();
            if items.is_empty() {
                continue;
            }
            layers += 1;
            let n = items.len() as f64;
            let rel = |c: u32| self.release(c, k - 1);
            // The mean over the items of one span between marks, ns -> us.
            let mean = |span: &dyn Fn(u32, &[u64; 4]) -> u64| {
                items.iter().map(|(c, m)| us(span(*c, m))).sum::<f64>() / n
            };
            a.items += n;
            a.q_us += mean(&|c, m| m[0].saturating_sub(rel(c)));
            a.stream_us += mean(&|_, m| m[1].saturating_sub(m[0]));
            a.partial_us += mean(&|_, m| m[2].saturating_sub(m[1]));
            let combines: Vec<f64> = items
                .iter()
                .filter(|(_, m)| m[3] != 0)
                .map(|(_, m)| us(m[3].saturating_sub(m[2])))
                .collect();
            if !combines.is_empty() {
                a.combine_us += combines.iter().sum::<f64>() / combines.len() as f64;
            }
            let &(slow, sm) = items
                .iter()
                .max_by_key(|(_, m)| m[2])
                .expect("items is not empty");
            a.slowest_us[0] += us(sm[0].saturating_sub(rel(slow)));
            a.slowest_us[1] += us(sm[1].saturating_sub(sm[0]));
            a.slowest_us[2] += us(sm[2].saturating_sub(sm[1]));
            let r_prev = (0..self.grid).map(rel).max().unwrap_or(0);
            let last_partial = sm[2];
            // Every CTA marks the end of its share of the combine.
            let last_done = (0..self.grid)
                .map(|c| self.attention_marks(c, layer)[3])
                .max()
                .unwrap_or(0)
                .max(last_partial);
            let l_k = (0..self.grid)
                .map(|c| self.arrival(c, k))
                .max()
                .unwrap_or(0);
            a.to_last_partial_us += us(last_partial.saturating_sub(r_prev));
            a.combine_tail_us += us(last_done.saturating_sub(last_partial));
            a.to_arrival_us += us(l_k.saturating_sub(last_done));
        }
        if layers == 0 {
            return None;
        }
        a.items /= f64::from(layers);
        Some(a)
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
    /// The split attention's parts (each figure the median over the traced
    /// steps), when it ran.
    pub attention: Option<AttentionParts>,
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
            attention: median_parts(traces),
        })
    }

    /// All barriers of the step, us (the sum of the rows').
    pub fn barrier_us(&self) -> f64 {
        self.rows.iter().map(|r| r.barrier_us).sum()
    }

    /// The parts the step splits into, added up, us: every op's critical
    /// path and barrier, the launch skew and the tail. Each is a median over
    /// the steps, so the sum is near [`Timeline::total_us`], not equal.
    pub fn parts_us(&self) -> f64 {
        self.rows
            .iter()
            .map(|r| r.critical_us + r.barrier_us)
            .sum::<f64>()
            + self.launch_skew_us
            + self.tail_us
    }
}

/// Each field of the steps' [`AttentionParts`], the median over the steps
/// that have them.
fn median_parts(traces: &[StepTrace]) -> Option<AttentionParts> {
    let parts: Vec<AttentionParts> = traces
        .iter()
        .filter_map(StepTrace::attention_parts)
        .collect();
    if parts.is_empty() {
        return None;
    }
    let med = |f: &dyn Fn(&AttentionParts) -> f64| {
        let mut v: Vec<f64> = parts.iter().map(f).collect();
        crate::stats::median(&mut v)
    };
    Some(AttentionParts {
        items: med(&|p| p.items),
        q_us: med(&|p| p.q_us),
        stream_us: med(&|p| p.stream_us),
        partial_us: med(&|p| p.partial_us),
        combine_us: med(&|p| p.combine_us),
        slowest_us: [
            med(&|p| p.slowest_us[0]),
            med(&|p| p.slowest_us[1]),
            med(&|p| p.slowest_us[2]),
        ],
        to_last_partial_us: med(&|p| p.to_last_partial_us),
        combine_tail_us: med(&|p| p.combine_tail_us),
        to_arrival_us: med(&|p| p.to_arrival_us),
    })
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
        // One layer's attention marks per CTA, none set.
        raw.extend(std::iter::repeat_n(0, (grid * ATTN_MARKS) as usize));
        StepTrace::from_raw(grid, b, 1, raw).unwrap()
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
        // Equal steps: the medians add up to the step.
        assert!((tl.parts_us() - tl.total_us).abs() < 1e-9, "{tl:?}");
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
        // 2 CTAs: 7 slots of 2 stamps, then 1 layer of 4 marks each.
        assert!(StepTrace::from_raw(2, 6, 1, vec![0; 36]).is_ok());
        assert!(StepTrace::from_raw(2, 6, 1, vec![0; 35]).is_err());
        assert!(StepTrace::from_raw(2, 6, 1, vec![0; 28]).is_err());
        assert!(StepTrace::from_raw(0, 6, 1, vec![]).is_err());
        assert!(StepTrace::from_raw(2, 0, 0, vec![0; 4]).is_err());
        assert!(Timeline::from_traces(&[]).is_err());
    }

    #[test]
    fn attention_parts_split_the_attention_op() {
        // Every CTA leaves the qkv barrier (k = 1) at r and arrives at the
        // attention barrier (k = 2) at r + 5,000: work(2, c) = 5,000.
        let mut t = synthetic(3, |k, _| if k == 2 { 5000 } else { 100 }, 50);
        assert!(t.attention_parts().is_none());
        let r = t.release(0, 1);
        assert_eq!(r, t.release(2, 1));
        let mark = |t: &mut StepTrace, c: usize, m: [u64; 4]| {
            t.marks[c * 4..c * 4 + 4].copy_from_slice(&m);
        };
        // CTA 0: q at +500, stream to +2,500, partial at +3,000, combine
        // share to +4,400. CTA 1: q at +700, stream to +3,700, partial at
        // +4,000 (the last), combine share to +4,600. CTA 2: no item, its
        // combine share done at +4,800 (the last).
        mark(&mut t, 0, [r + 500, r + 2500, r + 3000, r + 4400]);
        mark(&mut t, 1, [r + 700, r + 3700, r + 4000, r + 4600]);
        mark(&mut t, 2, [0, 0, 0, r + 4800]);
        let a = t.attention_parts().unwrap();
        assert_eq!(a.items, 2.0);
        assert!((a.q_us - 0.6).abs() < 1e-9, "{a:?}");
        assert!((a.stream_us - 2.5).abs() < 1e-9, "{a:?}");
        assert!((a.partial_us - 0.4).abs() < 1e-9, "{a:?}");
        assert!((a.combine_us - 1.0).abs() < 1e-9, "{a:?}");
        assert_eq!(a.slowest_us, [0.7, 3.0, 0.3]);
        assert!((a.to_last_partial_us - 4.0).abs() < 1e-9, "{a:?}");
        assert!((a.combine_tail_us - 0.8).abs() < 1e-9, "{a:?}");
        assert!((a.to_arrival_us - 0.2).abs() < 1e-9, "{a:?}");
        // The three parts of the critical path are the attention op's.
        let crit = t.spans()[1].critical_ns as f64 / 1e3;
        assert!((a.to_last_partial_us + a.combine_tail_us + a.to_arrival_us - crit).abs() < 1e-9);
        let tl = Timeline::from_traces(&[t.clone(), t]).unwrap();
        assert_eq!(tl.attention, Some(a));
    }
}
