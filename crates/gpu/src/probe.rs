//! The 32-bit trap, demonstrated on the GPU (`docs/architecture.md`, the
//! offset model).
//!
//! A stacked tensor of a real model's shape (14B `gate_proj`: [48, 13824,
//! 5120] bf16, 6.79 GB) is filled with bf16(l + 1) in every element of layer
//! l; the probe kernel reads element [l, N-1, K-1] of every layer through
//! the megakernel's own koff_t offset arithmetic, once with the planner's
//! chunks and once with the tensor forced into one chunk.

use std::ffi::c_void;
use std::time::Duration;

use half::bf16;
use qmk_kernels::{ProbeFillParams, ProbeParams, MAX_CHUNKS, THREADS_PER_CTA};
use qmk_layout::{first_wrapping_slice, plan_split, Chunk, TensorPlan, KERNEL_OFFSET_MODEL};
use qmk_model::Config;

use crate::backend::{alloc, GpuBackend};
use crate::driver::{DeviceMemory, Driver, LaunchShape};
use crate::error::{Error, Result};

/// One probe pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRun {
    /// (first layer, end layer) of each chunk.
    pub chunks: Vec<(u64, u64)>,
    /// Layers whose last element read back wrong.
    pub wrong_layers: Vec<u32>,
    /// The first of them.
    pub first_wrong: Option<u32>,
    /// The layer each read actually landed in (value - 1), per layer.
    pub landed_in: Vec<i64>,
}

/// Both passes and the layout crate's prediction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    /// The tensor probed.
    pub tensor: String,
    /// Its layout.
    pub layout: String,
    /// Its bytes.
    pub total_bytes: u64,
    /// Bytes of one layer.
    pub layer_bytes: u64,
    /// `qmk_layout::first_wrapping_slice` for the unsplit tensor.
    pub predicted_first_wrong: Option<u64>,
    /// The pass with the planner's chunks.
    pub split: ProbeRun,
    /// The pass with the tensor in one chunk.
    pub unsplit: ProbeRun,
}

impl ProbeReport {
    /// The trap is shown: the unsplit pass goes wrong exactly at the
    /// predicted layer, and the split pass is right everywhere.
    pub fn as_predicted(&self) -> bool {
        self.split.wrong_layers.is_empty()
            && self.unsplit.first_wrong.map(u64::from) == self.predicted_first_wrong
    }
}

impl<D: Driver> GpuBackend<D> {
    /// Runs the probe on `tensor` of `config` (e.g. 14B, "gate_proj").
    pub fn trap_probe(&mut self, config: &Config, tensor: &str) -> Result<ProbeReport> {
        self.usable()?;
        let spec = qmk_model::stacked_specs(config)?
            .into_iter()
            .find(|s| s.name == tensor)
            .ok_or_else(|| Error::Weights {
                tensor: tensor.into(),
                reason: "no such stacked tensor in the config".into(),
            })?;
        let shape = spec.layout.shape().to_vec();
        let stride = spec.layout.stride().to_vec();
        if shape.len() != 3 {
            return Err(Error::Weights {
                tensor: tensor.into(),
                reason: format!("the probe needs a rank-3 tensor, got {}", spec.layout),
            });
        }
        let u32_of = |v: u64, what: &str| {
            u32::try_from(v).map_err(|_| Error::Overflow(format!("{tensor} {what}")))
        };
        let total = spec.byte_span()?.0;
        let layer_bytes = stride[0] * 2;
        let predicted = first_wrapping_slice(&spec, &KERNEL_OFFSET_MODEL)?;
        let split_plan = plan_split(&spec, &KERNEL_OFFSET_MODEL)?;
        let unsplit_plan = TensorPlan {
            spec: spec.clone(),
            chunks: vec![Chunk {
                start: 0,
                end: shape[0],
                byte_span: spec.byte_span()?,
            }],
        };

        let free = self.driver.mem_info();
        let free = free.map_err(|c| self.fail("cuMemGetInfo", c))?.0;
        if total + (256 << 20) > free {
            return Err(Error::OutOfMemory {
                what: format!("the trap probe's {tensor} {}", spec.layout),
                needed: total,
                available: free,
            });
        }
        let buf = alloc(&self.driver, total, "probe tensor", false)?;
        let out = alloc(&self.driver, shape[0] * 4, "probe output", true)?;

        // Fill: layer l holds bf16(l + 1) everywhere.
        let mut fill = ProbeFillParams {
            base: buf.addr(),
            n_vec16: total / 16,
            layer_vecs: layer_bytes / 16,
        };
        let args = (&mut fill as *mut ProbeFillParams).cast::<c_void>();
        // SAFETY: one ProbeFillParams by value; buf is live.
        let r = unsafe {
            self.driver.launch(
                self.funcs.probe_fill,
                LaunchShape::plain(self.info.sms * 4),
                &self.stream,
                args,
            )
        };
        r.map_err(|c| self.fail("cuLaunchKernel (probe fill)", c))?;

        let mut run = |plan: &TensorPlan| -> Result<ProbeRun> {
            if plan.chunks.len() > MAX_CHUNKS {
                return Err(Error::Overflow(format!("{tensor} chunk count")));
            }
            let mut p = ProbeParams {
                chunk_base: [0; MAX_CHUNKS],
                out: out.addr(),
                chunk_start: [0; MAX_CHUNKS + 1],
                num_chunks: plan.chunks.len() as u32,
                layers: u32_of(shape[0], "layers")?,
                rows: u32_of(shape[1], "rows")?,
                cols: u32_of(shape[2], "cols")?,
                stride0: u32_of(stride[0], "stride 0")?,
                stride1: u32_of(stride[1], "stride 1")?,
                stride2: u32_of(stride[2], "stride 2")?,
            };
            for (c, chunk) in plan.chunks.iter().enumerate() {
                // Host side, 64-bit: the chunk base inside the one buffer.
                p.chunk_base[c] = buf.addr() + plan.chunk_byte_offset(c)?.0;
                p.chunk_start[c] = chunk.start as u32;
            }
            p.chunk_start[plan.chunks.len()] = shape[0] as u32;
            let args = (&mut p as *mut ProbeParams).cast::<c_void>();
            let blocks = (shape[0] as u32).div_ceil(THREADS_PER_CTA);
            // SAFETY: one ProbeParams by value; buffers are live.
            let r = unsafe {
                self.driver.launch(
                    self.funcs.probe,
                    LaunchShape::plain(blocks),
                    &self.stream,
                    args,
                )
            };
            r.map_err(|c| self.fail("cuLaunchKernel (trap probe)", c))?;
            let ev = self.new_event()?;
            self.record(&ev)?;
            self.wait(&ev, Duration::from_secs(60))?;
            let mut got = vec![0u32; shape[0] as usize];
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut got);
            // SAFETY: out holds `layers` u32.
            let r = unsafe { self.driver.dtoh(bytes, out.addr()) };
            r.map_err(|c| self.fail("cuMemcpyDtoH (probe)", c))?;
            let mut wrong = Vec::new();
            let mut landed = Vec::new();
            for (l, &bits) in got.iter().enumerate() {
                let v = bf16::from_bits(bits as u16).to_f32();
                landed.push(v as i64 - 1);
                if bits != bf16::from_f32((l + 1) as f32).to_bits() as u32 {
                    wrong.push(l as u32);
                }
            }
            Ok(ProbeRun {
                chunks: plan.chunks.iter().map(|c| (c.start, c.end)).collect(),
                first_wrong: wrong.first().copied(),
                wrong_layers: wrong,
                landed_in: landed,
            })
        };
        let split = run(&split_plan)?;
        let unsplit = run(&unsplit_plan)?;
        Ok(ProbeReport {
            tensor: tensor.into(),
            layout: spec.layout.to_string(),
            total_bytes: total,
            layer_bytes,
            predicted_first_wrong: predicted,
            split,
            unsplit,
        })
    }
}
