//! What a tensor-parallel rank's build adds: the exchange region every rank
//! holds in its own device memory (its peers read and write it through peer
//! mappings) and the rank's kernel build.

use qmk_model::tensor_parallel::{check_ranks, rank_config, tp_plan};
use qmk_model::Config;

use crate::error::{KernelsError, Result};
use crate::params::TP_MAX_RANKS;
use crate::KernelBuild;

/// Byte offsets of one rank's exchange region (`Params::tp_peer[k]` points
/// at rank k's), for a model of hidden size H:
///
/// | at | what | written by |
/// |---|---|---|
/// | `partial` | f32 `[2, H]`: this rank's o_proj or down partial, by the exchange's epoch parity | this rank |
/// | `flags` | u32 `[R]`: the last epoch rank k published | rank k |
/// | `failed` | u32 `[R]`: nonzero once rank k failed (its error code) | rank k |
/// | `picks` | u32 `[2, R, 2]`: rank k's best (logit bits, vocabulary index), by parity | rank k |
///
/// R is [`TP_MAX_RANKS`] in the layout whatever the group's size, so the
/// offsets depend on H alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRegion {
    /// Offset of the partial sums.
    pub partial: u64,
    /// Offset of the epoch flags.
    pub flags: u64,
    /// Offset of the failure words.
    pub failed: u64,
    /// Offset of the argmax picks.
    pub picks: u64,
    /// Bytes of the region (a multiple of 256).
    pub bytes: u64,
}

impl TpRegion {
    /// The region for hidden size `hidden` (checked arithmetic).
    pub fn new(hidden: u64) -> Result<TpRegion> {
        let overflow = || KernelsError::Config {
            field: "hidden_size",
            reason: "the tensor-parallel exchange region overflows".into(),
        };
        let r = TP_MAX_RANKS as u64;
        let partial = 0u64;
        let flags = hidden
            .checked_mul(2 * 4)
            .and_then(|b| b.checked_next_multiple_of(128))
            .ok_or_else(overflow)?;
        let failed = flags + r * 4;
        let picks = failed + r * 4;
        let bytes = (picks + 2 * r * 8)
            .checked_next_multiple_of(256)
            .ok_or_else(overflow)?;
        Ok(TpRegion {
            partial,
            flags,
            failed,
            picks,
            bytes,
        })
    }
}

impl KernelBuild {
    /// The build of one rank of a `ranks`-way tensor-parallel group of
    /// `config` (all ranks share it: the rank index is a launch parameter).
    /// Its shapes are the rank's ([`rank_config`]), the embedding table
    /// stays whole, and the decode step exchanges partial sums and argmax
    /// picks with its peers. A rank build has no prefill and no
    /// multi-token step: a rank runs one-token steps only.
    pub fn for_rank(config: &Config, ranks: usize) -> Result<KernelBuild> {
        if !(2..=TP_MAX_RANKS).contains(&ranks) {
            return Err(KernelsError::Config {
                field: "ranks",
                reason: format!("{ranks} ranks: a tensor-parallel build takes 2..={TP_MAX_RANKS}"),
            });
        }
        check_ranks(config, ranks)?;
        let tp = tp_plan(config, ranks)?;
        let plan = tp
            .rank_plans
            .into_iter()
            .next()
            .ok_or_else(|| KernelsError::Plan {
                tensor: "(tensor-parallel plan)".into(),
                reason: "no rank plans".into(),
            })?;
        let rank = rank_config(config, ranks);
        KernelBuild::with_plan_tp(&rank, plan, ranks as u32, config.vocab_size as u64, false)
    }

    /// Ranks of the tensor-parallel group this build is for (1: one GPU).
    pub fn tp_ranks(&self) -> u32 {
        self.tp_ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_offsets_are_disjoint_and_aligned() {
        let r = TpRegion::new(896).unwrap();
        assert_eq!(r.flags, 896 * 8);
        assert!(r.flags % 128 == 0 && r.failed == r.flags + 32 && r.picks == r.failed + 32);
        assert!(r.bytes >= r.picks + 128 && r.bytes % 256 == 0);
        let big = TpRegion::new(8192).unwrap();
        assert_eq!(big.flags, 65536);
        assert!(TpRegion::new(u64::MAX / 4).is_err());
    }

    #[test]
    fn rank_builds_take_the_rank_shapes_and_keep_the_embedding_whole() {
        let c = Config::preset("0.5b").unwrap();
        let b = KernelBuild::for_rank(&c, 2).unwrap();
        assert_eq!(b.tp_ranks(), 2);
        assert_eq!(b.config.num_attention_heads, 7);
        assert_eq!(b.config.num_kv_heads(), 1);
        assert_eq!(b.config.head_dim(), 64);
        assert_eq!(b.config.vocab_size, 151_936 / 2);
        let h = &b.plan_header;
        assert!(h.contains("#define QMK_TP_RANKS 2\n"), "{h}");
        assert!(h.contains("QMK_EMBED_ROWS = 151936ull") || h.contains("QMK_EMBED_ROWS = 151936"));
        // 7 barriers per layer and the LM head's.
        assert_eq!(b.barriers_per_step, 24 * 7 + 1);
        // No multi-token step on a rank.
        assert_eq!(b.multi_max_tokens(crate::Arch::SM90), 0);
        // A different fingerprint from the one-GPU build and from 4 ranks'.
        let one = KernelBuild::new(&c).unwrap();
        assert_ne!(one.fingerprint, b.fingerprint);
        assert_eq!(one.tp_ranks(), 1);
    }

    #[test]
    fn rank_builds_refuse_bad_groups_by_name() {
        let c = Config::preset("0.5b").unwrap();
        // 2 KV heads do not divide among 4 ranks.
        let e = KernelBuild::for_rank(&c, 4).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = KernelBuild::for_rank(&c, 1).unwrap_err().to_string();
        assert!(e.contains("ranks"), "{e}");
        let e = KernelBuild::for_rank(&c, 16).unwrap_err().to_string();
        assert!(e.contains("ranks"), "{e}");
        let big = Config::preset("72b").unwrap();
        for n in [2, 4, 8] {
            let b = KernelBuild::for_rank(&big, n).unwrap();
            assert_eq!(b.config.intermediate_size, 29_568 / n);
        }
    }
}
