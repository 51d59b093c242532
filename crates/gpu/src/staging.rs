//! Weight staging: which device allocations the weights go to (one per
//! planned chunk of every stacked tensor the kernel addresses, in plan
//! order) and where their bytes come from ([`WeightSource`]).
//!
//! The upload ([`crate::upload`]) allocates each [`PlannedChunk`], asks the
//! source for the chunk's bytes one piece at a time straight into a pinned
//! buffer, and copies each piece to the device while the next is read. Three
//! sources exist: [`Weights`] in host memory, [`SyntheticSource`] (generated
//! on demand) and [`CheckpointSource`] (read from the safetensors files with
//! `pread`); another weight layout plugs in through the same trait.

use half::bf16;
use qmk_kernels::{KernelBuild, KernelParams};
use qmk_model::{CheckpointSource, Config, SyntheticSource, WeightKind, Weights};

use crate::error::{Error, Result};

/// Bytes per synchronous host-to-device copy of a host table (the rope
/// tables).
pub const UPLOAD_PIECE_BYTES: usize = 128 << 20;

/// One planned chunk of one weight tensor: one device allocation, and the
/// [`KernelParams`] slot its address goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedChunk {
    /// Plan name of the tensor (`gate_proj`, ...).
    pub tensor: String,
    /// Chunk index inside the tensor.
    pub chunk: usize,
    /// Byte offset of the chunk inside the whole tensor.
    pub offset: u64,
    /// Bytes of the chunk.
    pub bytes: u64,
    /// Bytes of the whole tensor, as its layout spans them.
    pub tensor_bytes: u64,
}

impl PlannedChunk {
    /// Writes `addr` into this chunk's slot of `params`.
    pub fn set(&self, params: &mut KernelParams, addr: u64) {
        if let Some(slots) = params.chunks_mut(&self.tensor) {
            slots[self.chunk] = addr;
        }
    }
}

/// The staging order: every chunk of every tensor the kernel addresses, in
/// plan order. After uploading them, call [`tie_embeddings`].
pub fn planned_chunks(build: &KernelBuild) -> Result<Vec<PlannedChunk>> {
    let mut probe: KernelParams = bytemuck::Zeroable::zeroed();
    let mut out = Vec::new();
    for t in &build.plan.tensors {
        let name = t.spec.name.as_str();
        if probe.chunks_mut(name).is_none() {
            continue; // a tensor the kernel does not address
        }
        let tensor_bytes = t.spec.byte_span()?.0;
        for (c, chunk) in t.chunks.iter().enumerate() {
            let offset = t.chunk_byte_offset(c)?.0;
            let bytes = chunk.byte_span.0;
            offset
                .checked_add(bytes)
                .filter(|&e| e <= tensor_bytes)
                .ok_or_else(|| Error::Weights {
                    tensor: name.to_string(),
                    reason: format!("chunk {c} runs past the tensor"),
                })?;
            out.push(PlannedChunk {
                tensor: name.to_string(),
                chunk: c,
                offset,
                bytes,
                tensor_bytes,
            });
        }
    }
    Ok(out)
}

/// A tied model's LM head is its embedding table.
pub fn tie_embeddings(config: &Config, params: &mut KernelParams) {
    if config.tie_word_embeddings {
        params.lm_head = params.embed_tokens;
    }
}

/// Where the weights' bytes come from.
pub trait WeightSource: Sync {
    /// The model the weights are for (the kernel is built for it).
    fn config(&self) -> &Config;

    /// Fills `dst` with bytes `offset..offset + dst.len()` of `chunk` (0 is
    /// the chunk's first byte). The caller keeps the range inside the chunk
    /// and both ends even (whole bf16 elements); `dst` is 2-byte aligned.
    /// Errors name the tensor.
    fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()>;
}

/// The stacked tensor of `chunk` and `dst` as bf16 elements starting at
/// element `first` of that tensor (checked: inside the chunk, whole
/// elements).
fn elements<'a>(
    chunk: &PlannedChunk,
    offset: u64,
    dst: &'a mut [u8],
) -> Result<(WeightKind, u64, &'a mut [bf16])> {
    let bad = |reason: String| Error::Weights {
        tensor: chunk.tensor.clone(),
        reason,
    };
    let kind = WeightKind::ALL
        .iter()
        .copied()
        .find(|k| k.name() == chunk.tensor)
        .ok_or_else(|| bad("the plan names a tensor the model does not have".into()))?;
    let inside = offset
        .checked_add(dst.len() as u64)
        .is_some_and(|e| e <= chunk.bytes);
    if !inside || offset % 2 != 0 || dst.len() % 2 != 0 {
        return Err(bad(format!(
            "bytes {offset}..+{} are not whole elements inside chunk {} ({} bytes)",
            dst.len(),
            chunk.chunk,
            chunk.bytes
        )));
    }
    let elems: &mut [bf16] = bytemuck::try_cast_slice_mut(dst)
        .map_err(|e| bad(format!("a staging buffer is not bf16-aligned: {e}")))?;
    // offset + chunk.offset <= tensor_bytes (checked by planned_chunks).
    Ok((kind, (chunk.offset + offset) / 2, elems))
}

/// Weights in host memory: each piece is a slice of its stacked tensor.
impl WeightSource for Weights {
    fn config(&self) -> &Config {
        &self.config
    }

    fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
        let bad = |reason: String| Error::Weights {
            tensor: chunk.tensor.clone(),
            reason,
        };
        let (kind, first, dst) = elements(chunk, offset, dst)?;
        let host = self
            .get(kind)
            .ok_or_else(|| bad("missing from the weights".into()))?;
        if host.len() as u64 * 2 != chunk.tensor_bytes {
            return Err(bad(format!(
                "{} elements, the layout needs {}",
                host.len(),
                chunk.tensor_bytes / 2
            )));
        }
        let first = first as usize; // inside `host`, checked above
        dst.copy_from_slice(&host[first..first + dst.len()]);
        Ok(())
    }
}

/// Synthetic weights, generated piece by piece into the staging buffer.
impl WeightSource for SyntheticSource {
    fn config(&self) -> &Config {
        SyntheticSource::config(self)
    }

    fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
        let (kind, first, dst) = elements(chunk, offset, dst)?;
        Ok(self.fill(kind, first, dst)?)
    }
}

/// A checkpoint directory, read piece by piece from its files (`pread`,
/// converted to bf16) into the staging buffer.
impl WeightSource for CheckpointSource {
    fn config(&self) -> &Config {
        CheckpointSource::config(self)
    }

    fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
        let (kind, first, dst) = elements(chunk, offset, dst)?;
        Ok(self.read_stacked(kind, first, dst)?)
    }
}

/// Reads all of `chunk` from `source` in pieces of at most `piece` bytes
/// (even), handing each to `write(offset, bytes)`: the host-only form of the
/// upload, for tests and tools.
pub fn read_chunk(
    source: &dyn WeightSource,
    chunk: &PlannedChunk,
    piece: usize,
    write: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let piece = (piece.max(2) & !1) as u64;
    // u16 storage keeps the buffer bf16-aligned.
    let mut buf = vec![0u16; (piece / 2) as usize];
    let mut at = 0u64;
    while at < chunk.bytes {
        let n = piece.min(chunk.bytes - at) as usize;
        let bytes: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut buf)[..n];
        source.read(chunk, at, bytes)?;
        write(at, bytes)?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tiny(tied: bool) -> Config {
        let mut c = Config::preset(if tied { "0.5b" } else { "7b" }).unwrap();
        c.hidden_size = 128;
        c.intermediate_size = 256;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(64);
        c.vocab_size = 512;
        c
    }

    #[test]
    fn planned_chunks_cover_every_kernel_tensor_once() {
        for tied in [true, false] {
            let config = tiny(tied);
            let build = KernelBuild::new(&config).unwrap();
            let w = qmk_model::synthetic_weights(&config, 7);
            let chunks = planned_chunks(&build).unwrap();
            let mut total = 0u64;
            let mut p = crate::plan::base_params(&config, 16, std::time::Duration::from_secs(1));
            for (i, c) in chunks.iter().enumerate() {
                let mut got = Vec::new();
                read_chunk(&w, c, 1000, &mut |off, piece| {
                    assert_eq!(off, got.len() as u64);
                    got.extend_from_slice(piece);
                    Ok(())
                })
                .unwrap();
                assert_eq!(got.len() as u64, c.bytes, "{} chunk {}", c.tensor, c.chunk);
                total += c.bytes;
                c.set(&mut p, 0x1000 * (i as u64 + 1));
                if i == 0 {
                    // The first chunk of embed_tokens is the table's first bytes.
                    let e: &[u8] = bytemuck::cast_slice(&w.embed_tokens);
                    assert_eq!(c.tensor, "embed_tokens");
                    assert_eq!(&got[..], &e[..got.len()]);
                }
            }
            assert_eq!(total, qmk_model::weight_bytes(&config).unwrap().total.0);
            tie_embeddings(&config, &mut p);
            for name in qmk_kernels::params::KERNEL_TENSORS {
                let slot = p.chunks_mut(name).unwrap()[0];
                assert_ne!(slot, 0, "tied={tied}: {name} has no chunk 0");
            }
            assert_eq!(p.lm_head == p.embed_tokens, tied);
        }
    }

    /// The three sources give the same bytes for every chunk: in-memory
    /// synthetic weights, the on-demand generator, and a checkpoint written
    /// from them and read back with `pread`.
    #[test]
    fn every_source_gives_the_same_bytes() {
        for tied in [true, false] {
            let config = tiny(tied);
            let build = KernelBuild::new(&config).unwrap();
            let w = qmk_model::synthetic_weights(&config, 7);
            let synth = SyntheticSource::new(&config, 7).unwrap();
            let dir = tempfile::tempdir().unwrap();
            qmk_model::write_synthetic_checkpoint(dir.path(), &synth, Some(100_000), &mut |_| {})
                .unwrap();
            let file = CheckpointSource::open(dir.path()).unwrap();
            for c in planned_chunks(&build).unwrap() {
                let all = |s: &dyn WeightSource, piece| {
                    let mut v = Vec::new();
                    read_chunk(s, &c, piece, &mut |_, b| {
                        v.extend_from_slice(b);
                        Ok(())
                    })
                    .unwrap();
                    v
                };
                let want = all(&w, 1 << 20);
                assert_eq!(all(&synth, 998), want, "{} synthetic", c.tensor);
                assert_eq!(all(&file, 4094), want, "{} file", c.tensor);
            }
        }
    }

    #[test]
    fn ranges_outside_the_chunk_or_odd_are_refused_naming_the_tensor() {
        let config = tiny(true);
        let build = KernelBuild::new(&config).unwrap();
        let chunks = planned_chunks(&build).unwrap();
        let w = qmk_model::synthetic_weights(&config, 7);
        let c = chunks.iter().find(|c| c.tensor == "q_proj").unwrap();
        let mut buf = vec![0u16; 8];
        let b: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        for (off, len) in [(c.bytes - 2, 4), (1, 4), (0, 3), (u64::MAX - 1, 2)] {
            let e = w.read(c, off, &mut b[..len]).unwrap_err();
            assert!(e.to_string().starts_with("weight tensor q_proj:"), "{e}");
        }
        let mut short = w.clone();
        short.q_proj.pop();
        let e = short.read(c, 0, b).unwrap_err();
        assert!(e.to_string().starts_with("weight tensor q_proj:"), "{e}");
    }
}
