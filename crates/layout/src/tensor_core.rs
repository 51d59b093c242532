//! Where a tensor-core weight phase's work goes, and the tile order its
//! weights are stored in.
//!
//! A tensor-core phase computes `y[t][r] = W[r, :] . x[t]` for up to
//! [`TcMachine::tmax`] tokens with `mma.sync` m16n8k16: 16 weight rows as A,
//! the tokens as the 8 columns of B. Its weights are stored in **tile
//! order** so that each 16-byte load instruction of a warp reads 512
//! contiguous bytes ([`tile_order_offset`]). Its split of the work
//! ([`TcPlan`]) depends on the shape and the machine only, never on the
//! token count or on the grid that runs, so every token's sums are
//! bit-identical at every token count; the kernel's `tc::Plan` computes
//! the same numbers and `static_assert`s them against the ones rendered
//! from here.

use crate::error::LayoutError;

/// Rows of a tile (the A operand's 16 rows).
pub const TILE_ROWS: u64 = 16;
/// Columns of a k-step (two m16n8k16 MMAs).
pub const TILE_K: u64 = 32;
/// Most column blocks a phase may have (block-sum slots per row tile).
pub const TC_MAX_BLOCKS: u64 = 12;
/// Most partial-sum slots of one tile.
pub const TC_MAX_SLOTS: u64 = 64;
/// Bytes of one tile's partial sums, `[16][8]` f32.
pub const TC_TILE_SUM_BYTES: u64 = 512;

/// The machine a phase is planned for: nominal CTAs and warps (a grid of
/// another size runs the nominal CTAs in turn), the most tokens, and the
/// shared memory of the input planes and of the local partial sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcMachine {
    /// Nominal CTAs.
    pub grid: u64,
    /// Warps per CTA.
    pub warps: u64,
    /// Most tokens of one step.
    pub tmax: u64,
    /// Shared memory of the input planes (`[2][tmax][P]` bf16), bytes.
    pub input_bytes: u64,
    /// Shared memory of the local partial sums after them, bytes.
    pub part_bytes: u64,
    /// Whether a spanning tile's last arrival copies every slot through
    /// shared memory in one round trip (two staging areas after the local
    /// partials).
    pub staged: bool,
}

/// The Hopper machine (H100, H200: 132 SMs, 227 KB of shared memory a
/// CTA): 132 CTAs of 16 warps, 8 tokens, 164 KB of input planes and 32 KB
/// of local partials, so the multi-token step's static shared memory fits
/// beside them.
pub const TC_MACHINE_SM90: TcMachine = TcMachine {
    grid: 132,
    warps: 16,
    tmax: 8,
    input_bytes: 164 * 1024,
    part_bytes: 32 * 1024,
    staged: true,
};

impl TcMachine {
    /// Shared memory a phase takes, bytes: the input planes, then the
    /// local partials.
    pub fn smem_bytes(&self) -> u64 {
        self.input_bytes + self.part_bytes
    }
}

/// One phase's plan: the weights `[rows, k]`, cut into column blocks of
/// whole k-steps, row tiles of 16 rows, and equal contiguous shares of the
/// phase's k-steps, one per warp of the nominal grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcPlan {
    /// Columns of the weights (the inputs' length).
    pub k: u64,
    /// Rows of the weights (the outputs).
    pub rows: u64,
    /// The machine it is planned for.
    pub machine: TcMachine,
    /// Column blocks: the fewest (dividing the grid and the k-steps) whose
    /// `tmax` tokens' planes fit the input area.
    pub nkb: u64,
    /// k-steps of a block.
    pub ks: u64,
    /// Columns of a block.
    pub kb: u64,
    /// A token's pitch in shared memory, elements (padded off a multiple of
    /// 64 to spread the banks).
    pub pitch: u64,
    /// Row tiles.
    pub rtiles: u64,
    /// Tiles: row tiles times column blocks.
    pub tiles: u64,
    /// The phase's k-steps: tiles times block k-steps.
    pub w: u64,
    /// Fewer k-steps than warps: a share is one k-step or none.
    pub sparse: bool,
    /// Contributors (partial-sum slots) per tile, at most.
    pub slots: u64,
    /// Tiles one CTA's share touches, at most.
    pub maxlt: u64,
}

impl TcPlan {
    /// The plan of a phase over weights `[rows, k]` on `machine`; `tensor`
    /// names it in errors.
    pub fn new(
        tensor: &str,
        rows: u64,
        k: u64,
        machine: &TcMachine,
    ) -> Result<TcPlan, LayoutError> {
        let bad = |reason: String| LayoutError::TensorCore {
            tensor: tensor.to_string(),
            reason,
        };
        let of =
            |what: &str| LayoutError::overflow(format!("tensor-core plan of `{tensor}`: {what}"));
        if rows == 0 || k == 0 || rows % TILE_ROWS != 0 || k % TILE_K != 0 {
            return Err(bad(format!(
                "[{rows}, {k}] is not whole {TILE_ROWS}-row tiles and {TILE_K}-column k-steps"
            )));
        }
        let m = *machine;
        if m.grid == 0 || m.warps == 0 || m.tmax == 0 || m.tmax > 8 {
            return Err(bad(format!(
                "machine {m:?}: needs CTAs, warps and 1 ..= 8 tokens"
            )));
        }
        let nwt = m
            .grid
            .checked_mul(m.warps)
            .ok_or_else(|| of("grid x warps"))?;
        let steps = k / TILE_K;
        // The fewest blocks whose tmax tokens' planes (plus a pad) fit.
        let mut nkb = 0;
        for d in 1..=steps.min(TC_MAX_BLOCKS) {
            let need = (k / d + 32)
                .checked_mul(m.tmax)
                .and_then(|v| v.checked_mul(4))
                .ok_or_else(|| of("input planes"))?;
            if m.grid % d == 0 && steps % d == 0 && need <= m.input_bytes {
                nkb = d;
                break;
            }
        }
        if nkb == 0 {
            return Err(bad(format!(
                "no column block count up to {TC_MAX_BLOCKS} divides the {} CTAs and the {steps} k-steps \
                 with {} tokens' planes in {} bytes",
                m.grid, m.tmax, m.input_bytes
            )));
        }
        let ks = steps / nkb;
        let kb = k / nkb;
        let pitch = if kb % 64 == 0 { kb + 32 } else { kb };
        let rtiles = rows / TILE_ROWS;
        let tiles = rtiles.checked_mul(nkb).ok_or_else(|| of("tiles"))?;
        let w = tiles.checked_mul(ks).ok_or_else(|| of("k-steps"))?;
        // The kernel's share arithmetic, (w + 1) x nwt, is 32-bit.
        if (w + 1).checked_mul(nwt).is_none_or(|v| v >= 1 << 31) {
            return Err(bad(format!(
                "{w} k-steps over {nwt} warps overflow 32-bit share arithmetic"
            )));
        }
        let sparse = w < nwt;
        let slots = if sparse { ks } else { (ks - 1) / (w / nwt) + 2 };
        if slots > TC_MAX_SLOTS {
            return Err(bad(format!(
                "{slots} partial-sum slots a tile, at most {TC_MAX_SLOTS}"
            )));
        }
        let csh = (m.warps * w).div_ceil(nwt);
        let maxlt = csh.div_ceil(ks) + 1;
        let local = (maxlt + if m.staged { 2 } else { 0 }) * slots * TC_TILE_SUM_BYTES;
        if local > m.part_bytes {
            return Err(bad(format!(
                "a CTA's local partials take {local} bytes, the machine has {}",
                m.part_bytes
            )));
        }
        if 2 * m.tmax * pitch * 2 > m.input_bytes {
            return Err(bad(format!(
                "{} tokens' planes of {pitch} elements do not fit",
                m.tmax
            )));
        }
        Ok(TcPlan {
            k,
            rows,
            machine: m,
            nkb,
            ks,
            kb,
            pitch,
            rtiles,
            tiles,
            w,
            sparse,
            slots,
            maxlt,
        })
    }

    /// Offset of the block sums' counters `[rtiles]` u32 in the scratch,
    /// bytes (the tiles' counters `[tiles]` u32 start at 0).
    pub fn bcnt_offset(&self) -> u64 {
        self.tiles * 4
    }

    /// Offset of the tiles' partial sums `[tiles][slots][16][8]` f32 in the
    /// scratch, bytes (after the counters, 128-byte aligned).
    pub fn part_offset(&self) -> u64 {
        ((self.tiles + self.rtiles) * 4).div_ceil(128) * 128
    }

    /// Offset of the block sums `[rtiles][nkb][16][8]` f32 in the scratch,
    /// bytes.
    pub fn bpart_offset(&self) -> u64 {
        self.part_offset() + self.tiles * self.slots * TC_TILE_SUM_BYTES
    }

    /// Bytes of the phase's global scratch: counters, partial sums, block
    /// sums.
    pub fn scratch_bytes(&self) -> u64 {
        self.bpart_offset() + self.rtiles * self.nkb * TC_TILE_SUM_BYTES
    }
}

/// Element offset of `(n, k)` in one layer's `[N, kdim]` weights in tile
/// order: 16-row band, then 32-column k-step, then the 16 x 32 block row by
/// row. A band occupies the same bytes as in row-major order, and any 8
/// elements of a row starting at a multiple of 8 stay contiguous.
pub fn tile_order_offset(n: u64, k: u64, kdim: u64) -> u64 {
    (n / TILE_ROWS) * TILE_ROWS * kdim
        + (k / TILE_K) * TILE_ROWS * TILE_K
        + (n % TILE_ROWS) * TILE_K
        + k % TILE_K
}

/// Checks that `bytes` holds whole bands of `[16, k]` bf16; returns the
/// band's bytes.
fn band_bytes(bytes: usize, k: usize) -> Result<usize, LayoutError> {
    let bad = |reason: String| LayoutError::TensorCore {
        tensor: "tile-order bands".to_string(),
        reason,
    };
    if k == 0 || k as u64 % TILE_K != 0 {
        return Err(bad(format!("row length {k} is not a multiple of {TILE_K}")));
    }
    let band = k
        .checked_mul(TILE_ROWS as usize * 2)
        .ok_or_else(|| LayoutError::overflow(format!("a band of {k} columns")))?;
    if bytes % band != 0 {
        return Err(bad(format!(
            "{bytes} bytes are not whole bands of {band} bytes"
        )));
    }
    Ok(band)
}

/// Permutes whole 16-row bands of row-major bf16 rows of length `k` into
/// tile order ([`tile_order_offset`]), in place.
pub fn to_tile_order(bands: &mut [u8], k: usize) -> Result<(), LayoutError> {
    permute(bands, k, true)
}

/// The inverse of [`to_tile_order`].
pub fn from_tile_order(bands: &mut [u8], k: usize) -> Result<(), LayoutError> {
    permute(bands, k, false)
}

fn permute(bands: &mut [u8], k: usize, to_tiles: bool) -> Result<(), LayoutError> {
    let band = band_bytes(bands.len(), k)?;
    let mut tmp = vec![0u8; band];
    // 8 elements (16 bytes) of a row at a multiple of 8 move together.
    let pieces_per_row = k / 8;
    for b in bands.chunks_exact_mut(band) {
        tmp.copy_from_slice(b);
        for r in 0..TILE_ROWS as usize {
            for p in 0..pieces_per_row {
                let row_major = (r * k + p * 8) * 2;
                let tiled = tile_order_offset(r as u64, (p * 8) as u64, k as u64) as usize * 2;
                let (dst, src) = if to_tiles {
                    (tiled, row_major)
                } else {
                    (row_major, tiled)
                };
                b[dst..dst + 16].copy_from_slice(&tmp[src..src + 16]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rows: u64, k: u64) -> TcPlan {
        TcPlan::new("down_proj", rows, k, &TC_MACHINE_SM90).unwrap()
    }

    #[test]
    fn down_plans_of_every_size_match_the_kernel_arithmetic() {
        // (rows, k) -> (blocks, block k-steps, slots, local tiles), as the
        // kernel's constexpr plan computes them on the same machine.
        let cases = [
            ((3584, 18944), (4, 148, 4, 8)),  // 7B
            ((5120, 13824), (3, 144, 4, 9)),  // 14B
            ((5120, 27648), (6, 144, 3, 16)), // 32B
            ((8192, 29568), (6, 154, 2, 25)), // 72B
        ];
        for ((rows, k), (nkb, ks, slots, maxlt)) in cases {
            let p = plan(rows, k);
            assert_eq!(
                (p.nkb, p.ks, p.slots, p.maxlt),
                (nkb, ks, slots, maxlt),
                "[{rows}, {k}]"
            );
            assert_eq!(p.kb, k / nkb);
            assert_eq!(p.tiles, rows / 16 * nkb);
            assert!(!p.sparse);
        }
    }

    #[test]
    fn scratch_holds_counters_then_slots_then_block_sums() {
        let p = plan(3584, 18944);
        assert_eq!(p.bcnt_offset(), 896 * 4);
        assert_eq!(p.part_offset(), (896 + 224) * 4);
        assert_eq!(p.part_offset() % 128, 0);
        assert_eq!(p.bpart_offset(), p.part_offset() + 896 * 4 * 512);
        assert_eq!(p.scratch_bytes(), p.bpart_offset() + 224 * 4 * 512);
    }

    #[test]
    fn shapes_the_plan_cannot_take_are_named() {
        let e = TcPlan::new("down_proj", 100, 4864, &TC_MACHINE_SM90).unwrap_err();
        assert!(e.to_string().contains("down_proj"), "{e}");
        // 72B on 8 ranks: 3696 columns are not whole k-steps.
        assert!(TcPlan::new("down_proj", 8192, 3696, &TC_MACHINE_SM90).is_err());
        // Local partials that do not fit the machine.
        let small = TcMachine {
            part_bytes: 1024,
            ..TC_MACHINE_SM90
        };
        let e = TcPlan::new("o_proj", 3584, 3584, &small).unwrap_err();
        assert!(e.to_string().contains("local partials"), "{e}");
    }

    #[test]
    fn tile_order_moves_every_element_to_its_offset_and_back() {
        let (rows, k) = (32usize, 96usize);
        let orig: Vec<u8> = (0..rows * k)
            .flat_map(|i| (i as u16).to_le_bytes())
            .collect();
        let mut t = orig.clone();
        to_tile_order(&mut t, k).unwrap();
        for n in 0..rows {
            for c in 0..k {
                let at = tile_order_offset(n as u64, c as u64, k as u64) as usize * 2;
                let v = u16::from_le_bytes([t[at], t[at + 1]]) as usize;
                assert_eq!(v, n * k + c, "element ({n}, {c})");
            }
        }
        assert_ne!(t, orig);
        // A band stays in its own bytes.
        let band = 16 * k * 2;
        let mut sorted_a = orig[..band].to_vec();
        let mut sorted_b = t[..band].to_vec();
        sorted_a.sort_unstable();
        sorted_b.sort_unstable();
        assert_eq!(sorted_a, sorted_b);
        from_tile_order(&mut t, k).unwrap();
        assert_eq!(t, orig);
    }

    #[test]
    fn partial_bands_and_odd_rows_are_refused() {
        let mut b = vec![0u8; 16 * 64 * 2 + 2];
        assert!(to_tile_order(&mut b, 64).is_err());
        let mut b = vec![0u8; 16 * 40 * 2];
        assert!(to_tile_order(&mut b, 40).is_err());
    }

    #[test]
    fn the_first_rows_of_a_kstep_lie_where_the_lanes_load_them() {
        // Lane (g, q) loads 8 elements of rows g and g + 8 at k-step j,
        // column 8 q: offsets j 512 + 8 lane and that + 256.
        let k = 18944;
        for j in [0u64, 1, 147] {
            for lane in 0..32u64 {
                let (g, q) = (lane / 4, lane % 4);
                assert_eq!(tile_order_offset(g, 32 * j + 8 * q, k), j * 512 + 8 * lane);
                assert_eq!(
                    tile_order_offset(g + 8, 32 * j + 8 * q, k),
                    j * 512 + 256 + 8 * lane
                );
            }
        }
        assert_eq!(tile_order_offset(16, 0, k), 16 * k);
    }
}
