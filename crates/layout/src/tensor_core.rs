//! Where a tensor-core weight phase's work goes, and the tile order its
//! weights are stored in.
//!
//! A tensor-core phase computes `y[t][r] = W[r, :] . x[t]` for up to
//! [`TcMachine::tmax`] tokens with `mma.sync` m16n8k16: 16 weight rows as A,
//! the tokens as the 8 columns of B. Its weights are stored in **tile
//! order** so that each 16-byte load instruction of a warp reads 512
//! contiguous bytes ([`TileOrder`]). Its split of the work
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
/// CTA): 132 CTAs of 16 warps, 8 tokens, 161 KB of input planes (8 tokens'
/// planes of a whole 5,120-column row: one column block for 14B's and
/// 32B's gate/up) and 60 KB of local partials (72B's gate/up touches up to
/// 57 tiles a CTA), so the multi-token step's static shared memory fits
/// beside them.
pub const TC_MACHINE_SM90: TcMachine = TcMachine {
    grid: 132,
    warps: 16,
    tmax: 8,
    input_bytes: 161 * 1024,
    part_bytes: 60 * 1024,
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
}

/// The tile order of one tensor-core phase's weights: each layer's
/// `[N, k]` matrix in bands of `rows` rows (16, or 8 where a tile's two
/// halves come from two tensors, as gate and up), then 32-column k-steps,
/// then the `rows` x 32 block row by row. A band occupies the same bytes as
/// in row-major order, and any 8 elements of a row starting at a multiple
/// of 8 stay contiguous, so 16-byte loaders change only their addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileOrder {
    /// Elements of a row.
    pub k: u64,
    /// Rows of a band: 16 or 8.
    pub rows: u64,
}

impl TileOrder {
    /// The order of `k`-element rows in bands of `rows` (16 or 8; `k` whole
    /// k-steps).
    pub fn new(k: u64, rows: u64) -> Result<TileOrder, LayoutError> {
        if k == 0 || k % TILE_K != 0 || !(rows == 16 || rows == 8) {
            return Err(LayoutError::TensorCore {
                tensor: "tile order".to_string(),
                reason: format!(
                    "rows of {k} elements in bands of {rows}: need whole {TILE_K}-column \
                     k-steps and bands of 16 or 8 rows"
                ),
            });
        }
        Ok(TileOrder { k, rows })
    }

    /// Element offset of `(n, k)` in one layer's `[N, self.k]` weights.
    pub fn offset(&self, n: u64, k: u64) -> u64 {
        (n / self.rows) * self.rows * self.k
            + (k / TILE_K) * self.rows * TILE_K
            + (n % self.rows) * TILE_K
            + k % TILE_K
    }

    /// Bytes of one band (bf16).
    pub fn band_bytes(&self) -> Result<u64, LayoutError> {
        self.k.checked_mul(self.rows * 2).ok_or_else(|| {
            LayoutError::overflow(format!(
                "a band of {} rows of {} columns",
                self.rows, self.k
            ))
        })
    }

    /// Permutes whole bands of row-major bf16 rows into this order, in
    /// place.
    pub fn to_tiles(&self, bands: &mut [u8]) -> Result<(), LayoutError> {
        self.permute(bands, true)
    }

    /// The inverse of [`TileOrder::to_tiles`].
    pub fn from_tiles(&self, bands: &mut [u8]) -> Result<(), LayoutError> {
        self.permute(bands, false)
    }

    fn permute(&self, bands: &mut [u8], to_tiles: bool) -> Result<(), LayoutError> {
        let band = usize::try_from(self.band_bytes()?)
            .map_err(|_| LayoutError::overflow(format!("a band of {} columns", self.k)))?;
        if bands.len() % band != 0 {
            return Err(LayoutError::TensorCore {
                tensor: "tile-order bands".to_string(),
                reason: format!("{} bytes are not whole bands of {band} bytes", bands.len()),
            });
        }
        let (k, rows) = (self.k as usize, self.rows as usize);
        let mut tmp = vec![0u8; band];
        for b in bands.chunks_exact_mut(band) {
            tmp.copy_from_slice(b);
            for r in 0..rows {
                // 8 elements (16 bytes) of a row at a multiple of 8 move together.
                for p in 0..k / 8 {
                    let row_major = (r * k + p * 8) * 2;
                    let tiled = self.offset(r as u64, (p * 8) as u64) as usize * 2;
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
}

/// Scratch in global memory shared by the tensor-core phases of a step
/// (they run one after another, and each leaves its counters at zero):
/// tile counters `[tiles]` u32 at 0, block counters `[row tiles]` u32,
/// then the tiles' partial sums `[tiles][slots][16][8]` f32 and the block
/// sums `[row tiles][blocks][16][8]` f32, each area sized for the largest
/// phase so that no phase's partials land on another's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcScratch {
    /// Offset of the block counters, bytes.
    pub bcnt_offset: u64,
    /// Offset of the tiles' partial sums, bytes (128-byte aligned).
    pub part_offset: u64,
    /// Offset of the block sums, bytes.
    pub bpart_offset: u64,
    /// Bytes in all.
    pub bytes: u64,
}

impl TcScratch {
    /// The scratch of `plans`' phases.
    pub fn for_plans(plans: &[&TcPlan]) -> TcScratch {
        let most = |f: fn(&TcPlan) -> u64| plans.iter().map(|p| f(p)).max().unwrap_or(0);
        let tiles = most(|p| p.tiles);
        let rtiles = most(|p| p.rtiles);
        let bcnt_offset = tiles * 4;
        let part_offset = ((tiles + rtiles) * 4).div_ceil(128) * 128;
        let bpart_offset = part_offset + most(|p| p.tiles * p.slots * TC_TILE_SUM_BYTES);
        let bytes = bpart_offset + most(|p| p.rtiles * p.nkb * TC_TILE_SUM_BYTES);
        TcScratch {
            bcnt_offset,
            part_offset,
            bpart_offset,
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rows: u64, k: u64) -> TcPlan {
        TcPlan::new("down_proj", rows, k, &TC_MACHINE_SM90).unwrap()
    }

    #[test]
    fn mlp_plans_of_every_size_match_the_kernel_arithmetic() {
        // (rows, k) -> (blocks, block k-steps, slots, local tiles), as the
        // kernel's constexpr plan computes them on the same machine: down
        // [H, I], gate/up [2 I, H], o_proj [H, Q], q/k/v [Q + 2 KV, H].
        let cases = [
            ((3584, 18944), (4, 148, 4, 8)),  // 7B
            ((5120, 13824), (3, 144, 4, 9)),  // 14B
            ((5120, 27648), (6, 144, 3, 16)), // 32B
            ((8192, 29568), (6, 154, 2, 25)), // 72B
            ((37888, 3584), (1, 112, 2, 19)),
            ((27648, 5120), (1, 160, 3, 15)),
            ((55296, 5120), (1, 160, 2, 28)),
            ((59136, 8192), (2, 128, 2, 57)),
            // o_proj [H, Q]: 7B, 14B and 32B, 72B.
            ((3584, 3584), (1, 112, 12, 3)),
            ((5120, 5120), (1, 160, 8, 4)),
            ((8192, 8192), (2, 128, 4, 9)),
            // q/k/v [Q + 2 KV, H]: 7B, 14B and 32B, 72B.
            ((4608, 3584), (1, 112, 9, 4)),
            ((7168, 5120), (1, 160, 6, 5)),
            ((10240, 8192), (2, 128, 3, 11)),
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
        // The machine fits beside the multi-token step's 4 KB of static
        // shared memory in sm_90's 227 KB.
        assert!(TC_MACHINE_SM90.smem_bytes() + 4096 <= 227 * 1024);
    }

    #[test]
    fn scratch_gives_every_phase_counters_then_slots_then_block_sums() {
        let down = plan(3584, 18944);
        let gu = plan(37888, 3584);
        let s = TcScratch::for_plans(&[&down, &gu]);
        // gate/up has the most tiles and row tiles (2,368 each, one block).
        assert_eq!(s.bcnt_offset, 2368 * 4);
        assert_eq!(s.part_offset, ((2368 + 2368) * 4_u64).div_ceil(128) * 128);
        assert_eq!(s.part_offset % 128, 0);
        // gate/up's slots (2,368 tiles x 2) outnumber down's (896 x 4), and
        // its block sums (2,368 row tiles x 1 block) down's (224 x 4).
        assert_eq!(s.bpart_offset, s.part_offset + 2368 * 2 * 512);
        assert_eq!(s.bytes, s.bpart_offset + 2368 * 512);
        let alone = TcScratch::for_plans(&[&down]);
        assert_eq!(alone.bcnt_offset, 896 * 4);
        assert!(alone.bytes < s.bytes);
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
        for band in [16u64, 8] {
            let (rows, k) = (32usize, 96usize);
            let order = TileOrder::new(k as u64, band).unwrap();
            let orig: Vec<u8> = (0..rows * k)
                .flat_map(|i| (i as u16).to_le_bytes())
                .collect();
            let mut t = orig.clone();
            order.to_tiles(&mut t).unwrap();
            for n in 0..rows {
                for c in 0..k {
                    let at = order.offset(n as u64, c as u64) as usize * 2;
                    let v = u16::from_le_bytes([t[at], t[at + 1]]) as usize;
                    assert_eq!(v, n * k + c, "bands of {band}: element ({n}, {c})");
                }
            }
            assert_ne!(t, orig);
            // A band stays in its own bytes.
            let bytes = order.band_bytes().unwrap() as usize;
            assert_eq!(bytes, band as usize * k * 2);
            let mut sorted_a = orig[..bytes].to_vec();
            let mut sorted_b = t[..bytes].to_vec();
            sorted_a.sort_unstable();
            sorted_b.sort_unstable();
            assert_eq!(sorted_a, sorted_b);
            order.from_tiles(&mut t).unwrap();
            assert_eq!(t, orig);
        }
    }

    #[test]
    fn partial_bands_and_odd_shapes_are_refused() {
        let order = TileOrder::new(64, 16).unwrap();
        let mut b = vec![0u8; 16 * 64 * 2 + 2];
        assert!(order.to_tiles(&mut b).is_err());
        assert!(TileOrder::new(40, 16).is_err());
        assert!(TileOrder::new(64, 4).is_err());
    }

    #[test]
    fn the_first_rows_of_a_kstep_lie_where_the_lanes_load_them() {
        // Lane (g, q) loads 8 elements of rows g and g + 8 at k-step j,
        // column 8 q: in 16-row bands offsets j 512 + 8 lane and that + 256;
        // in 8-row bands (a tile's halves in two tensors) j 256 + 8 lane.
        let k = 18944;
        let (t16, t8) = (
            TileOrder::new(k, 16).unwrap(),
            TileOrder::new(k, 8).unwrap(),
        );
        for j in [0u64, 1, 147] {
            for lane in 0..32u64 {
                let (g, q) = (lane / 4, lane % 4);
                assert_eq!(t16.offset(g, 32 * j + 8 * q), j * 512 + 8 * lane);
                assert_eq!(t16.offset(g + 8, 32 * j + 8 * q), j * 512 + 256 + 8 * lane);
                assert_eq!(t8.offset(g, 32 * j + 8 * q), j * 256 + 8 * lane);
                assert_eq!(t8.offset(8 + g, 32 * j + 8 * q), 8 * k + j * 256 + 8 * lane);
            }
        }
        assert_eq!(t16.offset(16, 0), 16 * k);
    }
}
