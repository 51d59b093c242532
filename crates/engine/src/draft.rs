//! Drafting for speculative decoding: cheap guesses of the next tokens,
//! which the model then checks in one multi-token step
//! ([`crate::Backend::step_many`]). A wrong guess costs time, never output.
//!
//! [`PromptLookup`] drafts without a second model: it finds the most recent
//! earlier occurrence of the history's last n tokens (the prompt and the
//! output so far) and proposes what followed it. Strong where the output
//! copies its input: code edits, summaries, chat about a given text.
//!
//! [`DraftModel`] drafts with a second, smaller model of the same
//! vocabulary (Qwen2.5-0.5B for any larger Qwen2.5), on a backend of its
//! own.

use std::collections::HashMap;

use qmk_model::tokenizer::Tokenizer;

use crate::sampling::{apply_penalties, candidates, Rng, Sampling, TokenHistory};
use crate::speculative::draw;
use crate::{Backend, EngineError, MultiStep, MAX_STEP_TOKENS};

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
    fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError>;

    /// The guesses for sampled decoding: like [`Drafter::draft`], and, for
    /// a drafter that samples its guesses, the distribution `[(id,
    /// probability)]` each guess was drawn from in `dists` (one per guess;
    /// `history` holds the ids the penalties look at, `rng` is the
    /// generation's generator). Left empty, the guesses are deterministic
    /// (a one-hot distribution each): the default, which calls
    /// [`Drafter::draft`].
    fn draft_sampled(
        &mut self,
        max: usize,
        sampling: &Sampling,
        history: &TokenHistory,
        rng: &mut Rng,
        out: &mut Vec<u32>,
        dists: &mut Vec<Vec<(u32, f64)>>,
    ) -> Result<(), EngineError> {
        let _ = (sampling, history, rng);
        dists.clear();
        self.draft(max, out)
    }

    /// What drafting one token costs, as a fraction of one of the target
    /// model's single steps: what the adaptive rule adds to a verify's cost
    /// per guess ([`crate::speculative`]). 0 by default (free guesses);
    /// for a drafter with a cost, the rule's starting point, which it
    /// replaces by the ratio it measures once it has timed a few drafts
    /// and steps.
    fn cost_per_token(&self) -> f64 {
        0.0
    }

    /// The class the next draft falls in, below [`DRAFT_CLASSES`] (larger
    /// values count as the last class), asked before each greedy draft:
    /// the adaptive rule keeps acceptance apart per class, because guesses
    /// of different classes hold at different rates (prompt lookup: the
    /// length of the n-gram that matched). `None`: no guess now, so the
    /// step is a plain one. By default every draft is of class 0.
    fn next_class(&mut self) -> Option<usize> {
        Some(0)
    }
}

/// Classes of draft ([`Drafter::next_class`]) the adaptive rule keeps
/// acceptance for: one per n-gram length of [`PromptLookup`].
pub const DRAFT_CLASSES: usize = MAX_NGRAM + 1;

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
/// with three choices of ours:
///
/// * n-grams of up to [`MAX_NGRAM`] (8) tokens by default: a longer match
///   is a surer copy, and the draft's class ([`Drafter::next_class`]) is
///   the matched length, so the adaptive rule learns how far each length
///   holds;
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
    /// The last [`PromptLookup::longest_match`] and the history length it
    /// was for: `next_class` and then `draft` ask at the same point.
    matched: Option<(usize, Option<(usize, usize)>)>,
    work: u64,
}

impl Default for PromptLookup {
    /// n-grams of [`MAX_NGRAM`] down to 1 tokens.
    fn default() -> Self {
        Self::new(1, MAX_NGRAM).expect("1..=MAX_NGRAM is a valid n-gram range")
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
            matched: None,
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

    /// The longest n-gram ending the history with an earlier occurrence:
    /// `(n, j)`, `history[j - n..j]` its most recent occurrence.
    fn longest_match(&mut self) -> Option<(usize, usize)> {
        let l = self.history.len();
        if let Some((at, m)) = self.matched {
            if at == l {
                return m;
            }
        }
        let mut m = None;
        for n in (self.ngram_min..=self.ngram_max.min(l)).rev() {
            self.work += n as u64;
            if let Some(&j) = self.index.get(&NGram::of(&self.history[l - n..])) {
                m = Some((n, j));
                break;
            }
        }
        self.matched = Some((l, m));
        m
    }
}

impl Drafter for PromptLookup {
    fn reset(&mut self) {
        self.history.clear();
        self.index.clear();
        self.matched = None;
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

    fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError> {
        out.clear();
        if max == 0 {
            return Ok(());
        }
        let Some((_, j)) = self.longest_match() else {
            return Ok(());
        };
        // history[j..] then, past the end, the draft itself (j < l, so
        // out[j + i - l] is already written).
        let l = self.history.len();
        for i in 0..max {
            let t = match self.history.get(j + i) {
                Some(&t) => t,
                None => out[j + i - l],
            };
            out.push(t);
        }
        self.work += max as u64;
        Ok(())
    }

    fn next_class(&mut self) -> Option<usize> {
        self.longest_match().map(|(n, _)| n)
    }
}

/// A model's name, tokenizer and logits rows, for
/// [`DraftModel::new`]'s vocabulary check.
#[derive(Debug, Clone, Copy)]
pub struct ModelVocab<'a> {
    /// The model's name in messages (`--model` as given).
    pub name: &'a str,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Rows of its embedding and logits (`vocab_size` in config.json): the
    /// ids it can produce are `0..rows`.
    pub rows: usize,
}

/// Drafting with a second model on a backend of its own: its greedy picks
/// (greedy decoding), or tokens drawn from its own processed distribution
/// (sampling, which then accepts each by the rejection rule).
///
/// Its KV cache follows the accepted tokens: a draft first feeds the
/// tokens accepted since the last one that it has not already fed (its own
/// guesses that held are in the cache already), from the first position
/// where the cache and the history differ, so a rejected guess's position
/// is simply rewritten. Drafting stops at the end of its cache.
pub struct DraftModel<B: Backend> {
    backend: B,
    cost: f64,
    /// Prompt and accepted output so far.
    history: Vec<u32>,
    /// What positions `0..fed.len()` of the cache hold.
    fed: Vec<u32>,
    /// The cache must be reset before the next feed.
    stale: bool,
}

/// Checks that a draft model's vocabulary agrees with the target's on
/// every id the draft can produce (see [`DraftModel::new`]); the error names
/// both models and the first difference.
pub fn check_vocabularies(
    draft: ModelVocab<'_>,
    target: ModelVocab<'_>,
) -> Result<(), EngineError> {
    let refuse = |reason: String| EngineError::DraftVocabulary {
        draft: draft.name.to_string(),
        target: target.name.to_string(),
        reason,
    };
    if draft.rows > target.rows {
        return Err(refuse(format!(
            "the draft produces ids up to {} but the target's vocabulary has {} rows",
            draft.rows - 1,
            target.rows
        )));
    }
    for id in 0..draft.rows as u32 {
        let (d, t) = (
            draft.tokenizer.id_to_token(id),
            target.tokenizer.id_to_token(id),
        );
        if d != t {
            let show = |x: Option<String>| x.map_or("no token".into(), |s| format!("{s:?}"));
            return Err(refuse(format!(
                "id {id} is {} in the draft's tokenizer but {} in the target's",
                show(d),
                show(t)
            )));
        }
    }
    Ok(())
}

/// The cost of a draft step relative to a target step when both are bound
/// by reading their weights (batch-1 decoding): the ratio of their weight
/// bytes.
pub fn relative_cost(
    draft: &qmk_model::Config,
    target: &qmk_model::Config,
) -> Result<f64, EngineError> {
    let bytes = |c: &qmk_model::Config| {
        qmk_model::inventory::weight_bytes(c)
            .map(|b| b.total.0 as f64)
            .map_err(|e| EngineError::InvalidSpeculation {
                field: "draft model",
                reason: e.to_string(),
            })
    };
    Ok(bytes(draft)? / bytes(target)?.max(1.0))
}

impl<B: Backend> DraftModel<B> {
    /// A drafter running `draft`'s model on `backend` for `target`'s model,
    /// each guess costing `cost` of one of the target's single steps
    /// ([`relative_cost`] estimates it).
    ///
    /// The vocabularies must agree on every id the draft can produce: the
    /// draft's rows may be fewer than the target's (Qwen2.5-0.5B pads its
    /// vocabulary to 151,936 rows, 7B and larger to 152,064), and the two
    /// tokenizers must map each of those ids to the same token. Anything
    /// else is an [`EngineError::DraftVocabulary`] naming both models.
    pub fn new(
        backend: B,
        draft: ModelVocab<'_>,
        target: ModelVocab<'_>,
        cost: f64,
    ) -> Result<Self, EngineError> {
        check_vocabularies(draft, target)?;
        if !(cost.is_finite() && cost >= 0.0) {
            return Err(EngineError::InvalidSpeculation {
                field: "draft cost",
                reason: format!("{cost} (must be finite and >= 0)"),
            });
        }
        Ok(Self {
            backend,
            cost,
            history: Vec::new(),
            fed: Vec::new(),
            stale: true,
        })
    }

    /// The draft model's backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn err(&self, e: B::Error) -> EngineError {
        EngineError::Backend {
            backend: self.backend.kind().name(),
            source: Box::new(e),
        }
    }

    /// Brings the cache up to the history; returns the greedy pick after
    /// it, or `None` when the history does not fit the cache.
    fn catch_up(&mut self) -> Result<Option<u32>, EngineError> {
        let n = self.history.len();
        if n == 0 || n > self.backend.capacity() {
            return Ok(None);
        }
        if self.stale {
            self.backend.reset().map_err(|e| self.err(e))?;
            self.fed.clear();
            self.stale = false;
        }
        // The last history token is fed again when nothing else is new:
        // its logits are the ones wanted.
        let same = self
            .fed
            .iter()
            .zip(&self.history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(n - 1);
        self.fed.truncate(same);
        let tail = &self.history[same..];
        let capacity = self.backend.capacity();
        let pick = if tail.len() <= MAX_STEP_TOKENS {
            // Bit-identical to single steps (the backend contract), so a
            // model drafting for itself guesses exactly its own picks.
            let run = MultiStep::new(tail, same, capacity)?;
            let out = self.backend.step_many(run);
            *out.map_err(|e| self.err(e))?
                .argmax
                .last()
                .expect("a run holds a token")
        } else {
            let out = self.backend.prefill(tail, same);
            out.map_err(|e| self.err(e))?.argmax
        };
        self.fed.extend_from_slice(tail);
        Ok(Some(pick))
    }

    /// Feeds a guess at the next position; false when the cache is full.
    fn feed(&mut self, token: u32) -> Result<Option<u32>, EngineError> {
        let pos = self.fed.len();
        if pos >= self.backend.capacity() {
            return Ok(None);
        }
        let out = self.backend.step(token, pos).map_err(|e| self.err(e))?;
        self.fed.push(token);
        Ok(Some(out.argmax))
    }
}

impl<B: Backend> Drafter for DraftModel<B> {
    fn reset(&mut self) {
        self.history.clear();
        self.stale = true;
    }

    fn extend(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError> {
        out.clear();
        if max == 0 {
            return Ok(());
        }
        let Some(mut pick) = self.catch_up()? else {
            return Ok(());
        };
        out.push(pick);
        while out.len() < max {
            match self.feed(pick)? {
                Some(next) => pick = next,
                None => break,
            }
            out.push(pick);
        }
        Ok(())
    }

    fn draft_sampled(
        &mut self,
        max: usize,
        sampling: &Sampling,
        history: &TokenHistory,
        rng: &mut Rng,
        out: &mut Vec<u32>,
        dists: &mut Vec<Vec<(u32, f64)>>,
    ) -> Result<(), EngineError> {
        out.clear();
        dists.clear();
        if max == 0 || self.catch_up()?.is_none() {
            return Ok(());
        }
        let mut h = history.clone();
        loop {
            let mut logits = self.backend.logits().map_err(|e| self.err(e))?;
            apply_penalties(&mut logits, sampling, &h);
            let q = candidates(&logits, sampling);
            let Some(x) = draw(&q, rng) else {
                break;
            };
            out.push(x);
            dists.push(q);
            if sampling.has_penalty() {
                h.push(x);
            }
            if out.len() == max || self.feed(x)?.is_none() {
                break;
            }
        }
        Ok(())
    }

    fn cost_per_token(&self) -> f64 {
        self.cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafted(history: &[u32], max: usize) -> Vec<u32> {
        let mut d = PromptLookup::default();
        d.extend(history);
        let mut out = vec![99];
        d.draft(max, &mut out).unwrap();
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
    fn the_class_is_the_matched_length() {
        let mut d = PromptLookup::default();
        d.extend(&[9, 1, 2, 7, 7, 1, 2, 8, 8, 9, 1, 2]);
        assert_eq!(d.next_class(), Some(3));
        d.extend(&[3]);
        assert_eq!(d.next_class(), None);
        // Eight tokens again: the longest n-gram it matches.
        d.extend(&[7, 7, 1, 2, 8, 8, 9, 1]);
        assert_eq!(d.next_class(), Some(MAX_NGRAM));
        let mut out = vec![];
        d.draft(2, &mut out).unwrap();
        assert_eq!(out, vec![2, 3]);
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
        d.draft(4, &mut out).unwrap();
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
        d.draft(2, &mut out).unwrap();
        assert_eq!(out, vec![3, 9]);
        assert_eq!(d.history(), &[1, 2, 3, 9, 1, 2]);
        d.reset();
        assert!(d.history().is_empty());
        d.extend(&[1, 2]);
        d.draft(2, &mut out).unwrap();
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
            d.draft(max as usize, &mut out).unwrap();
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

    #[test]
    fn the_class_and_the_draft_share_one_lookup() {
        // The adaptive rule asks for the class, then drafts at the same
        // point: one longest-match lookup between them, and the draft it
        // gives is the one a fresh lookup gives.
        let mut d = PromptLookup::default();
        d.extend(&[5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7]);
        let before = d.work();
        assert_eq!(d.next_class(), Some(3));
        let lookup = d.work() - before;
        let mut out = vec![];
        d.draft(4, &mut out).unwrap();
        assert_eq!(out, [8, 9, 1, 2]);
        assert_eq!(d.work() - before, lookup + 4, "the draft looked up again");
        // A new token is a new point.
        d.extend(&[8]);
        let before = d.work();
        d.draft(2, &mut out).unwrap();
        assert_eq!(out, [9, 1]);
        assert!(d.work() - before > 2);
        // So is a reset to a history of the same length.
        d.reset();
        d.extend(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(d.next_class(), None);
    }

    fn fixture_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/qwen-tokenizer")
    }

    #[test]
    fn vocabularies_must_agree_on_every_id_the_draft_produces() {
        let tok = Tokenizer::from_dir(fixture_dir()).unwrap();
        let vocab = |name, tokenizer, rows| ModelVocab {
            name,
            tokenizer,
            rows,
        };
        // 0.5B pads to 151,936 rows, 7B and up to 152,064: fine.
        let small = vocab("Qwen/Qwen2.5-0.5B-Instruct", &tok, 151_936);
        let big = vocab("Qwen/Qwen2.5-7B-Instruct", &tok, 152_064);
        check_vocabularies(small, big).unwrap();
        check_vocabularies(small, small).unwrap();
        // A draft that can produce ids the target lacks.
        let e = check_vocabularies(big, small).unwrap_err().to_string();
        assert!(
            e.contains(
                "draft model Qwen/Qwen2.5-7B-Instruct cannot draft for Qwen/Qwen2.5-0.5B-Instruct"
            ) && e.contains("152063"),
            "{e}"
        );
        // A tokenizer with two ids swapped: the first is named.
        let mut json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture_dir().join("tokenizer.json")).unwrap(),
        )
        .unwrap();
        let v = json["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = (v["a"].clone(), v["b"].clone());
        v.insert("a".into(), b);
        v.insert("b".into(), a.clone());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let other = Tokenizer::from_file(&path).unwrap();
        let e = check_vocabularies(vocab("swapped", &other, 151_936), big)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("swapped") && e.contains("Qwen/Qwen2.5-7B-Instruct"),
            "{e}"
        );
        assert!(e.contains(&format!("id {a} is")), "{e}");
        // DraftModel::new runs the same check.
        let w = std::sync::Arc::new(qmk_model::synthetic_weights(&tiny_config(), 1));
        let backend = crate::CpuBackend::new(w, 16).unwrap();
        assert!(matches!(
            DraftModel::new(backend, vocab("swapped", &other, 151_936), big, 0.1),
            Err(EngineError::DraftVocabulary { .. })
        ));
    }

    fn tiny_config() -> qmk_model::Config {
        crate::test_models::tiny_config(64, 96, 16, 300)
    }

    #[test]
    fn a_draft_model_follows_the_accepted_tokens() {
        use std::ops::ControlFlow;
        use std::sync::Arc;

        use crate::{CpuBackend, Engine, GenerateOptions, SpeculateMode, SpeculativeOptions};

        let tok = Tokenizer::from_dir(fixture_dir()).unwrap();
        let vocab = |name| ModelVocab {
            name,
            tokenizer: &tok,
            rows: 300,
        };
        let target = Arc::new(qmk_model::synthetic_weights(&tiny_config(), 11));
        let prompt = [5u32, 17, 29, 5, 17, 3, 250, 8];
        let n = 60;
        let cap = prompt.len() + n;
        let opts = |mode| GenerateOptions {
            max_new_tokens: n,
            speculation: SpeculativeOptions::always(mode),
            ..GenerateOptions::default()
        };
        let mut e = Engine::new(CpuBackend::new(target.clone(), cap).unwrap(), 300);
        let go = |e: &mut Engine<CpuBackend>, mode| {
            e.generate(&prompt, &opts(mode), |_| ControlFlow::Continue(()))
                .unwrap()
        };
        let want = go(&mut e, SpeculateMode::Off).output_ids;
        // The target drafting for itself: every guess holds.
        let same = DraftModel::new(
            CpuBackend::new(target.clone(), cap).unwrap(),
            vocab("self"),
            vocab("target"),
            1.0,
        )
        .unwrap();
        e.set_drafter(Some(Box::new(same)));
        for _ in 0..2 {
            // Twice: the second run starts from a reset drafter.
            let g = go(&mut e, SpeculateMode::Draft);
            assert_eq!(g.output_ids, want);
            let s = g.speculation;
            assert_eq!((s.accepted, s.proposed > 0), (s.proposed, true), "{s:?}");
            assert!(s.tokens_per_step() > 6.0, "{s:?}");
        }
        // Another model drafting, its cache shorter than the run: guesses
        // are rejected and rewritten, the output is the target's.
        let other = Arc::new(qmk_model::synthetic_weights(&tiny_config(), 12));
        let weak = DraftModel::new(
            CpuBackend::new(other, cap - 20).unwrap(),
            vocab("other"),
            vocab("target"),
            0.1,
        )
        .unwrap();
        assert_eq!(weak.cost_per_token(), 0.1);
        e.set_drafter(Some(Box::new(weak)));
        let g = go(&mut e, SpeculateMode::Draft);
        assert_eq!(g.output_ids, want);
        let s = g.speculation;
        assert!(s.accepted < s.proposed, "{s:?}");
        // Auto picks the draft model for greedy decoding.
        let mut auto = opts(SpeculateMode::Auto);
        auto.speculation.adaptive = false;
        let g = e
            .generate(&prompt, &auto, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(g.speculation.mode, SpeculateMode::Draft);
        assert_eq!(g.output_ids, want);
    }

    #[test]
    fn relative_cost_is_the_weight_bytes_ratio() {
        let c = |p| qmk_model::Config::preset(p).unwrap();
        let r = relative_cost(&c("0.5b"), &c("7b")).unwrap();
        // 0.5B is about 1 GB of bf16 weights, 7B about 15 GB.
        assert!(r > 0.05 && r < 0.1, "{r}");
        assert_eq!(relative_cost(&c("7b"), &c("7b")).unwrap(), 1.0);
    }
}
