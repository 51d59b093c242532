//! The streamed weight upload: every planned chunk goes from its
//! [`WeightSource`] to its device allocation through a small ring of pinned
//! staging buffers, so host memory stays at the ring's size whatever the
//! model's size.
//!
//! Per piece (at most one buffer's bytes of one chunk): wait until the
//! buffer's previous copy has landed (its event), let the source fill it
//! (a disk read and conversion to bf16, or the synthetic generator), queue
//! an asynchronous copy on the upload stream and record the buffer's event.
//! With `n` buffers the host fills one while up to `n - 1` copies are in
//! flight, so reading and copying overlap and the upload runs at the slower
//! of the two rates. Pinned buffers let the copy engine read host memory
//! directly (no driver bounce through its own staging memory).
//!
//! A chunk held in tile order ([`PlannedChunk::tile`]) is permuted in the
//! buffer after the source fills it; its pieces are whole bands of its
//! order so that no band is split between two fills.

use std::time::{Duration, Instant};

use crate::backend::alloc;
use crate::driver::{DeviceMemory, Driver, MappedHost};
use crate::error::{Error, Result};
use crate::options::Progress;
use crate::staging::{PlannedChunk, WeightSource};

/// Default [`UploadOptions::buffers`]: one being filled, two in flight.
pub const DEFAULT_UPLOAD_BUFFERS: usize = 3;
/// Default [`UploadOptions::buffer_bytes`]: 64 MiB, far past the size where
/// a pinned copy reaches full PCIe speed, and 192 MiB of host memory in
/// all with the default three buffers.
pub const DEFAULT_UPLOAD_BUFFER_BYTES: usize = 64 << 20;

/// The staging ring of the weight upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadOptions {
    /// Pinned buffers (at least 1; 2 or more overlap reading and copying).
    pub buffers: usize,
    /// Bytes of each (even, at least 2; rounded down to even).
    pub buffer_bytes: usize,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions {
            buffers: DEFAULT_UPLOAD_BUFFERS,
            buffer_bytes: DEFAULT_UPLOAD_BUFFER_BYTES,
        }
    }
}

impl UploadOptions {
    /// Host memory the ring pins, bytes.
    pub fn host_bytes(&self) -> Option<usize> {
        self.buffers.checked_mul(self.buffer_bytes)
    }

    fn checked(&self) -> Result<UploadOptions> {
        let bytes = self.buffer_bytes & !1;
        if self.buffers == 0 || bytes == 0 || self.host_bytes().is_none() {
            return Err(Error::Option {
                field: "upload",
                reason: format!(
                    "{} staging buffers of {} bytes: need at least one buffer of 2 bytes or more",
                    self.buffers, self.buffer_bytes
                ),
            });
        }
        Ok(UploadOptions {
            buffers: self.buffers,
            buffer_bytes: bytes,
        })
    }
}

/// What one weight upload did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UploadStats {
    /// Bytes copied to the device.
    pub bytes: u64,
    /// Wall time from the first allocation to the last copy landed.
    pub time: Duration,
    /// Host time spent filling staging buffers (disk reads, conversion,
    /// generation).
    pub read_time: Duration,
    /// Host time spent waiting for a staging buffer's copy to land.
    pub wait_time: Duration,
    /// Copies queued.
    pub pieces: u64,
    /// Pinned staging buffers.
    pub buffers: usize,
    /// Bytes of each.
    pub buffer_bytes: usize,
}

impl UploadStats {
    /// Upload rate, GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        let s = self.time.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

/// One staging buffer and the event recorded after its last copy.
struct Slot<D: Driver> {
    host: MappedHost,
    landed: D::Event,
    /// Bytes of the copy in flight from it (0: free).
    in_flight: usize,
}

/// The ring and its stream. Dropping it (an error part way) waits for the
/// copies in flight first: the copy engine must not read a freed buffer.
struct Ring<'d, D: Driver> {
    d: &'d D,
    stream: D::Stream,
    slots: Vec<Slot<D>>,
}

impl<D: Driver> Drop for Ring<'_, D> {
    fn drop(&mut self) {
        let _ = self.d.stream_synchronize(&self.stream);
    }
}

impl<D: Driver> Ring<'_, D> {
    /// Waits for slot `i`'s copy in flight, if any, and reports its bytes.
    fn land(
        &mut self,
        i: usize,
        stats: &mut UploadStats,
        progress: &mut dyn Progress,
    ) -> Result<()> {
        let slot = &mut self.slots[i];
        if slot.in_flight == 0 {
            return Ok(());
        }
        let t = Instant::now();
        self.d
            .event_synchronize(&slot.landed)
            .map_err(Error::at("cuEventSynchronize (weight upload)"))?;
        stats.wait_time += t.elapsed();
        progress.advance(slot.in_flight as u64);
        slot.in_flight = 0;
        Ok(())
    }
}

/// Allocates every chunk of `chunks` on the device (one allocation each, in
/// order) and fills it from `source` through a ring of pinned buffers
/// (`opts`), reporting progress as `what` in landed bytes. Returns the
/// allocations, in `chunks` order, once every copy has landed.
pub(crate) fn upload_weights<D: Driver>(
    d: &D,
    source: &dyn WeightSource,
    chunks: &[PlannedChunk],
    opts: &UploadOptions,
    what: &str,
    progress: &mut dyn Progress,
) -> Result<(Vec<D::Memory>, UploadStats)> {
    let opts = opts.checked()?;
    // Every chunk's piece size before anything is allocated: a staging
    // buffer smaller than a band fails here, naming the tensor.
    let pieces = chunks
        .iter()
        .map(|c| c.piece_bytes(opts.buffer_bytes))
        .collect::<Result<Vec<_>>>()?;
    let total = chunks
        .iter()
        .try_fold(0u64, |a, c| a.checked_add(c.bytes))
        .ok_or_else(|| Error::Overflow("the weights".into()))?;
    let t0 = Instant::now();
    // Allocations are declared before the ring, so an error drops the ring
    // (waiting for the copies in flight) before freeing them.
    let mut out = Vec::with_capacity(chunks.len());
    let mut ring = Ring {
        d,
        stream: d
            .stream()
            .map_err(Error::at("cuStreamCreate (weight upload)"))?,
        slots: Vec::with_capacity(opts.buffers),
    };
    for _ in 0..opts.buffers {
        let host = d
            .alloc_mapped(opts.buffer_bytes)
            .map_err(Error::at("cuMemHostAlloc (weight upload staging)"))?;
        let landed = d
            .event()
            .map_err(Error::at("cuEventCreate (weight upload)"))?;
        ring.slots.push(Slot {
            host,
            landed,
            in_flight: 0,
        });
    }
    let mut stats = UploadStats {
        buffers: opts.buffers,
        buffer_bytes: opts.buffer_bytes,
        ..UploadStats::default()
    };
    progress.begin(what, total);
    let mut next = 0usize;
    for (c, &piece) in chunks.iter().zip(&pieces) {
        // Into `out` first: an error below must free it after the ring.
        out.push(alloc(
            d,
            c.bytes,
            &format!("{} chunk {}", c.tensor, c.chunk),
            false,
        )?);
        let base = out.last().map_or(0, DeviceMemory::addr);
        let mut at = 0u64;
        while at < c.bytes {
            let n = (c.bytes - at).min(piece as u64) as usize;
            let i = next % opts.buffers;
            next += 1;
            ring.land(i, &mut stats, progress)?;
            let slot = &mut ring.slots[i];
            let t = Instant::now();
            // SAFETY: no copy from this buffer is in flight (landed above)
            // and the device never addresses it otherwise.
            let host = unsafe { slot.host.host_slice_mut() };
            source.read(c, at, &mut host[..n])?;
            // `at` and `n` are whole bands of a tiled chunk (piece_bytes).
            c.to_device_order(&mut host[..n])?;
            stats.read_time += t.elapsed();
            // SAFETY: at + n <= c.bytes, the size of the allocation at
            // base; n <= piece <= the buffer's bytes.
            unsafe { d.htod_async(base + at, &slot.host, n, &ring.stream) }
                .map_err(Error::at("cuMemcpyHtoDAsync (weight upload)"))?;
            d.record(&slot.landed, &ring.stream)
                .map_err(Error::at("cuEventRecord (weight upload)"))?;
            slot.in_flight = n;
            stats.pieces += 1;
            at += n as u64;
        }
    }
    for i in 0..opts.buffers {
        ring.land(i, &mut stats, progress)?;
    }
    d.stream_synchronize(&ring.stream)
        .map_err(Error::at("cuStreamSynchronize (weight upload)"))?;
    drop(ring);
    stats.bytes = total;
    stats.time = t0.elapsed();
    progress.finish();
    Ok((out, stats))
}

#[cfg(test)]
pub(crate) mod mock {
    //! A [`Driver`] whose "device" is host memory: allocations are byte
    //! vectors at made-up addresses, and an asynchronous copy is queued and
    //! carried out only when an event after it is waited for (or the stream
    //! is synchronised), reading the host buffer *then*, as a copy engine
    //! would. A host that refilled a buffer before its copy landed would
    //! therefore put the wrong bytes on the "device". Everything is
    //! counted: copies, pinned buffers, queued copies.

    use std::cell::{Cell, RefCell};
    use std::collections::{BTreeMap, HashMap, VecDeque};
    use std::ffi::c_void;

    use qmk_engine::BackendKind;

    use crate::cuda::CudaCode;
    use crate::driver::{
        DeviceAttr, DeviceMemory, Driver, LaunchShape, MappedHost, TensorMap2d, TENSOR_MAP_BYTES,
    };
    use crate::error::Result;

    /// A queued copy: (sequence number, device address, host address, bytes).
    type Op = (u64, u64, usize, usize);

    /// What the mock saw (per thread: each test runs on its own).
    #[derive(Debug, Default)]
    pub struct State {
        /// Device allocations by address.
        pub mem: BTreeMap<u64, Vec<u8>>,
        next_addr: u64,
        /// Device bytes the mock may allocate in all.
        pub capacity: u64,
        queue: VecDeque<Op>,
        seq: u64,
        /// Every copy carried out: (device address, bytes).
        pub copies: Vec<(u64, usize)>,
        /// Most copies queued at once, and their bytes.
        pub max_queued: usize,
        /// Most bytes queued at once.
        pub max_queued_bytes: usize,
        /// Live pinned buffers: address -> bytes.
        pub pinned: HashMap<usize, usize>,
        /// Pinned buffers ever allocated, and the most pinned bytes live.
        pub pinned_allocs: usize,
        /// Most pinned bytes live at once.
        pub max_pinned_bytes: usize,
        /// Every tensor descriptor asked for.
        pub maps: Vec<TensorMap2d>,
    }

    thread_local! {
        /// This thread's mock device.
        pub static STATE: RefCell<State> = RefCell::new(State {
            next_addr: 1 << 40,
            capacity: u64::MAX,
            ..State::default()
        });
    }

    /// Clears this thread's counters (the device must be empty).
    pub fn reset() {
        with(|s| {
            assert!(s.mem.is_empty() && s.pinned.is_empty() && s.queue.is_empty());
            s.copies.clear();
            (s.max_queued, s.max_queued_bytes) = (0, 0);
            (s.pinned_allocs, s.max_pinned_bytes) = (0, 0);
        })
    }

    /// Runs `f` on this thread's mock state.
    pub fn with<R>(f: impl FnOnce(&mut State) -> R) -> R {
        STATE.with(|s| f(&mut s.borrow_mut()))
    }

    /// Carries out the queued copies up to sequence number `upto`.
    fn run(upto: u64) {
        with(|s| {
            while s.queue.front().is_some_and(|op| op.0 <= upto) {
                let (_, dst, src, n) = s.queue.pop_front().expect("front");
                let live = s.pinned.iter().any(|(&a, &b)| src >= a && src + n <= a + b);
                assert!(
                    live,
                    "a copy reads host memory that is not a live pinned buffer"
                );
                // SAFETY: src..src + n lies in a live pinned buffer (above).
                let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, n) };
                region(s, dst, n).copy_from_slice(bytes);
                s.copies.push((dst, n));
            }
        })
    }

    /// The device bytes `dst..dst + n`, inside one allocation (else a panic:
    /// a copy out of bounds).
    fn region(s: &mut State, dst: u64, n: usize) -> &mut [u8] {
        let (&base, v) = s
            .mem
            .range_mut(..=dst)
            .next_back()
            .expect("a device address below every allocation");
        let off = (dst - base) as usize;
        assert!(
            off + n <= v.len(),
            "device access {dst:#x}+{n} past its allocation"
        );
        &mut v[off..off + n]
    }

    /// The mock context.
    #[derive(Debug)]
    pub struct Mock;

    /// A device allocation of the mock.
    #[derive(Debug)]
    pub struct Memory(u64, usize);

    impl DeviceMemory for Memory {
        fn addr(&self) -> u64 {
            self.0
        }
        fn bytes(&self) -> usize {
            self.1
        }
    }

    impl Drop for Memory {
        fn drop(&mut self) {
            with(|s| s.mem.remove(&self.0));
        }
    }

    /// An event: the copies queued before it was recorded.
    #[derive(Debug, Default)]
    pub struct Event(Cell<u64>);

    const NOT_SUPPORTED: CudaCode = CudaCode(801);

    impl Driver for Mock {
        const NAME: &'static str = "mock";
        const KIND: BackendKind = BackendKind::Cudarc;
        type Module = ();
        type Function = ();
        type Stream = ();
        type Event = Event;
        type Memory = Memory;

        fn init() -> Result<()> {
            Ok(())
        }
        fn count() -> Result<usize, CudaCode> {
            Ok(1)
        }
        fn name(_: usize) -> Result<String, CudaCode> {
            Ok("mock H200".into())
        }
        fn total_mem(_: usize) -> Result<u64, CudaCode> {
            Ok(with(|s| s.capacity))
        }
        fn attribute(_: usize, a: DeviceAttr) -> Result<i32, CudaCode> {
            // An H200's answers.
            Ok(match a {
                DeviceAttr::ComputeMajor => 9,
                DeviceAttr::ComputeMinor => 0,
                DeviceAttr::MultiprocessorCount => 132,
                DeviceAttr::MaxSharedMemoryPerBlockOptin => 232_448,
                DeviceAttr::CooperativeLaunch => 1,
            })
        }
        fn open(_: usize) -> Result<Self, CudaCode> {
            Ok(Mock)
        }
        fn bind(&self) -> Result<(), CudaCode> {
            Ok(())
        }
        fn can_access_peer(_: usize, _: usize) -> Result<bool, CudaCode> {
            Ok(false)
        }
        fn enable_peer_access(&self, _: &Self) -> Result<(), CudaCode> {
            Err(CudaCode(1))
        }
        fn mem_info(&self) -> Result<(u64, u64), CudaCode> {
            Ok(with(|s| {
                let used: u64 = s.mem.values().map(|v| v.len() as u64).sum();
                (s.capacity - used, s.capacity)
            }))
        }
        fn synchronize(&self) -> Result<(), CudaCode> {
            run(u64::MAX);
            Ok(())
        }
        fn load_module(&self, _: &[u8]) -> Result<(), CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn function(&self, _: &(), _: &str) -> Result<(), CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn global_u64(&self, _: &(), _: &str) -> Result<Option<u64>, CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn set_max_dynamic_smem(&self, _: (), _: u32) -> Result<(), CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn registers(&self, _: ()) -> Result<i32, CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn occupancy(&self, _: (), _: u32, _: u32) -> Result<i32, CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn alloc(&self, bytes: usize) -> Result<Memory, CudaCode> {
            with(|s| {
                let used: u64 = s.mem.values().map(|v| v.len() as u64).sum();
                if used + bytes as u64 > s.capacity {
                    return Err(CudaCode::OUT_OF_MEMORY);
                }
                let addr = s.next_addr;
                // A gap after each allocation: a copy past its end cannot
                // land in the next one.
                s.next_addr += (bytes as u64).next_multiple_of(1 << 20) + (1 << 20);
                // Garbage, not zeros: a byte never copied shows.
                s.mem.insert(addr, vec![0xA5; bytes]);
                Ok(Memory(addr, bytes))
            })
        }
        fn host_alloc_mapped(&self, bytes: usize) -> Result<*mut c_void, CudaCode> {
            let layout = std::alloc::Layout::from_size_align(bytes.max(1), 4096)
                .map_err(|_| CudaCode::OUT_OF_MEMORY)?;
            // SAFETY: non-zero size.
            let p = unsafe { std::alloc::alloc(layout) };
            with(|s| {
                s.pinned.insert(p as usize, bytes);
                s.pinned_allocs += 1;
                let live = s.pinned.values().sum();
                s.max_pinned_bytes = s.max_pinned_bytes.max(live);
            });
            Ok(p.cast())
        }
        unsafe fn host_device_addr(&self, host: *mut c_void) -> Result<u64, CudaCode> {
            Ok(host as u64)
        }
        unsafe fn host_free(host: *mut c_void) {
            let bytes = with(|s| s.pinned.remove(&(host as usize)))
                .expect("freeing a pinned buffer the mock did not allocate");
            let layout = std::alloc::Layout::from_size_align(bytes.max(1), 4096).expect("layout");
            // SAFETY: allocated above with this layout, freed once.
            unsafe { std::alloc::dealloc(host.cast(), layout) };
        }
        unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaCode> {
            with(|s| region(s, dst, src.len()).copy_from_slice(src));
            Ok(())
        }
        unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaCode> {
            with(|s| dst.copy_from_slice(region(s, src, dst.len())));
            Ok(())
        }
        unsafe fn htod_async(
            &self,
            dst: u64,
            src: &MappedHost,
            bytes: usize,
            _: &(),
        ) -> Result<(), CudaCode> {
            assert!(bytes <= src.bytes(), "a copy of more than its buffer");
            with(|s| {
                s.seq += 1;
                let seq = s.seq;
                s.queue
                    .push_back((seq, dst, src.host_ptr() as usize, bytes));
                s.max_queued = s.max_queued.max(s.queue.len());
                let queued = s.queue.iter().map(|op| op.3).sum();
                s.max_queued_bytes = s.max_queued_bytes.max(queued);
            });
            Ok(())
        }
        unsafe fn memset_d8(&self, dst: u64, value: u8, n: usize) -> Result<(), CudaCode> {
            with(|s| region(s, dst, n).fill(value));
            Ok(())
        }
        unsafe fn memset_d16(&self, _: u64, _: u16, _: usize) -> Result<(), CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn tensor_map(&self, t: &TensorMap2d) -> Result<[u8; TENSOR_MAP_BYTES], CudaCode> {
            with(|s| s.maps.push(*t));
            // The descriptor's first word: its base, so a test can tell K's from V's.
            let mut out = [0; TENSOR_MAP_BYTES];
            out[..8].copy_from_slice(&t.base.to_ne_bytes());
            Ok(out)
        }
        fn stream(&self) -> Result<(), CudaCode> {
            Ok(())
        }
        fn stream_synchronize(&self, _: &()) -> Result<(), CudaCode> {
            run(u64::MAX);
            Ok(())
        }
        unsafe fn launch(
            &self,
            _: (),
            _: LaunchShape,
            _: &(),
            _: *mut c_void,
        ) -> Result<(), CudaCode> {
            Err(NOT_SUPPORTED)
        }
        fn event(&self) -> Result<Event, CudaCode> {
            Ok(Event::default())
        }
        fn record(&self, event: &Event, _: &()) -> Result<(), CudaCode> {
            event.0.set(with(|s| s.seq));
            Ok(())
        }
        fn query(&self, event: &Event) -> Result<bool, CudaCode> {
            run(event.0.get());
            Ok(true)
        }
        fn event_synchronize(&self, event: &Event) -> Result<(), CudaCode> {
            run(event.0.get());
            Ok(())
        }
        fn elapsed_ms(&self, _: &Event, _: &Event) -> Result<f32, CudaCode> {
            Err(NOT_SUPPORTED)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::mock::{with, Mock};
    use super::*;
    use qmk_kernels::KernelBuild;
    use qmk_layout::{OffsetModel, OffsetUnit, TileOrder};
    use qmk_model::{Config, SyntheticSource};

    use crate::staging::planned_chunks;

    /// A small model whose tensors the plan splits into many chunks (an
    /// offset model of 2^17 bytes instead of the kernel's 2^32), so the
    /// upload crosses chunk boundaries as 72B's does.
    fn split_model(tied: bool) -> (Config, Vec<PlannedChunk>) {
        let c = crate::staging::tests::tiny(tied);
        let specs = qmk_model::stacked_specs(&c).unwrap();
        let plan =
            qmk_layout::plan_model(&specs, &OffsetModel::new(17, OffsetUnit::Bytes)).unwrap();
        let build = KernelBuild::with_plan(&c, plan).unwrap();
        let chunks = planned_chunks(&build).unwrap();
        (c, chunks)
    }

    /// Counts what the upload reports.
    #[derive(Default)]
    struct Count {
        begun: Vec<(String, u64)>,
        landed: u64,
        finished: usize,
    }

    impl Progress for Count {
        fn begin(&mut self, what: &str, total: u64) {
            self.begun.push((what.into(), total));
        }
        fn advance(&mut self, bytes: u64) {
            self.landed += bytes;
        }
        fn finish(&mut self) {
            self.finished += 1;
        }
    }

    #[test]
    fn every_byte_lands_where_the_plan_says_through_a_bounded_ring() {
        for tied in [true, false] {
            super::mock::reset();
            let (c, chunks) = split_model(tied);
            assert!(
                chunks.iter().filter(|x| x.tensor == "gate_proj").count() > 1,
                "the test model must have split tensors"
            );
            let whole = qmk_model::synthetic_weights(&c, 5);
            let src = SyntheticSource::new(&c, 5).unwrap();
            // 3 buffers of 3,000 bytes: pieces straddle rows and layers, and
            // a chunk's last piece is short.
            let opts = UploadOptions {
                buffers: 3,
                buffer_bytes: 3001,
            };
            let mut p = Count::default();
            let (mem, stats) =
                upload_weights(&Mock, &src, &chunks, &opts, "weights", &mut p).unwrap();
            let total: u64 = chunks.iter().map(|x| x.bytes).sum();
            let pieces: u64 = chunks.iter().map(|x| x.bytes.div_ceil(3000)).sum();
            assert_eq!(p.begun, vec![("weights".to_string(), total)]);
            assert_eq!((p.landed, p.finished), (total, 1));
            assert_eq!(
                (stats.bytes, stats.pieces, stats.buffer_bytes),
                (total, pieces, 3000)
            );
            with(|s| {
                // The ring: three pinned buffers of 3,000 bytes, all freed;
                // never more than two copies queued behind the one filling.
                assert_eq!(s.pinned_allocs, 3);
                assert_eq!(s.max_pinned_bytes, 9000);
                assert!(s.pinned.is_empty(), "pinned buffers leaked");
                assert!(s.max_queued <= 3 && s.max_queued_bytes <= 9000, "{s:?}");
                assert_eq!(s.copies.len() as u64, pieces);
                // Each allocation got its chunk's bytes exactly once, in
                // contiguous pieces.
                for (m, x) in mem.iter().zip(&chunks) {
                    assert_eq!(m.bytes() as u64, x.bytes);
                    let mut at = m.addr();
                    for &(dst, n) in s
                        .copies
                        .iter()
                        .filter(|(d, _)| *d >= m.addr() && *d < m.addr() + m.bytes() as u64)
                    {
                        assert_eq!(dst, at, "{} chunk {}", x.tensor, x.chunk);
                        at += n as u64;
                    }
                    assert_eq!(at, m.addr() + x.bytes);
                    let kind = qmk_model::WeightKind::ALL
                        .into_iter()
                        .find(|k| k.name() == x.tensor)
                        .unwrap();
                    let want: &[u8] = bytemuck::cast_slice(whole.get(kind).unwrap());
                    let got = &s.mem[&m.addr()];
                    let range = x.offset as usize..(x.offset + x.bytes) as usize;
                    assert!(
                        got == &want[range],
                        "{} chunk {} differs",
                        x.tensor,
                        x.chunk
                    );
                }
            });
            drop(mem);
            with(|s| assert!(s.mem.is_empty()));
        }
    }

    /// The backend sizes the run from the device's free memory and refuses
    /// a plan that does not fit with the numbers, before it compiles,
    /// allocates or reads anything.
    #[test]
    fn the_backend_refuses_a_plan_that_does_not_fit_before_any_upload() {
        let c = Config::preset("72b").unwrap();
        let src = SyntheticSource::new(&c, 5).unwrap();
        let h200 = 150_109_880_320u64;
        with(|s| s.capacity = h200);
        let opts = |capacity, fit| crate::Options {
            capacity,
            fit_capacity: fit,
            ..crate::Options::default()
        };
        let refuse = |o| match crate::GpuBackend::<Mock>::from_source(&src, o, &mut ()) {
            Err(e) => e,
            Ok(_) => panic!("a plan past the device's memory was accepted"),
        };
        let e = refuse(opts(40_000, false));
        let plan = crate::MemoryPlan::new(&c, 40_000, 132, Some(2048)).unwrap();
        match &e {
            Error::OutOfMemory {
                what,
                needed,
                available,
            } => {
                assert_eq!((*needed, *available), (plan.total_bytes, h200));
                assert!(what.contains("40000-position KV cache"), "{what}");
                assert!(
                    what.contains(&format!("{} B weights", plan.weight_bytes)),
                    "{what}"
                );
            }
            e => panic!("{e}"),
        }
        // With the fit, a device that cannot hold the weights is refused too.
        with(|s| s.capacity = 100_000_000_000);
        let e = refuse(opts(32768, true));
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
        assert!(e.to_string().contains("a KV cache of one position"), "{e}");
        with(|s| {
            assert!(s.mem.is_empty() && s.copies.is_empty());
            assert_eq!(s.pinned_allocs, 0, "a staging buffer before the check");
        });
    }

    /// A source that fails on its `fail_at`-th read.
    struct Failing {
        inner: SyntheticSource,
        reads: std::sync::atomic::AtomicUsize,
        fail_at: usize,
    }

    impl WeightSource for Failing {
        fn config(&self) -> &Config {
            self.inner.config()
        }
        fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
            let n = self
                .reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n == self.fail_at {
                return Err(Error::Weights {
                    tensor: chunk.tensor.clone(),
                    reason: "the disk went away".into(),
                });
            }
            self.inner.read(chunk, offset, dst)
        }
    }

    #[test]
    fn a_failed_read_waits_for_copies_in_flight_then_frees_everything() {
        let (c, chunks) = split_model(true);
        let src = Failing {
            inner: SyntheticSource::new(&c, 5).unwrap(),
            reads: 0.into(),
            fail_at: 40,
        };
        let opts = UploadOptions {
            buffers: 3,
            buffer_bytes: 2048,
        };
        let e = upload_weights(&Mock, &src, &chunks, &opts, "w", &mut ()).unwrap_err();
        assert!(e.to_string().contains("the disk went away"), "{e}");
        with(|s| {
            // Every queued copy ran (from live buffers: the mock checks)
            // before the buffers and allocations were freed.
            assert_eq!(s.copies.len(), 40);
            assert!(s.pinned.is_empty() && s.mem.is_empty(), "{s:?}");
        });
    }

    #[test]
    fn device_out_of_memory_names_the_chunk_and_the_ring_is_checked() {
        let (c, chunks) = split_model(false);
        let src = SyntheticSource::new(&c, 5).unwrap();
        with(|s| s.capacity = chunks[0].bytes + chunks[1].bytes);
        let e = upload_weights(
            &Mock,
            &src,
            &chunks,
            &UploadOptions::default(),
            "w",
            &mut (),
        )
        .unwrap_err();
        let want = format!("{} chunk {}", chunks[2].tensor, chunks[2].chunk);
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if *what == want),
            "{e}"
        );
        with(|s| assert!(s.pinned.is_empty() && s.mem.is_empty()));
        for bad in [(0, 1024), (2, 1), (usize::MAX, 2)] {
            let o = UploadOptions {
                buffers: bad.0,
                buffer_bytes: bad.1,
            };
            let e = upload_weights(&Mock, &src, &chunks, &o, "w", &mut ()).unwrap_err();
            assert!(e.to_string().contains("staging buffers"), "{e}");
        }
    }

    /// One buffer still works (no overlap: each piece lands before the next
    /// fill), and the in-memory weights give the same device bytes as the
    /// generator.
    #[test]
    fn one_buffer_and_in_memory_weights() {
        let (c, chunks) = split_model(false);
        let whole = qmk_model::synthetic_weights(&c, 5);
        let opts = UploadOptions {
            buffers: 1,
            buffer_bytes: 1 << 20,
        };
        let (mem, _) = upload_weights(&Mock, &whole, &chunks, &opts, "w", &mut ()).unwrap();
        with(|s| {
            assert_eq!(s.max_queued, 1);
            for (m, x) in mem.iter().zip(&chunks) {
                let mut want = Vec::new();
                crate::staging::read_chunk(&whole, x, 4096, &mut |_, b| {
                    want.extend_from_slice(b);
                    Ok(())
                })
                .unwrap();
                assert!(s.mem[&m.addr()] == want, "{} chunk {}", x.tensor, x.chunk);
            }
        });
    }

    /// A source whose element `e` of every tensor holds bits `e` (distinct
    /// for small tensors), recording each read as (tensor, offset, bytes).
    struct Iota {
        config: Config,
        reads: std::sync::Mutex<Vec<(String, u64, usize)>>,
    }

    impl Iota {
        fn new() -> Iota {
            Iota {
                config: Config::preset("7b").unwrap(),
                reads: Vec::new().into(),
            }
        }
    }

    impl WeightSource for Iota {
        fn config(&self) -> &Config {
            &self.config
        }
        fn read(&self, chunk: &PlannedChunk, offset: u64, dst: &mut [u8]) -> Result<()> {
            self.reads
                .lock()
                .unwrap()
                .push((chunk.tensor.clone(), offset, dst.len()));
            let first = (chunk.offset + offset) / 2;
            for (i, e) in dst.chunks_exact_mut(2).enumerate() {
                e.copy_from_slice(&((first + i as u64) as u16).to_le_bytes());
            }
            Ok(())
        }
    }

    /// Two layers of a `[32, 64]` tensor, one chunk a layer, held in tile
    /// order with bands of `band` rows (16 or 8), or row-major (`None`).
    fn layers(tensor: &str, band: Option<u64>) -> Vec<PlannedChunk> {
        (0..2)
            .map(|l| PlannedChunk {
                tensor: tensor.into(),
                chunk: l,
                offset: l as u64 * 4096,
                bytes: 4096,
                tensor_bytes: 8192,
                tile: band.map(|rows| TileOrder::new(64, rows).unwrap()),
            })
            .collect()
    }

    /// A tiled chunk's device bytes are its row-major bytes in its tile
    /// order, element by element (16-row and 8-row bands side by side),
    /// and no piece splits a band; a row-major chunk uploaded beside them
    /// is untouched and cut at the buffer's size.
    #[test]
    fn a_tiled_chunk_lands_in_tile_order_in_whole_bands() {
        // Bands are 2,048 bytes (16 rows) and 1,024 (8 rows): 3,000-byte
        // buffers hold one of the first and two of the second, 3,500-byte
        // ones one and three, 7,000-byte ones more than a layer of either.
        for buffer in [3000usize, 3500, 7000] {
            super::mock::reset();
            let mut chunks = layers("down_proj", Some(16));
            chunks.extend(layers("gate_proj", Some(8)));
            chunks.extend(layers("up_proj", None));
            let src = Iota::new();
            let opts = UploadOptions {
                buffers: 2,
                buffer_bytes: buffer,
            };
            let (mem, stats) = upload_weights(&Mock, &src, &chunks, &opts, "w", &mut ()).unwrap();
            let reads = src.reads.lock().unwrap().clone();
            // The most bytes of one piece of each tensor, and its band.
            let piece = |tensor: &str| match tensor {
                "down_proj" => (buffer - buffer % 2048, 2048),
                "gate_proj" => (buffer - buffer % 1024, 1024),
                _ => (buffer & !1, 2),
            };
            let mut pieces = 0;
            for (tensor, off, n) in &reads {
                let (most, band) = piece(tensor);
                let (chunk_off, end) = (off % 4096, off % 4096 + *n as u64);
                assert!(chunk_off % band as u64 == 0 && *n % band == 0, "{reads:?}");
                assert!(
                    *n == most.min(4096) || (*n < most && end == 4096),
                    "{reads:?}"
                );
            }
            for tensor in ["down_proj", "gate_proj", "up_proj"] {
                pieces += 2 * 4096u64.div_ceil(piece(tensor).0.min(4096) as u64);
            }
            assert_eq!(stats.pieces, pieces);
            with(|s| {
                for (m, c) in mem.iter().zip(&chunks) {
                    let got: Vec<u16> = s.mem[&m.addr()]
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    let first = c.offset / 2;
                    for n in 0..32u64 {
                        for k in 0..64u64 {
                            let at = c.tile.map_or(n * 64 + k, |o| o.offset(n, k));
                            assert_eq!(
                                u64::from(got[at as usize]),
                                first + n * 64 + k,
                                "{} layer {} element ({n}, {k})",
                                c.tensor,
                                c.chunk
                            );
                        }
                    }
                    // Back in row order, the source's bytes.
                    let mut back = s.mem[&m.addr()].clone();
                    c.from_device_order(&mut back).unwrap();
                    let want: Vec<u8> = (first..first + 2048)
                        .flat_map(|e| (e as u16).to_le_bytes())
                        .collect();
                    assert!(back == want, "{} layer {}", c.tensor, c.chunk);
                }
            });
            drop(mem);
        }
    }

    #[test]
    fn a_buffer_smaller_than_a_band_is_refused_naming_the_tensor_and_band() {
        super::mock::reset();
        let mut chunks = layers("up_proj", None);
        chunks.extend(layers("gate_proj", Some(8)));
        chunks.extend(layers("down_proj", Some(16)));
        let src = Iota::new();
        // 2,047 bytes round down to 2,046: two 1,024-byte bands of 8 rows,
        // short of a 2,048-byte band of 16; 1,023 short of either.
        for (buffer, tensor, band) in [
            (2047, "down_proj", "band of 2048 bytes (16 rows)"),
            (1023, "gate_proj", "band of 1024 bytes (8 rows)"),
        ] {
            let opts = UploadOptions {
                buffers: 3,
                buffer_bytes: buffer,
            };
            let e = upload_weights(&Mock, &src, &chunks, &opts, "w", &mut ()).unwrap_err();
            assert!(
                matches!(&e, Error::Weights { tensor: t, reason }
                    if t == tensor && reason.contains(band)),
                "{e}"
            );
            // Refused before anything was allocated or read.
            assert!(src.reads.lock().unwrap().is_empty());
            with(|s| assert!(s.pinned_allocs == 0 && s.mem.is_empty(), "{s:?}"));
        }
        // One band's worth is enough: 2 pieces a layer of each tensor.
        let opts = UploadOptions {
            buffers: 1,
            buffer_bytes: 2048,
        };
        let (mem, stats) = upload_weights(&Mock, &src, &chunks, &opts, "w", &mut ()).unwrap();
        assert_eq!(stats.pieces, 12);
        drop(mem);
    }

    /// A tiled chunk that does not start or end on a band is refused (a
    /// piece of it would split one), naming the tensor.
    #[test]
    fn a_tiled_chunk_off_the_bands_is_refused() {
        // 1,024 bytes are half a 16-row band and 512 half an 8-row one.
        for (tensor, rows, off) in [("down_proj", 16, 1024), ("gate_proj", 8, 512)] {
            let mut chunks = layers(tensor, Some(rows));
            chunks[1].offset = 4096 + off;
            chunks[1].bytes = 4096 - off;
            let e = upload_weights(
                &Mock,
                &Iota::new(),
                &chunks,
                &UploadOptions::default(),
                "w",
                &mut (),
            )
            .unwrap_err();
            let e = e.to_string();
            assert!(e.starts_with(&format!("weight tensor {tensor}:")), "{e}");
            assert!(e.contains("not whole tile-order bands"), "{e}");
        }
        let mut odd = layers("down_proj", Some(16));
        odd[0].tile = Some(TileOrder { k: 48, rows: 16 });
        let e = odd[0].piece_bytes(1 << 20).unwrap_err();
        assert!(e.to_string().contains("48 elements"), "{e}");
        with(|s| assert!(s.mem.is_empty() && s.pinned.is_empty()));
    }

    /// The upload of a split model with the MLP tiled by the backend's
    /// rule (down in 16-row bands, gate and up in 8-row ones) gives the
    /// device bytes `read_chunk` gives (the host form of the upload), and
    /// those differ from the row-major bytes.
    #[test]
    fn a_split_model_with_a_tiled_mlp_matches_read_chunk() {
        super::mock::reset();
        let (c, mut chunks) = split_model(false);
        let specs = qmk_model::stacked_specs(&c).unwrap();
        let plan =
            qmk_layout::plan_model(&specs, &OffsetModel::new(17, OffsetUnit::Bytes)).unwrap();
        let build = KernelBuild::with_plan(&c, plan).unwrap();
        let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
        let down = TileOrder::new(i, qmk_kernels::TcPhases::DOWN_BAND).unwrap();
        let gate_up = TileOrder::new(h, qmk_kernels::TcPhases::GATE_UP_BAND).unwrap();
        for (tensor, rows, order) in [
            ("down_proj", h, down),
            ("gate_proj", i, gate_up),
            ("up_proj", i, gate_up),
        ] {
            crate::staging::tile_chunks(&build, &mut chunks, tensor, rows, order).unwrap();
            let n = chunks.iter().filter(|x| x.tensor == tensor).count();
            assert!(n > 1, "{tensor}: {n} chunks");
        }
        let src = SyntheticSource::new(&c, 5).unwrap();
        let band = (down.band_bytes().unwrap()).max(gate_up.band_bytes().unwrap()) as usize;
        let opts = UploadOptions {
            buffers: 3,
            buffer_bytes: band * 2 + 100,
        };
        let (mem, _) = upload_weights(&Mock, &src, &chunks, &opts, "w", &mut ()).unwrap();
        with(|s| {
            for (m, x) in mem.iter().zip(&chunks) {
                let all = |tile| {
                    let mut v = Vec::new();
                    let y = PlannedChunk { tile, ..x.clone() };
                    crate::staging::read_chunk(&src, &y, band * 3, &mut |_, b| {
                        v.extend_from_slice(b);
                        Ok(())
                    })
                    .unwrap();
                    v
                };
                let got = &s.mem[&m.addr()];
                assert!(*got == all(x.tile), "{} chunk {}", x.tensor, x.chunk);
                let row_major = all(None);
                assert_eq!(x.tile.is_some(), *got != row_major, "{}", x.tensor);
            }
        });
    }
}
