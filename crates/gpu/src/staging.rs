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
use qmk_layout::{Layout, TileOrder};
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
    /// `Some(order)`: the device holds this chunk in that tile order, the
    /// one a tensor-core phase loads; `None`: in the source's row-major
    /// order. Sources always give row-major bytes; the upload permutes
    /// each piece ([`PlannedChunk::to_device_order`]), so its pieces are
    /// whole bands ([`PlannedChunk::band_bytes`]).
    pub tile: Option<TileOrder>,
}

impl PlannedChunk {
    /// Writes `addr` into this chunk's slot of `params`.
    pub fn set(&self, params: &mut KernelParams, addr: u64) {
        if let Some(slots) = params.chunks_mut(&self.tensor) {
            slots[self.chunk] = addr;
        }
    }

    fn error(&self, reason: String) -> Error {
        Error::Weights {
            tensor: self.tensor.clone(),
            reason,
        }
    }

    /// Bytes of one band of a tile-order chunk (`None` for a row-major
    /// one), checked: the order is one [`TileOrder::new`] accepts (the
    /// field is public, so it may not be) and the chunk starts and ends on
    /// bands, so no piece of it splits one.
    pub fn band_bytes(&self) -> Result<Option<u64>> {
        let Some(order) = self.tile else {
            return Ok(None);
        };
        let band = TileOrder::new(order.k, order.rows)
            .map_err(|e| self.error(e.to_string()))?
            .band_bytes()
            .map_err(|e| self.error(e.to_string()))?;
        if self.offset % band != 0 || self.bytes % band != 0 {
            return Err(self.error(format!(
                "chunk {} (bytes {}..+{}) is not whole tile-order bands of {band} bytes",
                self.chunk, self.offset, self.bytes
            )));
        }
        Ok(Some(band))
    }

    /// The most bytes of this chunk one piece of an upload through staging
    /// buffers of `buffer` bytes takes: the buffer's size rounded down to
    /// even, and for a tile-order chunk to whole bands (the permutation
    /// works band by band). A buffer smaller than one band is refused,
    /// naming the tensor and the band's size.
    pub fn piece_bytes(&self, buffer: usize) -> Result<usize> {
        let even = buffer & !1;
        let piece = match self.band_bytes()? {
            None => even,
            Some(band) => {
                let band = usize::try_from(band)
                    .map_err(|_| Error::Overflow(format!("{}: a tile-order band", self.tensor)))?;
                if even < band {
                    let rows = self.tile.map_or(0, |o| o.rows);
                    return Err(self.error(format!(
                        "a staging buffer of {buffer} bytes cannot hold one tile-order band of \
                         {band} bytes ({rows} rows); use buffers of at least {band} bytes"
                    )));
                }
                even - even % band
            }
        };
        if piece == 0 {
            return Err(self.error(format!(
                "a staging buffer of {buffer} bytes holds no whole bf16 element"
            )));
        }
        Ok(piece)
    }

    /// Puts `piece`, row-major bytes of this chunk from the source
    /// starting on a band, into the order the device holds the chunk in
    /// (unchanged for a row-major chunk).
    pub fn to_device_order(&self, piece: &mut [u8]) -> Result<()> {
        self.permute(piece, true)
    }

    /// The inverse of [`PlannedChunk::to_device_order`]: bytes read back
    /// from the device (whole bands) into the source's row-major order.
    pub fn from_device_order(&self, piece: &mut [u8]) -> Result<()> {
        self.permute(piece, false)
    }

    fn permute(&self, piece: &mut [u8], to_tiles: bool) -> Result<()> {
        // band_bytes first: it validates an order set by hand.
        let (Some(_), Some(order)) = (self.band_bytes()?, self.tile) else {
            return Ok(());
        };
        let done = if to_tiles {
            order.to_tiles(piece)
        } else {
            order.from_tiles(piece)
        };
        done.map_err(|e| self.error(e.to_string()))
    }
}

/// Marks every chunk of the tensor `tensor` as held in tile order `order`
/// ([`PlannedChunk::tile`]), after checking that the kernel's plan stores
/// the tensor as row-major `[L, rows, order.k]` (the permutation assumes
/// it) and that every chunk is whole bands.
pub fn tile_chunks(
    build: &KernelBuild,
    chunks: &mut [PlannedChunk],
    tensor: &str,
    rows: u64,
    order: TileOrder,
) -> Result<()> {
    let bad = |reason: String| Error::Weights {
        tensor: tensor.to_string(),
        reason,
    };
    let t = build
        .plan
        .tensors
        .iter()
        .find(|t| t.spec.name == tensor)
        .ok_or_else(|| bad("not in the kernel's plan".into()))?;
    let layout = &t.spec.layout;
    let shape = layout.shape();
    if shape.len() != 3 || shape[1..] != [rows, order.k] || *layout != Layout::row_major(shape)? {
        return Err(bad(format!(
            "the tensor-core phase needs a row-major [L, {rows}, {}] tensor, the plan has {layout}",
            order.k
        )));
    }
    // The order is per layer: a band straddling two layers would be
    // permuted as one.
    if rows == 0 || rows % order.rows != 0 {
        return Err(bad(format!(
            "{rows} rows are not whole bands of {} rows",
            order.rows
        )));
    }
    let mut found = false;
    for c in chunks.iter_mut().filter(|c| c.tensor == tensor) {
        c.tile = Some(order);
        c.band_bytes()?;
        found = true;
    }
    if !found {
        return Err(bad("the kernel addresses no chunk of it".into()));
    }
    Ok(())
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
                tile: None,
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
/// ([`PlannedChunk::piece_bytes`] of a buffer of `piece.max(2)` bytes),
/// each in the chunk's device order, handing each to `write(offset,
/// bytes)`: the host-only form of the upload, for tests and tools.
pub fn read_chunk(
    source: &dyn WeightSource,
    chunk: &PlannedChunk,
    piece: usize,
    write: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let piece = chunk.piece_bytes(piece.max(2))? as u64;
    // u16 storage keeps the buffer bf16-aligned.
    let mut buf = vec![0u16; (piece / 2) as usize];
    let mut at = 0u64;
    while at < chunk.bytes {
        let n = piece.min(chunk.bytes - at) as usize;
        let bytes: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut buf)[..n];
        source.read(chunk, at, bytes)?;
        chunk.to_device_order(bytes)?;
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

    /// The tensor-core MLP's tiling of `config`: each tensor with its rows
    /// and tile order.
    fn mlp_tiles(config: &Config) -> [(WeightKind, u64, TileOrder); 3] {
        let (h, i) = (config.hidden_size as u64, config.intermediate_size as u64);
        [
            (WeightKind::DownProj, h, TileOrder::new(i, 16).unwrap()),
            (WeightKind::GateProj, i, TileOrder::new(h, 8).unwrap()),
            (WeightKind::UpProj, i, TileOrder::new(h, 8).unwrap()),
        ]
    }

    /// Only the named tensors' chunks are marked, each with its order, and
    /// `read_chunk` then gives them in tile order: element (n, k) of layer
    /// l at `TileOrder::offset` inside the layer, for 16-row and 8-row
    /// bands alike.
    #[test]
    fn tile_chunks_marks_the_mlp_and_read_chunk_gives_tile_order() {
        let config = tiny(false);
        let build = KernelBuild::new(&config).unwrap();
        let mut chunks = planned_chunks(&build).unwrap();
        let tiles = mlp_tiles(&config);
        for (kind, rows, order) in tiles {
            tile_chunks(&build, &mut chunks, kind.name(), rows, order).unwrap();
        }
        for c in &chunks {
            let want = tiles.iter().find(|t| t.0.name() == c.tensor).map(|t| t.2);
            assert_eq!(c.tile, want, "{} chunk {}", c.tensor, c.chunk);
        }
        let w = qmk_model::synthetic_weights(&config, 7);
        let mut seen = 0;
        for (kind, rows, order) in tiles {
            let (rows, kdim) = (rows as usize, order.k as usize);
            let layer = rows * kdim;
            let band = order.rows as usize * kdim * 2;
            let src = w.get(kind).unwrap();
            for c in chunks.iter().filter(|c| c.tensor == kind.name()) {
                let mut got = Vec::new();
                // Pieces of one band and a half: rounded down to one band.
                read_chunk(&w, c, band + band / 2, &mut |off, piece| {
                    assert_eq!((off % band as u64, piece.len()), (0, band));
                    got.extend_from_slice(piece);
                    Ok(())
                })
                .unwrap();
                let got: &[u16] = bytemuck::cast_slice(&got);
                let first = (c.offset / 2) as usize;
                for l in 0..c.bytes as usize / (layer * 2) {
                    for n in 0..rows {
                        for k in 0..kdim {
                            let at = l * layer + order.offset(n as u64, k as u64) as usize;
                            let want = src[first + l * layer + n * kdim + k].to_bits();
                            assert_eq!(got[at], want, "{} layer {l} ({n}, {k})", c.tensor);
                        }
                    }
                }
                // Less than a band per piece cannot be read in tile order.
                let e = read_chunk(&w, c, band - 2, &mut |_, _| Ok(())).unwrap_err();
                let msg = format!("{band} bytes ({} rows)", order.rows);
                assert!(e.to_string().contains(&msg), "{e}");
                seen += 1;
            }
        }
        assert!(seen >= 3, "{seen} tiled chunks");
    }

    #[test]
    fn tile_chunks_refuses_a_plan_of_another_shape_naming_the_tensor() {
        let config = tiny(false);
        let build = KernelBuild::new(&config).unwrap();
        let mut chunks = planned_chunks(&build).unwrap();
        let (h, i) = (config.hidden_size as u64, config.intermediate_size as u64);
        let down = |k| TileOrder::new(k, 16).unwrap();
        for (rows, order) in [(h, down(2 * i)), (2 * h, down(i))] {
            let e = tile_chunks(&build, &mut chunks, "down_proj", rows, order).unwrap_err();
            assert!(e.to_string().starts_with("weight tensor down_proj:"), "{e}");
            assert!(e.to_string().contains("row-major"), "{e}");
        }
        let e = tile_chunks(&build, &mut chunks, "nope", h, down(i)).unwrap_err();
        assert!(e.to_string().starts_with("weight tensor nope:"), "{e}");
        // gate_proj is [L, I, H]: the transpose of the down phase's shape.
        let e = tile_chunks(&build, &mut chunks, "gate_proj", h, down(i)).unwrap_err();
        assert!(e.to_string().starts_with("weight tensor gate_proj:"), "{e}");
        assert!(chunks.iter().all(|c| c.tile.is_none()));
    }

    /// An order set by hand that `TileOrder::new` refuses is refused by
    /// every use of the chunk, naming the tensor.
    #[test]
    fn a_chunk_of_an_invalid_order_is_refused() {
        let config = tiny(false);
        let build = KernelBuild::new(&config).unwrap();
        let mut chunks = planned_chunks(&build).unwrap();
        let c = chunks.iter_mut().find(|c| c.tensor == "up_proj").unwrap();
        c.tile = Some(TileOrder { k: 256, rows: 4 });
        let e = c.band_bytes().unwrap_err();
        assert!(e.to_string().starts_with("weight tensor up_proj:"), "{e}");
        assert!(c.piece_bytes(1 << 20).is_err());
        assert!(c.to_device_order(&mut [0u8; 2048]).is_err());
    }
}
