//! Drafting for speculative decoding: cheap guesses of the next tokens,
//! which the model then checks in one multi-token step
//! ([`crate::Backend::step_many`]). A wrong guess costs time, never output.
//!
//! [`PromptLookup`] drafts without a second model: it finds the most recent
//! earlier occurrence of the history's last n tokens (the prompt and the
//! output so far) and proposes what followed it. Strong where the output
//! copies its input: code edits, summaries, chat about a given text.

use std::collections::HashMap;

use crate::EngineError;

/// Something that guesses the tokens that follow a growing history.
///
/// The decode loop calls [`Drafter::reset`] and [`Drafter::extend`] with
/// the prompt, then alternates [`Drafter::draft`] and [`Drafter::extend`]
/// with the tokens it accepted, so a drafter sees every token once.
pub trait Drafter {
    /// Forgets the history: a new sequence starts.
    fn reset(&mut self);
    /// Appends `tokens` to the history.
    fn extend(&mut self, tokens: &[u32]);
    /// Writes up to `max` guesses for the tokens after the history into
    /// `out` (cleared first); none when it has no guess.
    fn draft(&mut self, max: usize, out: &mut Vec<u32>);
}

/// Longest n-gram [`PromptLookup`] can match.
pub const MAX_NGRAM: usize = 8;

/// An n-gram of at most [`MAX_NGRAM`] ids, zero-padded, as an index key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct NGram {
    n: u8,
    ids: [u32; MAX_NGRAM],
}

impl NGram {
    fn of(ids: &[u32]) -> Self {
        let mut key = NGram {
            n: ids.len() as u8,
            ids: [0; MAX_NGRAM],
        };
        key.ids[..ids.len()].copy_from_slice(ids);
        key
    }
}

/// Prompt-lookup drafting (n-gram matching over the history).
///
/// For `n` from `ngram_max` down to `ngram_min`, the history's last `n`
/// tokens are looked up; the first `n` with an earlier occurrence wins and
/// the tokens that followed its most recent earlier occurrence are the
/// draft. This is transformers' `prompt_lookup_num_tokens` (longest n-gram
/// first, down to 1) and llama.cpp's lookup decoding (n-grams of 1 to 4),
/// with two choices of ours:
///
/// * the most recent occurrence, not the first: after an edit the newest
///   copy of a line is the one the output is continuing;
/// * a continuation that runs into the end of the history keeps copying from
///   its own start (an overlapping copy, as LZ77 does), so a loop of period
///   `p` is drafted for the full length and not cut at `p` tokens.
///
/// Bounded work: an index maps every n-gram to the end of its most recent
/// occurrence and is updated as tokens arrive, so adding a token costs
/// `O(ngram_max²)` and a draft `O(ngram_max² + max)`, whatever the history's
/// length ([`PromptLookup::work`] counts it).
#[derive(Debug, Clone)]
pub struct PromptLookup {
    ngram_min: usize,
    ngram_max: usize,
    history: Vec<u32>, // [L] prompt and output so far
    /// n-gram -> `j` such that `history[j - n..j]` is its most recent
    /// occurrence followed by a token (`j < L`).
    index: HashMap<NGram, usize>,
    work: u64,
}

impl Default for PromptLookup {
    /// n-grams of 3 down to 1 tokens.
    fn default() -> Self {
        Self::new(1, 3).expect("1..=3 is a valid n-gram range")
    }
}

impl PromptLookup {
    /// Matches n-grams of `ngram_max` down to `ngram_min` tokens
    /// (`1 <= ngram_min <= ngram_max <=` [`MAX_NGRAM`]).
    pub fn new(ngram_min: usize, ngram_max: usize) -> Result<Self, EngineError> {
        if !(1 <= ngram_min && ngram_min <= ngram_max && ngram_max <= MAX_NGRAM) {
            return Err(EngineError::InvalidSpeculation {
                field: "ngram",
                reason: format!(
                    "{ngram_min}..={ngram_max} (must satisfy 1 <= min <= max <= {MAX_NGRAM})"
                ),
            });
        }
        Ok(Self {
            ngram_min,
            ngram_max,
            history: Vec::new(),
            index: HashMap::new(),
            work: 0,
        })
    }

    /// The history seen so far `[L]`.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Token ids read or written by index updates and drafts since
    /// construction: the counted work, which grows with calls and tokens,
    /// not with the history's length.
    pub fn work(&self) -> u64 {
        self.work
    }
}

impl Drafter for PromptLookup {
    fn reset(&mut self) {
        self.history.clear();
        self.index.clear();
    }

    fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            // The n-grams ending at the old end are now followed by `t`.
            let l = self.history.len();
            for n in self.ngram_min..=self.ngram_max.min(l) {
                self.index.insert(NGram::of(&self.history[l - n..]), l);
                self.work += n as u64;
            }
            self.history.push(t);
        }
    }

    fn draft(&mut self, max: usize, out: &mut Vec<u32>) {
        out.clear();
        let l = self.history.len();
        if max == 0 {
            return;
        }
        for n in (self.ngram_min..=self.ngram_max.min(l)).rev() {
            self.work += n as u64;
            let Some(&j) = self.index.get(&NGram::of(&self.history[l - n..])) else {
                continue;
            };
            // history[j..] then, past the end, the draft itself (j < l, so
            // out[j + i - l] is already written).
            for i in 0..max {
                let t = match self.history.get(j + i) {
                    Some(&t) => t,
                    None => out[j + i - l],
                };
                out.push(t);
            }
            self.work += max as u64;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafted(history: &[u32], max: usize) -> Vec<u32> {
        let mut d = PromptLookup::default();
        d.extend(history);
        let mut out = vec![99];
        d.draft(max, &mut out);
        out
    }

    #[test]
    fn continues_the_longest_suffix_match() {
        // Suffix [1, 2] occurred at 0..2, followed by 3, 4, 5.
        assert_eq!(drafted(&[1, 2, 3, 4, 5, 1, 2], 3), vec![3, 4, 5]);
        // The 3-gram [9, 1, 2] beats the more recent 2-gram [1, 2].
        let h = [9, 1, 2, 7, 7, 1, 2, 8, 8, 9, 1, 2];
        assert_eq!(drafted(&h, 2), vec![7, 7]);
        // Without the 3-gram the most recent [1, 2] wins.
        let h = [5, 1, 2, 7, 7, 1, 2, 8, 8, 9, 1, 2];
        assert_eq!(drafted(&h, 2), vec![8, 8]);
    }

    #[test]
    fn picks_the_most_recent_occurrence() {
        let h = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2];
        // "0 1 2" occurs twice before the end; the newer was followed by 4.
        assert_eq!(drafted(&h, 2), vec![4, 0]);
    }

    #[test]
    fn no_match_no_draft() {
        assert!(drafted(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        assert!(drafted(&[], 4).is_empty());
        assert!(drafted(&[7], 4).is_empty());
        assert!(drafted(&[1, 2, 1], 0).is_empty());
        // A minimum of 2 ignores a lone repeated token.
        let mut d = PromptLookup::new(2, 3).unwrap();
        d.extend(&[1, 2, 3, 4, 3]);
        let mut out = vec![];
        d.draft(4, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn overlapping_matches_keep_copying_the_period() {
        // Period 3: the match [2, 3, 1] at 1..4 continues 2, 3, 1 and then
        // copies its own start.
        assert_eq!(
            drafted(&[1, 2, 3, 1, 2, 3, 1], 7),
            vec![2, 3, 1, 2, 3, 1, 2]
        );
        // One repeated token: period 1.
        assert_eq!(drafted(&[4, 7, 7, 7], 5), vec![7; 5]);
        // Two tokens into a repeat: [5, 6] ends at 2, continuation [5, 6, ...].
        assert_eq!(drafted(&[5, 6, 5, 6], 3), vec![5, 6, 5]);
    }

    #[test]
    fn extends_incrementally_and_resets() {
        let mut d = PromptLookup::default();
        let mut out = vec![];
        d.extend(&[1, 2, 3]);
        d.extend(&[9]);
        d.extend(&[1, 2]);
        d.draft(2, &mut out);
        assert_eq!(out, vec![3, 9]);
        assert_eq!(d.history(), &[1, 2, 3, 9, 1, 2]);
        d.reset();
        assert!(d.history().is_empty());
        d.extend(&[1, 2]);
        d.draft(2, &mut out);
        assert!(out.is_empty(), "the old history leaked: {out:?}");
    }

    #[test]
    fn bad_ngram_ranges_are_named_errors() {
        for (lo, hi) in [(0, 3), (3, 2), (1, MAX_NGRAM + 1)] {
            let e = PromptLookup::new(lo, hi).unwrap_err();
            assert!(e.to_string().contains("ngram"), "{e}");
        }
        assert!(PromptLookup::new(MAX_NGRAM, MAX_NGRAM).is_ok());
    }

    #[test]
    fn work_per_call_does_not_grow_with_the_history() {
        // 100,000 tokens of a noisy repeating pattern, one token and one
        // draft at a time: a scan of the history per draft would cost ~10^10
        // reads; the index costs a constant per token and per draft.
        let mut d = PromptLookup::new(1, 4).unwrap();
        let mut out = vec![];
        let (tokens, max) = (100_000u64, 7);
        let mut x = 12345u64;
        let mut accepted = 0u64;
        for i in 0..tokens {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let t = if (x >> 60) == 0 {
                (x >> 40) as u32 % 1000
            } else {
                (i % 37) as u32
            };
            d.extend(&[t]);
            d.draft(max as usize, &mut out);
            accepted += u64::from(out.first() == Some(&(((i + 1) % 37) as u32)));
        }
        // Per token: inserts of n = 1..=4 (10 ids); per draft: lookups of
        // n = 4..=1 (10 ids) and `max` copies.
        let bound = tokens * (10 + 10 + max);
        assert!(d.work() <= bound, "work {} > {bound}", d.work());
        // And the drafts are useful on this history.
        assert!(
            accepted > tokens / 2,
            "{accepted} of {tokens} first guesses right"
        );
    }
}
