//! `qwen-mk plan`: how every stacked weight tensor of a model is laid out
//! and where the planner splits it so the kernel's 32-bit offsets never wrap.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use qmk_layout::{Bytes, ModelPlan, OffsetModel, TensorPlan};
use qmk_model::{Config, WeightBytes, WeightKind};
use serde::Serialize;

/// Arguments of `qwen-mk plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A Qwen2.5 size: 0.5b, 1.5b, 3b, 7b, 14b, 32b or 72b.
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    pub preset: Option<String>,
    /// A config.json, or a model directory holding one.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// KV-cache positions to size device memory for.
    #[arg(long, default_value_t = 4096, allow_negative_numbers = true,
          value_parser = crate::common::whole::<u32>(1..=crate::common::MAX_POSITIONS))]
    pub context: u32,
    /// Device memory to find the largest context for: bytes, or with a unit
    /// (141GB, 139.8GiB). Default: an H200's 150,109,880,320 bytes.
    #[arg(long, value_name = "SIZE", default_value = "150109880320", value_parser = parse_size)]
    pub device_memory: u64,
    /// Tensor-parallel ranks (GPUs) to shard the model over: prints what
    /// each rank holds, its bytes and its chunks.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true,
          value_parser = crate::common::whole::<u32>(1..=MAX_TP))]
    pub tp: u32,
}

/// The most tensor-parallel ranks `plan` shards for (GPUs of one host).
const MAX_TP: i64 = 64;

/// `150109880320`, `141GB`, `139.8GiB`, `512 MiB`: bytes, decimal (kB, MB,
/// GB, TB) or binary (KiB, MiB, GiB, TiB) units.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => (1u64 << 20) as f64,
        "gib" => (1u64 << 30) as f64,
        "tib" => (1u64 << 40) as f64,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    if unit.is_empty() || unit.eq_ignore_ascii_case("b") {
        return num.parse::<u64>().map_err(|e| format!("`{s}`: {e}"));
    }
    let v: f64 = num.parse().map_err(|e| format!("`{s}`: {e}"))?;
    let bytes = (v * scale).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(bytes as u64)
}

/// What running the model needs, beside the layout: device memory for the
/// weights, the KV cache at `context` positions and the scratch buffers; the
/// host memory the weights stream through (the upload's pinned buffers,
/// whatever the model's size); and the largest context (with the prefill
/// kernel's scratch, up to the model's maximum) that `device_memory` bytes
/// hold.
#[derive(Serialize)]
struct MemoryNeed {
    context: u32,
    device_bytes: u64,
    weight_bytes: u64,
    kv_cache_bytes: u64,
    scratch_bytes: u64,
    host_staging_bytes: u64,
    device_memory: u64,
    largest_context: Option<u32>,
}

/// Grid the scratch buffers are sized for (an H200 has 132 SMs); the scratch
/// is a few MB, so the choice barely moves the total.
const PLAN_GRID: u32 = 132;

fn memory_need(config: &Config, context: u32, device_memory: u64) -> Result<MemoryNeed> {
    let m = qmk_gpu::MemoryPlan::sizes(config, context, PLAN_GRID, None)
        .context("sizing device memory")?;
    let kv = m
        .kv_cache_bytes
        .checked_mul(2)
        .context("KV cache size overflows")?;
    let scratch = m
        .total_bytes
        .checked_sub(m.weight_bytes)
        .and_then(|r| r.checked_sub(kv))
        .context("memory plan totals disagree")?;
    Ok(MemoryNeed {
        context,
        device_bytes: m.total_bytes,
        weight_bytes: m.weight_bytes,
        kv_cache_bytes: kv,
        scratch_bytes: scratch,
        host_staging_bytes: qmk_gpu::UploadOptions::default()
            .host_bytes()
            .context("staging size overflows")? as u64,
        device_memory,
        largest_context: largest_context(config, device_memory),
    })
}

/// The largest context `device_memory` bytes hold for `config` as
/// `generate` runs it (the prefill kernel's default chunk, the reserve the
/// backend keeps free), up to the model's maximum.
fn largest_context(config: &Config, device_memory: u64) -> Option<u32> {
    let limit = u32::try_from(config.max_context()).unwrap_or(u32::MAX);
    qmk_gpu::largest_context(
        config,
        device_memory.saturating_sub(qmk_gpu::FIT_RESERVE_BYTES),
        PLAN_GRID,
        Some(qmk_gpu::DEFAULT_PREFILL_CHUNK),
        limit,
    )
}

/// `plan --json` output: the plan plus what it was made for and totals.
#[derive(Serialize)]
struct PlanJson<'a> {
    /// The preset name or the config path.
    model: &'a str,
    offset_model: &'a OffsetModel,
    /// Flat per tensor: name, shape, stride, dtype, byte_span, chunks.
    tensors: &'a [TensorPlan],
    /// Sum of every tensor's byte span.
    total_bytes: Bytes,
    /// Weight bytes one decode step reads (see `qmk_model::WeightBytes`).
    per_decode_step_bytes: Bytes,
    /// Device and host memory needed to run it.
    memory: MemoryNeed,
    /// With `--tp N` above 1: every tensor's rule and shards, each rank's
    /// plan and bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    tensor_parallel: Option<TpJson>,
}

/// `plan --tp N --json`: the sharding and each rank's totals.
#[derive(Serialize)]
struct TpJson {
    #[serde(flatten)]
    plan: qmk_layout::TpPlan,
    /// Bytes each rank holds, in rank order.
    rank_bytes: Vec<u64>,
}

fn tp_json(config: &Config, ranks: u32) -> Result<Option<TpJson>> {
    if ranks <= 1 {
        return Ok(None);
    }
    let plan = qmk_model::tp_plan(config, ranks as usize)?;
    let mut rank_bytes = Vec::with_capacity(ranks as usize);
    for r in 0..ranks as usize {
        rank_bytes.push(plan.rank_bytes(r)?);
    }
    Ok(Some(TpJson { plan, rank_bytes }))
}

pub fn run(args: PlanArgs) -> Result<()> {
    let (label, config) = match (&args.preset, &args.config) {
        (Some(name), _) => (name.clone(), Config::preset(name)?),
        (None, Some(path)) => {
            let file = if path.is_dir() {
                path.join("config.json")
            } else {
                path.clone()
            };
            (file.display().to_string(), Config::from_file(&file)?)
        }
        (None, None) => unreachable!("clap requires --preset or --config"),
    };
    let plan = qmk_model::model_plan(&config).context("planning the weight layout")?;
    let bytes = qmk_model::weight_bytes(&config)?;
    let memory = memory_need(&config, args.context, args.device_memory)?;
    let tp = tp_json(&config, args.tp)?;
    if args.json {
        let out = PlanJson {
            model: &label,
            offset_model: &plan.offset_model,
            tensors: &plan.tensors,
            total_bytes: bytes.total,
            per_decode_step_bytes: bytes.per_decode_step,
            memory,
            tensor_parallel: tp,
        };
        crate::output::print(&format!("{}\n", serde_json::to_string(&out)?))
    } else {
        let mut text = render(&label, &config, &plan, &bytes)?;
        writeln!(
            text,
            "device memory at {} positions: {} (weights {} + KV cache {} + scratch {}); \
             host memory the weights stream through: {}",
            memory.context,
            bytes_str(memory.device_bytes),
            bytes_str(memory.weight_bytes),
            bytes_str(memory.kv_cache_bytes),
            bytes_str(memory.scratch_bytes),
            bytes_str(memory.host_staging_bytes)
        )?;
        let max = config.max_context();
        match memory.largest_context {
            Some(c) => writeln!(
                text,
                "largest context in {} of device memory: {c} positions (model maximum {max})",
                bytes_str(memory.device_memory)
            )?,
            None => writeln!(
                text,
                "largest context in {} of device memory: none, the model does not fit",
                bytes_str(memory.device_memory)
            )?,
        }
        if let Some(tp) = &tp {
            text.push('\n');
            text.push_str(&render_tp(tp)?);
        }
        crate::output::print(&text)
    }
}

/// `6.79 GB (6794772480 bytes)`, `491.52 kB (491520 bytes)`: decimal units,
/// the largest that keeps the number at least 1.
fn bytes(b: Bytes) -> String {
    let (unit, name) = [(1_000_000_000u64, "GB"), (1_000_000, "MB"), (1_000, "kB")]
        .into_iter()
        .find(|&(u, _)| b.0 >= u)
        .unwrap_or((1, "B"));
    if unit == 1 {
        return format!("{} bytes", b.0);
    }
    // Integer rounding to hundredths; u128 so `* 100` cannot overflow.
    let hundredths = (u128::from(b.0) * 100 + u128::from(unit / 2)) / u128::from(unit);
    format!(
        "{}.{:02} {name} ({} bytes)",
        hundredths / 100,
        hundredths % 100,
        b.0
    )
}

/// The person-readable report.
fn render(label: &str, c: &Config, plan: &ModelPlan, totals: &WeightBytes) -> Result<String> {
    let mut s = String::new();
    writeln!(
        s,
        "model {label}: {} layers, hidden {}, intermediate {}, heads {} (kv {}) x {}, vocab {}, {}",
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_kv_heads(),
        c.head_dim(),
        c.vocab_size,
        if c.tie_word_embeddings {
            "tied embeddings"
        } else {
            "untied lm_head"
        },
    )?;
    let limit = plan.offset_model.limit()?;
    writeln!(
        s,
        "offset model: {} (a chunk's largest offset must stay below {limit})\n",
        plan.offset_model
    )?;
    let layouts: Vec<String> = plan
        .tensors
        .iter()
        .map(|t| t.spec.layout.to_string())
        .collect();
    let name_w = plan
        .tensors
        .iter()
        .map(|t| t.spec.name.len())
        .chain([6])
        .max()
        .unwrap_or(6);
    let layout_w = layouts
        .iter()
        .map(String::len)
        .chain([6])
        .max()
        .unwrap_or(6);
    writeln!(
        s,
        "{:name_w$}  {:5}  {:layout_w$}  {:>32}  chunks",
        "tensor", "dtype", "layout", "byte span"
    )?;
    let mut split = 0usize;
    let mut chunks = 0usize;
    for (t, layout) in plan.tensors.iter().zip(&layouts) {
        let span = t.spec.byte_span()?;
        let per_layer = WeightKind::ALL
            .iter()
            .find(|k| k.name() == t.spec.name)
            .is_some_and(|k| k.per_layer());
        let axis = if per_layer { "layers" } else { "rows" };
        chunks += t.chunks.len();
        let note = if t.is_split() {
            split += 1;
            format!("{} (split)", t.chunks.len())
        } else {
            "1 (whole)".to_string()
        };
        writeln!(
            s,
            "{:name_w$}  {:5}  {layout:layout_w$}  {:>32}  {note}",
            t.spec.name,
            t.spec.dtype.to_string(),
            bytes(span)
        )?;
        if t.is_split() {
            for (i, ch) in t.chunks.iter().enumerate() {
                writeln!(
                    s,
                    "{:name_w$}    chunk {i}: {axis} [{}, {}) {}",
                    "",
                    ch.start,
                    ch.end,
                    bytes(ch.byte_span)
                )?;
            }
        }
    }
    writeln!(
        s,
        "\n{} tensors, {split} split, {chunks} chunks in all",
        plan.tensors.len()
    )?;
    writeln!(s, "weights: {}", bytes(totals.total))?;
    writeln!(
        s,
        "read per decode step: {} (every weight but the embedding table, one embedding row{})",
        bytes(totals.per_decode_step),
        if c.tie_word_embeddings {
            ", and the tied embedding table as LM head"
        } else {
            ""
        }
    )?;
    Ok(s)
}

/// The tensor-parallel report: every rank holds the same shapes, so one
/// table of shards (with each rank's range of the cut axis), then each
/// rank's bytes and chunks.
fn render_tp(tp: &TpJson) -> Result<String> {
    let mut s = String::new();
    let ranks = tp.plan.ranks;
    writeln!(
        s,
        "tensor parallel over {ranks} ranks (every rank holds the same shapes):"
    )?;
    let name_w = tp
        .plan
        .tensors
        .iter()
        .map(|t| t.spec.name.len())
        .chain([6])
        .max()
        .unwrap_or(6);
    writeln!(
        s,
        "{:name_w$}  {:24}  {:>32}  {:>6}  ranges of the cut axis",
        "tensor", "rule", "shard bytes", "chunks"
    )?;
    let rank0 = &tp.plan.rank_plans[0];
    for (t, planned) in tp.plan.tensors.iter().zip(&rank0.tensors) {
        let rule = match t.rule {
            qmk_layout::ShardRule::Replicated => "replicated".to_string(),
            qmk_layout::ShardRule::Split { axis, unit } => {
                format!("axis {axis}, units of {unit}")
            }
        };
        let ranges = match t.rule {
            qmk_layout::ShardRule::Replicated => String::new(),
            qmk_layout::ShardRule::Split { .. } => t
                .shards
                .iter()
                .map(|sh| format!("[{}, {})", sh.range.start, sh.range.end))
                .collect::<Vec<_>>()
                .join(" "),
        };
        writeln!(
            s,
            "{:name_w$}  {rule:24}  {:>32}  {:>6}  {ranges}",
            t.spec.name,
            bytes(planned.spec.byte_span()?),
            planned.chunks.len(),
        )?;
    }
    for (r, (plan, b)) in tp.plan.rank_plans.iter().zip(&tp.rank_bytes).enumerate() {
        let chunks: usize = plan.tensors.iter().map(|t| t.chunks.len()).sum();
        let split = plan.split_tensors().count();
        writeln!(
            s,
            "rank {r}: {} in {chunks} chunks ({split} tensors split for the 32-bit offsets)",
            bytes(Bytes(*b))
        )?;
    }
    Ok(s)
}

fn bytes_str(b: u64) -> String {
    format!(
        "{:.2} GB ({:.2} GiB)",
        b as f64 / 1e9,
        b as f64 / (1u64 << 30) as f64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_need_adds_kv_cache_and_scratch_to_the_weights() {
        let c = Config::preset("72b").unwrap();
        let m = memory_need(&c, 4096, 150_109_880_320).unwrap();
        // K and V: 80 layers x 4096 positions x 1024 (8 kv heads x 128) x 2 bytes each.
        assert_eq!(m.kv_cache_bytes, 2 * 80 * 4096 * 1024 * 2);
        assert_eq!(m.weight_bytes, qmk_model::weight_bytes(&c).unwrap().total.0);
        assert_eq!(
            m.device_bytes,
            m.weight_bytes + m.kv_cache_bytes + m.scratch_bytes
        );
        assert!(m.scratch_bytes > 0);
        // The weights stream through 192 MiB of pinned buffers.
        assert_eq!(m.host_staging_bytes, 192 << 20);
        // An H200 holds 72B with about 11.6k positions (weights 145.41 GB,
        // 327,680 B per position, the prefill scratch, the 512 MiB reserve);
        // 80 GB holds nothing.
        let best = m.largest_context.unwrap();
        assert!((11_000..12_500).contains(&best), "{best}");
        let fits = |cap| {
            let p = qmk_gpu::MemoryPlan::new(&c, cap, PLAN_GRID, Some(2048.min(cap))).unwrap();
            p.total_bytes + qmk_gpu::FIT_RESERVE_BYTES <= 150_109_880_320
        };
        assert!(fits(best) && !fits(best + 1));
        assert_eq!(largest_context(&c, 80_000_000_000), None);
        // 0.5B: the model's maximum.
        let small = Config::preset("0.5b").unwrap();
        assert_eq!(
            largest_context(&small, 150_109_880_320),
            Some(small.max_position_embeddings as u32)
        );
    }

    #[test]
    fn device_memory_sizes() {
        assert_eq!(parse_size("150109880320"), Ok(150_109_880_320));
        assert_eq!(parse_size("141GB"), Ok(141_000_000_000));
        assert_eq!(parse_size("141 GiB"), Ok(141 << 30));
        assert_eq!(parse_size("0.5MiB"), Ok(1 << 19));
        assert_eq!(parse_size("80gb"), Ok(80_000_000_000));
        assert!(parse_size("12XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("GB").is_err());
        assert!(parse_size("1.5").is_err());
        assert!(parse_size("1e30TB").is_err());
    }

    #[test]
    fn report_for_14b_names_split_tensors() {
        let c = Config::preset("14b").unwrap();
        let plan = qmk_model::model_plan(&c).unwrap();
        let text = render("14b", &c, &plan, &qmk_model::weight_bytes(&c).unwrap()).unwrap();
        assert!(text.contains("(48,13824,5120):(70778880,5120,1)"), "{text}");
        assert!(text.contains("chunk 1: layers [24, 48)"), "{text}");
        assert!(text.contains("15 tensors, 3 split"), "{text}");
    }

    #[test]
    fn tensor_parallel_report_lists_every_rank() {
        let c = Config::preset("72b").unwrap();
        let tp = tp_json(&c, 8).unwrap().unwrap();
        let text = render_tp(&tp).unwrap();
        assert!(text.contains("tensor parallel over 8 ranks"), "{text}");
        // The down shard [80, 8192, 3696] still needs 2 chunks.
        let down = text.lines().find(|l| l.starts_with("down_proj")).unwrap();
        assert!(
            down.contains("axis 2, units of 8") && down.contains("[25872, 29568)"),
            "{down}"
        );
        assert!(down.contains("4.84 GB"), "{down}");
        assert!(text.contains("rank 7: "), "{text}");
        let json = serde_json::to_value(&tp).unwrap();
        assert_eq!(json["ranks"], 8);
        assert_eq!(json["rank_bytes"].as_array().unwrap().len(), 8);
        assert!(tp_json(&c, 1).unwrap().is_none());
        // 72B's 8 KV heads do not split 3 ways.
        let e = tp_json(&c, 3).err().unwrap().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }

    #[test]
    fn byte_units() {
        assert_eq!(bytes(Bytes(6_794_772_480)), "6.79 GB (6794772480 bytes)");
        assert_eq!(bytes(Bytes(491_520)), "491.52 kB (491520 bytes)");
        assert_eq!(bytes(Bytes(999)), "999 bytes");
        assert_eq!(
            bytes(Bytes(u64::MAX)),
            "18446744073.71 GB (18446744073709551615 bytes)"
        );
    }
}
