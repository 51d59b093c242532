//! Weight staging: which device allocations the weights go to (one per
//! planned chunk of every stacked tensor the kernel addresses, in plan
//! order) and where their bytes come from ([`WeightSource`]).
//!
//! The backend allocates each [`PlannedChunk`], asks the source to write
//! the chunk's bytes, and copies them to the device as they arrive. Today's
//! source is a [`qmk_model::Weights`] in host memory; a source that streams
//! from mmap'd checkpoint files, or one for another weight layout, plugs in
//! through the same trait.

use qmk_kernels::{KernelBuild, KernelParams};
use qmk_model::{Config, WeightKind, Weights};

use crate::error::{Error, Result};

/// Bytes per host-to-device copy: large enough for full PCIe speed, small
/// enough for a smooth progress bar.
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
pub trait WeightSource {
    /// The model the weights are for (the kernel is built for it).
    fn config(&self) -> &Config;

    /// Writes the bytes of `chunk`, first to last, through `write` (in one
    /// call or in consecutive pieces; the backend copies each piece to the
    /// device as it arrives). Errors name the tensor.
    fn stage(&self, chunk: &PlannedChunk, write: &mut dyn FnMut(&[u8]) -> Result<()>)
        -> Result<()>;
}

/// Stages `chunk` from `source`, calling `write(offset, piece)` with each
/// piece's offset inside the chunk, and checks that the source gives
/// exactly the chunk's bytes (an error names the tensor).
pub fn stage_exact(
    source: &dyn WeightSource,
    chunk: &PlannedChunk,
    write: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut written = 0u64;
    source.stage(chunk, &mut |piece| {
        let end = written
            .checked_add(piece.len() as u64)
            .filter(|&e| e <= chunk.bytes)
            .ok_or_else(|| Error::Weights {
                tensor: chunk.tensor.clone(),
                reason: format!("the source gives more than chunk {}'s bytes", chunk.chunk),
            })?;
        write(written, piece)?;
        written = end;
        Ok(())
    })?;
    if written != chunk.bytes {
        return Err(Error::Weights {
            tensor: chunk.tensor.clone(),
            reason: format!(
                "the source gave {written} of chunk {}'s {} bytes",
                chunk.chunk, chunk.bytes
            ),
        });
    }
    Ok(())
}

/// Weights in host memory: each chunk is a slice of its stacked tensor.
impl WeightSource for Weights {
    fn config(&self) -> &Config {
        &self.config
    }

    fn stage(
        &self,
        chunk: &PlannedChunk,
        write: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let bad = |reason: String| Error::Weights {
            tensor: chunk.tensor.clone(),
            reason,
        };
        let kind = WeightKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == chunk.tensor)
            .ok_or_else(|| bad("the plan names a tensor the model does not have".into()))?;
        let host = self
            .get(kind)
            .ok_or_else(|| bad("missing from the weights".into()))?;
        let bytes: &[u8] = bytemuck::cast_slice(host);
        if bytes.len() as u64 != chunk.tensor_bytes {
            return Err(bad(format!(
                "{} elements, the layout needs {}",
                host.len(),
                chunk.tensor_bytes / 2
            )));
        }
        let end = chunk.offset + chunk.bytes; // checked by planned_chunks
        write(&bytes[chunk.offset as usize..end as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(tied: bool) -> Config {
        let mut c = Config::preset(if tied { "0.5b" } else { "7b" }).unwrap();
        c.hidden_size = 128;
        c.intermediate_size = 256;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(32);
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
                w.stage(c, &mut |piece| {
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

    /// A source that hands out its bytes in pieces of `piece` (as one
    /// streaming from a file would), giving `extra` bytes more or fewer.
    struct Pieces {
        config: Config,
        piece: usize,
        extra: i64,
    }

    impl WeightSource for Pieces {
        fn config(&self) -> &Config {
            &self.config
        }
        fn stage(
            &self,
            chunk: &PlannedChunk,
            write: &mut dyn FnMut(&[u8]) -> Result<()>,
        ) -> Result<()> {
            let n = (chunk.bytes as i64 + self.extra) as usize;
            let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            bytes.chunks(self.piece).try_for_each(write)
        }
    }

    #[test]
    fn streamed_pieces_land_at_their_offsets_and_counts_are_checked() {
        let config = tiny(true);
        let build = KernelBuild::new(&config).unwrap();
        let chunk = planned_chunks(&build).unwrap().remove(0);
        let src = |extra| Pieces {
            config: config.clone(),
            piece: 1000,
            extra,
        };
        let mut dst = vec![0u8; chunk.bytes as usize];
        stage_exact(&src(0), &chunk, &mut |off, piece| {
            dst[off as usize..off as usize + piece.len()].copy_from_slice(piece);
            Ok(())
        })
        .unwrap();
        assert!(dst.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        for extra in [1, -1] {
            let e = stage_exact(&src(extra), &chunk, &mut |_, _| Ok(())).unwrap_err();
            assert!(
                e.to_string().starts_with("weight tensor embed_tokens:"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_tensor_of_the_wrong_length_is_named() {
        let config = tiny(true);
        let build = KernelBuild::new(&config).unwrap();
        let mut w = qmk_model::synthetic_weights(&config, 7);
        w.q_proj.pop();
        let chunks = planned_chunks(&build).unwrap();
        let c = chunks.iter().find(|c| c.tensor == "q_proj").unwrap();
        let e = w.stage(c, &mut |_| Ok(())).unwrap_err();
        assert!(e.to_string().starts_with("weight tensor q_proj:"), "{e}");
    }
}
