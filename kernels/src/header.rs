//! A model's kernel build inputs: the rendered plan header (shapes, strides,
//! chunk tables, `QMK_*` constants) and the parameter-block checks.

use qmk_layout::ModelPlan;
use qmk_model::Config;
use sha2::{Digest, Sha256};

use crate::error::{KernelsError, Result};
use crate::params::{params_check_header, KERNEL_TENSORS, MAX_CHUNKS, THREADS_PER_CTA};
use crate::source;

/// Warps per CTA.
pub const WARPS_PER_CTA: u64 = THREADS_PER_CTA as u64 / 32;

/// Positions per warp tile of the split attention (`qmk::kAttnTile`).
pub const ATTN_TILE: u64 = 16;

/// 16-byte K/V slots each lane of the split attention keeps in flight on
/// `arch` (`qmk::kAttnRing`, passed to NVRTC by
/// [`KernelBuild::arch_options`]): a ring in shared memory filled by
/// `cp.async`. A whole tile at head_dim 128 where a CTA may take 160 KB of
/// shared memory or more; half of it elsewhere, where the deeper ring would
/// push the 7B step past the 99 KB of sm_86 / sm_89.
pub fn attn_ring(arch: crate::Arch) -> u64 {
    if arch.max_smem_per_cta() >= 160 * 1024 {
        16
    } else {
        8
    }
}

/// 16-byte vectors per lane per row in one batch of the decode dot product
/// (`qmk::batch_vectors`): a whole one-row unit up to 20 per lane, else 8;
/// row pairs in the fewest equal batches of at most [`PAIR_BATCH_MOST`].
pub fn batch_vectors(k: u64, rows: u64) -> u64 {
    let per_lane = (k / 8).div_ceil(32);
    match rows {
        1 if per_lane <= 20 => per_lane,
        1 => 8,
        _ => per_lane.div_ceil(per_lane.div_ceil(PAIR_BATCH_MOST)),
    }
}

/// Most vectors per lane per row in one batch of a decode row pair
/// (`qmk::kPairBatchMost`, rendered as `QMK_PAIR_BATCH_MOST`).
pub const PAIR_BATCH_MOST: u64 = 10;

/// Longest row, in 16-byte vectors per lane, whose phase stages its first
/// rows (`qmk::kStageVectors`, rendered as `QMK_STAGE_VECTORS`).
pub const STAGE_VECTORS: u64 = 4;

/// Fewest tokens from which the multi-token step's phases after the norms
/// take twice the rows per unit (`qmk::mt_wide`, rendered as
/// `QMK_MT_WIDE_FROM`; hidden sizes over 1,024 only): each shared read of a
/// token's activations then feeds twice the rows. On an H200 at 7B, 14B and
/// 32B, T = 5 costs 1.66-1.79 one-token steps with them against 1.92-1.97
/// without, and T = 2 1.41-1.55 against 1.27-1.39.
pub const MULTI_WIDE_FROM: u64 = 4;

/// Most segments in a warp's weight ring in the multi-token step
/// (`qmk::MtRing`, rendered as `QMK_MT_RING_MOST`): a phase streams its
/// rows through a ring of `cp.async` copies in shared memory where 3 or
/// more fit beside its activations, so the next segments' loads are in
/// flight while a warp does the current one's T-token arithmetic; 0 turns
/// the rings off. On an H200 they take T = 2 from 1.28 to 1.19 one-token
/// steps at 7B (1.39 to 1.20 at 32B) and T = 5 from 1.73 to 1.68 (1.67 to
/// 1.58), same bits.
pub const MULTI_RING_MOST: u64 = 4;

/// Whether a multi-token weight ring takes segments of a whole register
/// batch (8 16-byte vectors per lane per unit, 4 KB per warp) where 3 of
/// them fit, rather than half ones (`QMK_MT_RING_BIG`): half the copy
/// bookkeeping per weight byte, fewer segments in flight (the two measure
/// the same on an H200).
pub const MULTI_RING_BIG: u64 = 1;

/// Shared memory the multi-token step keeps back from the arch's per-CTA
/// maximum for its static shared memory (barrier flags, reductions, the
/// split attention's mbarriers), bytes.
pub const MULTI_STATIC_SMEM: u32 = 4096;

/// Shared memory, floats, that the decode weight phases need to stage their
/// first rows before their prologues (`stage_first_unit` and
/// `stage_norm_weight` in kernels/cuda/decode): the phase's activation
/// vector (128-byte rounded), the norm weight `[H]` bf16 where the prologue
/// is a norm, and each warp's first batch (`[warps, rows, batch, 32]` 16-byte
/// vectors); 0 for a phase whose rows are too long to stage. In order
/// q/k/v, o_proj, gate/up, down; `h`, `q`, `i`: hidden, q and intermediate
/// sizes.
pub fn decode_stage_floats(h: u64, q: u64, i: u64) -> [u64; 4] {
    let round = |n: u64| n.div_ceil(32) * 32;
    // Only short rows stage (`qmk::kStageVectors`).
    let short = |k: u64| (k / 8).div_ceil(32) <= STAGE_VECTORS;
    let stage = |k: u64, rows: u64| WARPS_PER_CTA * rows * batch_vectors(k, rows) * 32 * 4;
    let normed = if short(h) {
        round(h) + round(h / 2) + stage(h, 2)
    } else {
        0
    };
    let o_proj = if short(q) { round(q) + stage(q, 1) } else { 0 };
    let down = if short(i) { round(i) + stage(i, 1) } else { 0 };
    [normed, o_proj, normed, down]
}

/// Smallest hidden size whose down phase runs on tensor cores (7B and up):
/// there a T-token step costs about what a one-token step costs, since
/// every token's sums come from the same MMAs. At 0.5B the tensor-core
/// step is 2.6x slower than the CUDA-core one (short phases wait on
/// latency); 1.5B and 3B are not measured yet and keep CUDA cores.
pub const TC_MIN_HIDDEN: usize = 3072;

/// The weight phases on tensor cores ([`qmk_layout::TcPlan`], on
/// [`qmk_layout::TC_MACHINE_SM90`]): o_proj `[H, Q]` and down `[H, I]` with
/// their weights in 16-row bands; gate/up `[2 I, H]` whose tiles take 8 rows
/// of gate and the same 8 rows of up (each tensor in 8-row bands), so one
/// lane holds both of a row and applies SiLU; q/k/v `[Q + 2 KV, H]` whose
/// tiles take 8 rows i of a head and their rotary partners i + D / 2 (8-row
/// bands again), so one lane rotates each pair; and the scratch they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcPhases {
    /// The q/k/v phase.
    pub qkv: qmk_layout::TcPlan,
    /// The o_proj phase.
    pub o_proj: qmk_layout::TcPlan,
    /// The down phase.
    pub down: qmk_layout::TcPlan,
    /// The gate/up phase.
    pub gate_up: qmk_layout::TcPlan,
    /// Their global scratch ([`crate::KernelParams::tc_scratch`]).
    pub scratch: qmk_layout::TcScratch,
}

impl TcPhases {
    /// Rows of a band of q's, k's and v's tile order.
    pub const QKV_BAND: u64 = 8;
    /// Rows of a band of o_proj's tile order.
    pub const O_PROJ_BAND: u64 = 16;
    /// Rows of a band of down's tile order.
    pub const DOWN_BAND: u64 = 16;
    /// Rows of a band of gate's and up's tile order.
    pub const GATE_UP_BAND: u64 = 8;
}

/// The tensor-core MLP of `config` where its hidden size is at least
/// [`TC_MIN_HIDDEN`] and the plans take its shapes; None keeps the MLP on
/// CUDA cores. Whether a build runs it also depends on what it asks for,
/// the arch and the ranks ([`KernelBuild::tensor_core_phases`]); the device
/// scratch is sized from this.
pub fn tc_plans(config: &Config) -> Option<TcPhases> {
    if config.hidden_size < TC_MIN_HIDDEN {
        return None;
    }
    let (h, i) = (config.hidden_size as u64, config.intermediate_size as u64);
    let m = &qmk_layout::TC_MACHINE_SM90;
    let (q, kv) = (config.q_dim() as u64, config.kv_dim() as u64);
    // A tile pairs rotary indices i and i + D / 2 in bands of 8 rows.
    if config.head_dim() % 16 != 0 {
        return None;
    }
    let qkv = qmk_layout::TcPlan::new("q_proj/k_proj/v_proj", q + 2 * kv, h, m).ok()?;
    let o_proj = qmk_layout::TcPlan::new("o_proj", h, q, m).ok()?;
    let down = qmk_layout::TcPlan::new("down_proj", h, i, m).ok()?;
    let gate_up = qmk_layout::TcPlan::new("gate_proj/up_proj", i.checked_mul(2)?, h, m).ok()?;
    Some(TcPhases {
        qkv,
        o_proj,
        down,
        gate_up,
        scratch: qmk_layout::TcScratch::for_plans(&[&qkv, &o_proj, &down, &gate_up]),
    })
}

/// Everything that goes into compiling the megakernel for one model.
#[derive(Debug, Clone)]
pub struct KernelBuild {
    /// The model configuration.
    pub config: Config,
    /// The model's split plan (chunks, shapes, strides).
    pub plan: ModelPlan,
    /// `qmk_plan.h`.
    pub plan_header: String,
    /// `qmk_params_check.h`.
    pub params_check: String,
    /// Identifies (sources, headers); compiled into the cubin as
    /// `qmk_fingerprint` so a cubin built for another model is refused.
    pub fingerprint: u64,
    /// Dynamic shared memory per CTA, floats, by the split attention's
    /// ring depth: `(8 slots, 16 slots)` ([`attn_ring`]); the arch picks
    /// ([`KernelBuild::smem_for`]).
    pub smem_floats: (u64, u64),
    /// Dynamic shared memory, floats, that each decode weight phase (q/k/v,
    /// o_proj, gate/up, down) needs to stage its warps' first rows (and a
    /// norm weight) before its prologue ([`decode_stage_floats`]); a phase
    /// stages on an arch only where this fits, and the kernel decides the
    /// same way from the `QMK_SMEM_FLOATS` it gets.
    pub stage_floats: [u64; 4],
    /// Grid barriers per decode step.
    pub barriers_per_step: u32,
    /// Dynamic shared memory per CTA of the prefill kernel, bytes.
    pub prefill_smem_bytes: u32,
    /// The same on archs with the wgmma prefill GEMM ([`crate::Arch::has_wgmma`]);
    /// None when the model's shapes do not fit that path (a K not a
    /// multiple of [`PREFILL_WGMMA_TILE`]'s K step), which then uses the
    /// mma.sync GEMM there too.
    pub prefill_smem_bytes_wgmma: Option<u32>,
    /// Grid barriers per prefill chunk (8 per layer + 1).
    pub prefill_barriers: u32,
    /// Ranks of the tensor-parallel group the build is for (1: one GPU;
    /// [`KernelBuild::for_rank`]).
    pub(crate) tp_ranks: u32,
    /// Whether the build asks for the tensor-core weight phases
    /// ([`KernelBuild::with_tensor_cores`]; rendered into the plan header,
    /// so the fingerprint tells the two apart).
    pub(crate) tensor_cores: bool,
}

impl KernelBuild {
    /// Dynamic shared memory per CTA of the decode kernel as compiled for
    /// `arch`, bytes.
    pub fn smem_for(&self, arch: crate::Arch) -> u32 {
        let ring = if attn_ring(arch) == 16 {
            self.smem_floats.1
        } else {
            self.smem_floats.0
        };
        // The tensor-core down phase's planes and partials (both steps run
        // it with one plan).
        let base = match self.tensor_core_phases(arch) {
            Some(t) => ring.max(t.down.machine.smem_bytes() / 4),
            None => ring,
        };
        let cap = u64::from(arch.max_smem_per_cta()) / 4;
        let f = self
            .stage_floats
            .iter()
            .copied()
            .filter(|&n| n <= cap)
            .fold(base, u64::max);
        // Checked when the build was made (base fits u32 as bytes; a staged
        // phase fits the arch).
        (f * 4) as u32
    }

    /// The NVRTC options that depend on the arch: the split attention's
    /// ring depth and the shared memory it sizes (`QMK_ATTN_RING`,
    /// `QMK_SMEM_FLOATS`), and the multi-token step's shared memory and
    /// largest token count (`QMK_MT_SMEM_FLOATS`, `QMK_MT_MAX_TOKENS`).
    pub fn arch_options(&self, arch: crate::Arch) -> Vec<String> {
        let mut o = vec![
            format!("-DQMK_ATTN_RING={}", attn_ring(arch)),
            format!("-DQMK_SMEM_FLOATS={}", self.smem_for(arch) / 4),
            format!("-DQMK_MT_SMEM_FLOATS={}", self.multi_smem_for(arch) / 4),
            format!("-DQMK_MT_MAX_TOKENS={}", self.multi_max_tokens(arch)),
        ];
        match self.tensor_core_phases(arch) {
            None => o.push("-DQMK_TC_PHASES=0".to_string()),
            Some(t) => {
                let m = t.down.machine;
                o.extend([
                    "-DQMK_TC_PHASES=1".to_string(),
                    format!("-DQMK_TC_GRID={}", m.grid),
                    format!("-DQMK_TC_TMAX={}", m.tmax),
                    format!("-DQMK_TC_INPUT_BYTES={}", m.input_bytes),
                    format!("-DQMK_TC_PART_BYTES={}", m.part_bytes),
                    format!("-DQMK_TC_STAGED={}", u8::from(m.staged)),
                    format!("-DQMK_TC_QKV_NKB={}", t.qkv.nkb),
                    format!("-DQMK_TC_QKV_SLOTS={}", t.qkv.slots),
                    format!("-DQMK_TC_QKV_MAXLT={}", t.qkv.maxlt),
                    format!("-DQMK_TC_O_NKB={}", t.o_proj.nkb),
                    format!("-DQMK_TC_O_SLOTS={}", t.o_proj.slots),
                    format!("-DQMK_TC_O_MAXLT={}", t.o_proj.maxlt),
                    format!("-DQMK_TC_DOWN_NKB={}", t.down.nkb),
                    format!("-DQMK_TC_DOWN_SLOTS={}", t.down.slots),
                    format!("-DQMK_TC_DOWN_MAXLT={}", t.down.maxlt),
                    format!("-DQMK_TC_GU_NKB={}", t.gate_up.nkb),
                    format!("-DQMK_TC_GU_SLOTS={}", t.gate_up.slots),
                    format!("-DQMK_TC_GU_MAXLT={}", t.gate_up.maxlt),
                    format!("-DQMK_TC_BCNT_OFF={}", t.scratch.bcnt_offset),
                    format!("-DQMK_TC_PART_OFF={}", t.scratch.part_offset),
                    format!("-DQMK_TC_BPART_OFF={}", t.scratch.bpart_offset),
                    format!("-DQMK_TC_SCRATCH_BYTES={}", t.scratch.bytes),
                ]);
            }
        }
        o
    }

    /// The MLP's tensor-core phases where the build for `arch` runs them
    /// ([`tc_plans`]): asked for ([`KernelBuild::with_tensor_cores`]),
    /// one GPU (a tensor-parallel rank keeps CUDA cores), on sm_90, whose
    /// shared memory holds the planned machine. Then the weight upload
    /// stores `down_proj`, `gate_proj` and `up_proj` in tile order
    /// ([`qmk_layout::TileOrder`]) and the prefill reads them so.
    pub fn tensor_core_phases(&self, arch: crate::Arch) -> Option<TcPhases> {
        if !self.tensor_cores || self.tp_ranks != 1 || !arch.has_wgmma() {
            return None;
        }
        let t = tc_plans(&self.config)?;
        // Beside the multi-token step's static shared memory.
        (t.down.machine.smem_bytes() + u64::from(MULTI_STATIC_SMEM)
            <= u64::from(arch.max_smem_per_cta()))
        .then_some(t)
    }

    /// Dynamic shared memory per CTA of the multi-token step on `arch`,
    /// bytes: all the arch offers one CTA but [`MULTI_STATIC_SMEM`] for the
    /// kernel's static shared memory, and never less than the one-token
    /// step's (it runs the same attention).
    pub fn multi_smem_for(&self, arch: crate::Arch) -> u32 {
        let all = arch.max_smem_per_cta().saturating_sub(MULTI_STATIC_SMEM) / 128 * 128;
        all.max(self.smem_for(arch))
    }

    /// The most tokens one multi-token step takes on `arch`: T normed
    /// activation vectors `[H]` f32 must fit its shared memory
    /// ([`KernelBuild::multi_smem_for`]), and at most
    /// [`crate::params::MULTI_MAX_TOKENS`]. Below 2 there is no multi-token
    /// step (its entries are not compiled).
    pub fn multi_max_tokens(&self, arch: crate::Arch) -> u32 {
        if self.tp_ranks > 1 {
            return 0;
        }
        let h = self.config.hidden_size as u64;
        let stride = h.div_ceil(32) * 32;
        let fit = u64::from(self.multi_smem_for(arch) / 4) / stride.max(1);
        fit.min(u64::from(crate::params::MULTI_MAX_TOKENS)) as u32
    }

    /// Dynamic shared memory of the prefill kernel as compiled for `arch`.
    pub fn prefill_smem_for(&self, arch: crate::Arch) -> u32 {
        match self.prefill_smem_bytes_wgmma {
            Some(b) if arch.has_wgmma() => b,
            _ => self.prefill_smem_bytes,
        }
    }
}

/// Prefill GEMM tile (kernels/cuda/prefill/gemm.cuh): largest rows x
/// B rows, K step and padded row length of the shared-memory tiles (bf16
/// elements).
pub const PREFILL_GEMM_TILE: (u64, u64, u64, u64) = (128, 128, 32, 40);

/// Shared-memory stages of the prefill GEMM's cp.async pipeline
/// (`kGemmStages`); 4 x 20 KB fits every target (sm_89 allows 99 KB).
pub const PREFILL_GEMM_STAGES: u64 = 4;

/// Dynamic shared memory of the prefill kernel for hidden size `h`: the
/// GEMM's stages (X tile + weight tile each) or the final norm's f32
/// vector, whichever is larger.
pub fn prefill_smem_bytes(h: u64) -> u64 {
    let (bm, bn, _, ld) = PREFILL_GEMM_TILE;
    (PREFILL_GEMM_STAGES * (bm + bn) * ld * 2).max(h * 4)
}

/// Weight rows x tokens of the largest wgmma GEMM tile
/// (`qmk::kWgRows` x `qmk::kWgTokMax`): one f32 partial tile per CTA of
/// the stream-K scratch.
pub const STREAM_K_TILE_ELEMS: u64 = 256 * 128;

/// wgmma prefill GEMM tile (kernels/cuda/prefill/wgmma.cuh, sm_90a): weight
/// rows, largest token count and K step of one CTA tile (bf16 elements; a
/// K step is one 128-byte swizzle row).
pub const PREFILL_WGMMA_TILE: (u64, u64, u64) = (256, 128, 64);

/// Shared-memory stages of the wgmma GEMM (`kWgStages`): 4 x 48 KB.
pub const PREFILL_WGMMA_STAGES: u64 = 4;

/// Dynamic shared memory of the prefill kernel with the wgmma GEMM: its
/// stages plus 1 KB to align them to the swizzle period, or the final
/// norm's f32 vector, whichever is larger.
pub fn prefill_smem_bytes_wgmma(h: u64) -> u64 {
    let (rows, toks, bk) = PREFILL_WGMMA_TILE;
    (PREFILL_WGMMA_STAGES * (rows + toks) * bk * 2 + 1024).max(h * 4)
}

fn dim(field: &'static str, v: usize) -> Result<u64> {
    let v = u64::try_from(v).map_err(|_| KernelsError::Config {
        field,
        reason: "does not fit 64 bits".into(),
    })?;
    if v == 0 || v > u32::MAX as u64 {
        return Err(KernelsError::Config {
            field,
            reason: format!("{v} is outside 1..=2^32-1"),
        });
    }
    Ok(v)
}

fn need(cond: bool, field: &'static str, reason: String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(KernelsError::Config { field, reason })
    }
}

impl KernelBuild {
    /// Plans `config` with the kernel's offset model and renders the headers.
    pub fn new(config: &Config) -> Result<KernelBuild> {
        let plan = qmk_model::model_plan(config)?;
        Self::with_plan(config, plan)
    }

    /// Renders the headers for a given plan (tests force other plans).
    pub fn with_plan(config: &Config, plan: ModelPlan) -> Result<KernelBuild> {
        let rows = config.vocab_size as u64;
        Self::with_plan_tp(config, plan, 1, rows, false)
    }

    /// The same build with the tensor-core weight phases asked for (`on`)
    /// or not: from [`TC_MIN_HIDDEN`] up, on sm_90, the MLP's down and
    /// gate/up run on tensor cores in both decode steps
    /// ([`KernelBuild::tensor_core_phases`]), the upload stores their
    /// weights in tile order and the prefill reads them so. Off by
    /// default: the phases are built and checked on the host, and wait for
    /// their GPU validation (docs/decisions, 0051). A tensor-parallel rank
    /// keeps CUDA cores.
    pub fn with_tensor_cores(&self, on: bool) -> Result<KernelBuild> {
        if on == self.tensor_cores {
            return Ok(self.clone());
        }
        if self.tp_ranks != 1 {
            return Err(KernelsError::Config {
                field: "tensor_cores",
                reason: "a tensor-parallel rank keeps its weight phases on CUDA cores".into(),
            });
        }
        Self::with_plan_tp(
            &self.config,
            self.plan.clone(),
            1,
            self.config.vocab_size as u64,
            on,
        )
    }

    /// Whether the build asks for the tensor-core weight phases
    /// ([`KernelBuild::with_tensor_cores`]).
    pub fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    /// [`KernelBuild::with_plan`] for one rank of `ranks` (1: one GPU):
    /// `config` and `plan` are the rank's, `embed_rows` the rows of the
    /// whole embedding table (every rank holds it).
    pub(crate) fn with_plan_tp(
        config: &Config,
        plan: ModelPlan,
        ranks: u32,
        embed_rows: u64,
        tensor_cores: bool,
    ) -> Result<KernelBuild> {
        config.validate()?;
        let h = dim("hidden_size", config.hidden_size)?;
        let i = dim("intermediate_size", config.intermediate_size)?;
        let l = dim("num_hidden_layers", config.num_hidden_layers)?;
        let heads = dim("num_attention_heads", config.num_attention_heads)?;
        let kvh = dim("num_key_value_heads", config.num_kv_heads())?;
        let d = dim("head_dim", config.head_dim())?;
        let v = dim("vocab_size", config.vocab_size)?;
        let q = dim("q_dim", config.q_dim())?;
        let kv = dim("kv_dim", config.kv_dim())?;
        // 16-byte weight loads cover whole rows; lanes cover whole heads.
        need(
            h % 8 == 0,
            "hidden_size",
            format!("{h} is not a multiple of 8"),
        )?;
        need(
            i % 8 == 0,
            "intermediate_size",
            format!("{i} is not a multiple of 8"),
        )?;
        need(q % 8 == 0, "q_dim", format!("{q} is not a multiple of 8"))?;
        need(
            d == 64 || d == 128,
            "head_dim",
            format!("{d}: the kernel's attention supports 64 and 128 (every Qwen2.5 model)"),
        )?;
        need(
            heads % kvh == 0,
            "num_key_value_heads",
            format!("{kvh} does not divide {heads} heads"),
        )?;
        need(
            v.checked_mul(h)
                .and_then(|x| x.checked_mul(2))
                .is_some_and(|b| b <= 1 << 32),
            "vocab_size",
            format!("the [{v}, {h}] bf16 table exceeds the 32-bit row offsets"),
        )?;

        need(
            embed_rows >= v
                && embed_rows
                    .checked_mul(h)
                    .and_then(|x| x.checked_mul(2))
                    .is_some_and(|b| b <= 1 << 32),
            "vocab_size",
            format!("the [{embed_rows}, {h}] bf16 embedding exceeds the 32-bit row offsets"),
        )?;
        let region = crate::tp::TpRegion::new(h)?;

        for name in KERNEL_TENSORS {
            let t = plan.tensor(name);
            match (name, t) {
                ("lm_head", None) if config.tie_word_embeddings => {}
                (_, None) => {
                    return Err(KernelsError::Plan {
                        tensor: name.into(),
                        reason: "missing from the model plan".into(),
                    })
                }
                (_, Some(t)) => {
                    if t.chunks.len() > MAX_CHUNKS {
                        return Err(KernelsError::Plan {
                            tensor: name.into(),
                            reason: format!(
                                "{} chunks exceed the kernel's MAX_CHUNKS = {MAX_CHUNKS}",
                                t.chunks.len()
                            ),
                        });
                    }
                    let whole = matches!(name, "embed_tokens" | "lm_head" | "norm");
                    if whole && t.chunks.len() != 1 {
                        return Err(KernelsError::Plan {
                            tensor: name.into(),
                            reason: "the kernel addresses this table as one chunk".into(),
                        });
                    }
                }
            }
        }

        // The split attention (decode/attention.cuh, kAttnSplitSmemFloats): q of a
        // kv group [G, D], then the largest of the K/V ring [W, ATTN_RING, 32]
        // of 16 bytes, the warp merge [W, G, D + 2] and the combine's stage
        // [W, ATTN_MAX_SPLITS, 6].
        let group = heads / kvh.max(1);
        let combine_stage = WARPS_PER_CTA * u64::from(crate::params::ATTN_MAX_SPLITS) * 6;
        let smem_floats_with = |ring: u64| -> Result<u64> {
            let attn_stream = WARPS_PER_CTA * ring * 32 * 4;
            let attn_split = group * d
                + attn_stream
                    .max(WARPS_PER_CTA * group * (d + 2))
                    .max(combine_stage);
            let floats = [h, q, i, 2 * WARPS_PER_CTA + WARPS_PER_CTA * d, attn_split]
                .into_iter()
                .max()
                .unwrap_or(h);
            u32::try_from(floats * 4).map_err(|_| KernelsError::Config {
                field: "intermediate_size",
                reason: "shared memory size overflows".into(),
            })?;
            Ok(floats)
        };
        let smem_floats = (smem_floats_with(8)?, smem_floats_with(16)?);
        // A rank adds a barrier after each of its two all-reduces a layer.
        let barriers = l * if ranks > 1 { 7 } else { 5 } + 1;
        // A rank build has no prefill kernel (prefill/chunk.cuh).
        need(
            ranks > 1
                || (h % PREFILL_GEMM_TILE.2 == 0
                    && q % PREFILL_GEMM_TILE.2 == 0
                    && i % PREFILL_GEMM_TILE.2 == 0),
            "hidden_size",
            format!(
                "the prefill GEMM needs hidden ({h}), q_dim ({q}) and intermediate ({i}) in multiples of {}",
                PREFILL_GEMM_TILE.2
            ),
        )?;
        let pf_smem = prefill_smem_bytes(h);
        let pf_smem_wg = prefill_smem_bytes_wgmma(h);
        let wg_k = PREFILL_WGMMA_TILE.2;
        let wgmma_fits = h % wg_k == 0 && q % wg_k == 0 && i % wg_k == 0;
        let pf_barriers = l * 8 + 1;
        let consts: Vec<(&str, u64)> = vec![
            ("QMK_HIDDEN", h),
            ("QMK_INTER", i),
            ("QMK_LAYERS", l),
            ("QMK_HEADS", heads),
            ("QMK_KV_HEADS", kvh),
            ("QMK_HEAD_DIM", d),
            ("QMK_VOCAB", v),
            ("QMK_Q_DIM", q),
            ("QMK_KV_DIM", kv),
            ("QMK_TIED", config.tie_word_embeddings as u64),
            ("QMK_THREADS_PER_CTA", THREADS_PER_CTA as u64),
            ("QMK_BARRIERS_PER_STEP", barriers),
            ("QMK_PREFILL_SMEM_BYTES", pf_smem),
            ("QMK_PREFILL_SMEM_BYTES_WGMMA", pf_smem_wg),
            ("QMK_STREAM_K_TILE_ELEMS", STREAM_K_TILE_ELEMS),
            ("QMK_PREFILL_BARRIERS", pf_barriers),
            ("QMK_ATTN_TILE", ATTN_TILE),
            ("QMK_STAGE_VECTORS", STAGE_VECTORS),
            ("QMK_PAIR_BATCH_MOST", PAIR_BATCH_MOST),
            ("QMK_MT_WIDE_FROM", MULTI_WIDE_FROM),
            ("QMK_MT_RING_MOST", MULTI_RING_MOST),
            ("QMK_MT_RING_BIG", MULTI_RING_BIG),
            ("QMK_EMBED_ROWS", embed_rows),
            ("QMK_TP_FLAGS_OFF", region.flags),
            ("QMK_TP_FAILED_OFF", region.failed),
            ("QMK_TP_PICKS_OFF", region.picks),
        ];
        let rendered = qmk_layout::try_render_header(&plan, &consts)?;
        // The constants live in namespace qmk_plan; the kernel uses them
        // unqualified (a using-directive would also pull in the tensor
        // namespaces, whose names clash with the op functions).
        let mut plan_header = rendered;
        plan_header.push('\n');
        for (name, _) in &consts {
            plan_header.push_str(&format!(
                "constexpr unsigned long long {name} = qmk_plan::{name};\n"
            ));
        }
        // A macro, not a constant: the preprocessor keeps a rank build's
        // exchanges out of one-GPU builds, and its prefill and multi-token
        // entries out of rank builds.
        plan_header.push_str(&format!("#define QMK_TP_RANKS {ranks}\n"));
        // Whether the tensor-core phases were asked for (the arch decides
        // whether they run: QMK_TC_PHASES); here, so the fingerprint of a
        // build that stores weights in tile order differs.
        plan_header.push_str(&format!(
            "#define QMK_TENSOR_CORES {}\n",
            u8::from(tensor_cores)
        ));
        let params_check = params_check_header();

        let mut hasher = Sha256::new();
        for (name, text) in std::iter::once(&source::MAIN).chain(source::HEADERS) {
            hasher.update(name.as_bytes());
            hasher.update((text.len() as u64).to_le_bytes());
            hasher.update(text.as_bytes());
        }
        hasher.update(plan_header.as_bytes());
        hasher.update(params_check.as_bytes());
        let digest = hasher.finalize();
        let mut eight = [0u8; 8];
        eight.copy_from_slice(&digest[..8]);
        let fingerprint = u64::from_le_bytes(eight);
        plan_header.push_str(&format!(
            "extern \"C\" __device__ const unsigned long long qmk_fingerprint = {fingerprint}ull;\n"
        ));

        Ok(KernelBuild {
            config: config.clone(),
            plan,
            plan_header,
            params_check,
            fingerprint,
            smem_floats,
            stage_floats: decode_stage_floats(h, q, i),
            barriers_per_step: barriers as u32,
            prefill_smem_bytes: u32::try_from(pf_smem).map_err(|_| KernelsError::Config {
                field: "hidden_size",
                reason: "prefill shared memory size overflows".into(),
            })?,
            prefill_smem_bytes_wgmma: match wgmma_fits {
                true => Some(u32::try_from(pf_smem_wg).map_err(|_| KernelsError::Config {
                    field: "hidden_size",
                    reason: "prefill shared memory size overflows".into(),
                })?),
                false => None,
            },
            prefill_barriers: pf_barriers as u32,
            tp_ranks: ranks,
            tensor_cores,
        })
    }

    /// The in-memory headers NVRTC gets.
    pub fn headers(&self) -> Vec<(&str, &str)> {
        let mut v: Vec<(&str, &str)> = source::HEADERS.to_vec();
        v.push((source::RENDERED[0], &self.plan_header));
        v.push((source::RENDERED[1], &self.params_check));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_constants_are_rendered() {
        for (preset, h) in [("0.5b", 896u64), ("7b", 3584), ("72b", 8192)] {
            let c = Config::preset(preset).unwrap();
            let b = KernelBuild::new(&c).unwrap();
            assert_eq!(u64::from(b.prefill_smem_bytes), prefill_smem_bytes(h));
            assert_eq!(
                b.prefill_barriers,
                8 * c.num_hidden_layers as u32 + 1,
                "{preset}"
            );
            assert!(b
                .plan_header
                .contains("constexpr unsigned long long QMK_PREFILL_SMEM_BYTES"));
        }
        // (64 + 2 x 128) rows x 40 bf16: the gate/up stage; 72B's final-norm
        // vector (8192 f32) is larger.
        assert_eq!(prefill_smem_bytes(896), 81_920);
        assert_eq!(prefill_smem_bytes(8192), 81_920);
        // 4 stages x (256 + 128) rows x 128 B + 1 KB alignment slack.
        assert_eq!(prefill_smem_bytes_wgmma(896), 197_632);
        for preset in ["0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b"] {
            let b = KernelBuild::new(&Config::preset(preset).unwrap()).unwrap();
            assert_eq!(b.prefill_smem_bytes_wgmma, Some(197_632), "{preset}");
            assert_eq!(b.prefill_smem_for(crate::Arch::SM90), 197_632);
            assert_eq!(b.prefill_smem_for(crate::Arch::SM89), 81_920);
        }
    }

    #[test]
    fn the_multi_token_step_takes_what_shared_memory_holds() {
        use crate::Arch;
        let tokens = |preset: &str, arch| {
            let b = KernelBuild::new(&Config::preset(preset).unwrap()).unwrap();
            assert!(
                b.multi_smem_for(arch) >= b.smem_for(arch),
                "{preset} {arch}"
            );
            assert_eq!(b.multi_smem_for(arch) % 128, 0, "{preset} {arch}");
            b.multi_max_tokens(arch)
        };
        // sm_90: 227 KB less 4 KB, 57,088 floats.
        assert_eq!(tokens("0.5b", Arch::SM90), 8);
        assert_eq!(tokens("7b", Arch::SM90), 8);
        assert_eq!(tokens("32b", Arch::SM90), 8); // [5,120]: 11 would fit
        assert_eq!(tokens("72b", Arch::SM90), 6); // [8,192]: 6.97
        assert_eq!(tokens("7b", Arch::SM89), 6); // 24,320 / 3,584
        assert_eq!(tokens("14b", Arch::SM80), 7); // 40,704 / 5,120
    }

    #[test]
    fn the_decode_shared_memory_follows_the_arch() {
        use crate::Arch;
        // 7B: the activation vector [18,944] f32 on sm_80 / sm_89 and below;
        // on sm_90 the ring of 16 x 16-byte slots per lane (128 KB) and q
        // [7, 128] f32 are larger; with the tensor-core phases, on sm_90
        // their 161 KB of planes and 60 KB of partials are larger still.
        let b = KernelBuild::new(&Config::preset("7b").unwrap()).unwrap();
        assert_eq!(b.smem_for(Arch::SM89), 18_944 * 4);
        assert_eq!(b.smem_for(Arch::SM90), (7 * 128 + 16 * 16 * 32 * 4) * 4);
        assert_eq!(b.smem_for(Arch::SM80), b.smem_for(Arch::SM90));
        let tc = b.with_tensor_cores(true).unwrap();
        assert_eq!(tc.smem_for(Arch::SM90), (161 + 60) * 1024);
        assert_eq!(tc.smem_for(Arch::SM80), b.smem_for(Arch::SM80));
        // The multi-token step: sm_89's 99 KB less its static reserve,
        // 24,320 floats, six normed vectors [3,584].
        assert_eq!(
            b.arch_options(Arch::SM89),
            [
                "-DQMK_ATTN_RING=8",
                "-DQMK_SMEM_FLOATS=18944",
                "-DQMK_MT_SMEM_FLOATS=24320",
                "-DQMK_MT_MAX_TOKENS=6",
                "-DQMK_TC_PHASES=0"
            ]
        );
        // The ring never pushes a preset past its arch's limit: it fits
        // wherever its activation vector does (32B's and 72B's [I] f32 are
        // past sm_89's 99 KB).
        for preset in ["0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b"] {
            let c = Config::preset(preset).unwrap();
            let b = KernelBuild::new(&c).unwrap();
            let vector = 4 * c.intermediate_size.max(c.hidden_size) as u32;
            for arch in Arch::CI {
                let limit = arch.max_smem_per_cta();
                assert_eq!(
                    b.smem_for(arch) <= limit,
                    vector <= limit,
                    "{preset} {arch}"
                );
            }
        }
    }

    #[test]
    fn the_mlp_runs_on_tensor_cores_from_7b_on_one_sm_90_gpu_when_asked() {
        use crate::Arch;
        let build = |preset: &str| {
            KernelBuild::new(&Config::preset(preset).unwrap())
                .unwrap()
                .with_tensor_cores(true)
                .unwrap()
        };
        for preset in ["0.5b", "1.5b", "3b"] {
            assert!(
                tc_plans(&Config::preset(preset).unwrap()).is_none(),
                "{preset}"
            );
            assert!(
                build(preset).tensor_core_phases(Arch::SM90).is_none(),
                "{preset}"
            );
        }
        for preset in ["7b", "14b", "32b", "72b"] {
            let b = build(preset);
            let t = b.tensor_core_phases(Arch::SM90).expect(preset);
            let (h, i) = (
                b.config.hidden_size as u64,
                b.config.intermediate_size as u64,
            );
            assert_eq!((t.down.rows, t.down.k), (h, i));
            assert_eq!((t.o_proj.rows, t.o_proj.k), (h, b.config.q_dim() as u64));
            let qkv_rows = (b.config.q_dim() + 2 * b.config.kv_dim()) as u64;
            assert_eq!((t.qkv.rows, t.qkv.k), (qkv_rows, h));
            assert_eq!((t.gate_up.rows, t.gate_up.k), (2 * i, h));
            // Not before sm_90 (its shared memory does not hold the machine),
            // nor on a tensor-parallel rank.
            assert!(b.tensor_core_phases(Arch::SM80).is_none(), "{preset}");
            assert!(b.tensor_core_phases(Arch::SM89).is_none(), "{preset}");
            let rank = KernelBuild::for_rank(&b.config, 2).unwrap();
            assert!(rank.tensor_core_phases(Arch::SM90).is_none(), "{preset}");
            assert!(rank
                .arch_options(Arch::SM90)
                .contains(&"-DQMK_TC_PHASES=0".to_string()));
            assert!(rank.with_tensor_cores(true).is_err(), "{preset}");
            // Asked for or not: another fingerprint, and off by default.
            let off = b.with_tensor_cores(false).unwrap();
            assert!(off.tensor_core_phases(Arch::SM90).is_none(), "{preset}");
            assert_ne!(off.fingerprint, b.fingerprint, "{preset}");
            assert_eq!(
                off.fingerprint,
                KernelBuild::new(&b.config).unwrap().fingerprint
            );
            // The kernel gets the plans' numbers, and the launch the shared
            // memory they take.
            let o = b.arch_options(Arch::SM90);
            for want in [
                "-DQMK_TC_PHASES=1".to_string(),
                format!("-DQMK_TC_DOWN_NKB={}", t.down.nkb),
                format!("-DQMK_TC_GU_SLOTS={}", t.gate_up.slots),
                format!("-DQMK_TC_PART_OFF={}", t.scratch.part_offset),
                format!("-DQMK_TC_SCRATCH_BYTES={}", t.scratch.bytes),
                format!("-DQMK_TC_O_MAXLT={}", t.o_proj.maxlt),
                format!("-DQMK_TC_QKV_SLOTS={}", t.qkv.slots),
            ] {
                assert!(o.contains(&want), "{preset}: {want} not in {o:?}");
            }
            assert!(
                u64::from(b.smem_for(Arch::SM90)) >= t.down.machine.smem_bytes(),
                "{preset}"
            );
        }
    }

    #[test]
    fn short_rows_stage_their_first_batch() {
        use crate::Arch;
        // 0.5B: hidden 896 and q 896 are 4 vectors per lane; the
        // intermediate 4,864 is 19 and does not stage. q/k/v and gate/up:
        // the vector, the norm weight [896] bf16 and 16 warps x 2 rows x 4
        // vectors x 32 lanes x 16 bytes; o_proj one row of 4 per warp.
        let b = KernelBuild::new(&Config::preset("0.5b").unwrap()).unwrap();
        let normed = 896 + 448 + 16 * 2 * 4 * 32 * 4;
        assert_eq!(b.stage_floats, [normed, 896 + 16 * 4 * 32 * 4, normed, 0]);
        assert_eq!(batch_vectors(4_864, 1), 19);
        assert_eq!(batch_vectors(18_944, 1), 8);
        assert_eq!(batch_vectors(896, 2), 4);
        // Longer pairs in equal batches: 7B's 14 per lane as 2 x 7, 14B's
        // 20 as 2 x 10, 72B's 32 as 4 x 8.
        assert_eq!(batch_vectors(3_584, 2), 7);
        assert_eq!(batch_vectors(5_120, 2), 10);
        assert_eq!(batch_vectors(8_192, 2), 8);
        // Where the split attention's ring takes more, the stage changes
        // nothing; on sm_89 it sets the size.
        assert_eq!(b.smem_for(Arch::SM90), b.smem_floats.1 as u32 * 4);
        assert!(b.smem_floats.0 < normed);
        assert_eq!(b.smem_for(Arch::SM89), normed as u32 * 4);
        // From 7B on every row is longer than 4 vectors per lane.
        for preset in ["7b", "14b", "32b", "72b"] {
            let b = KernelBuild::new(&Config::preset(preset).unwrap()).unwrap();
            assert_eq!(b.stage_floats, [0; 4], "{preset}");
        }
    }
}
