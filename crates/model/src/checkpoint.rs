//! Reading (and, for tests and tools, writing) safetensors checkpoints.
//!
//! A checkpoint directory holds `config.json` and either one
//! `model.safetensors` or shards listed by `model.safetensors.index.json`
//! (`{"weight_map": {tensor: shard file}}`). Files are memory-mapped; the
//! header of each is parsed and validated here (not by the safetensors
//! crate) so every defect is reported with the file and the tensor.
//!
//! A safetensors file is: 8 bytes little-endian `N`, `N` bytes of JSON
//! `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?}`,
//! then the data section; offsets are relative to the data section.
//! [`SafetensorsFile::open`] checks, in order:
//! 1. the file holds the 8-byte length, `N <= MAX_HEADER_BYTES`, and
//!    `8 + N <= file length`;
//! 2. the header is a JSON object and every entry has a dtype, shape and
//!    two offsets;
//! 3. each dtype is a safetensors dtype (only BF16, F16 and F32 can later be
//!    staged; others are rejected when such a tensor is read);
//! 4. `begin <= end <= data length`;
//! 5. `end - begin == product(shape) x dtype size` (checked arithmetic);
//! 6. no two non-empty tensors' byte ranges overlap.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use qmk_layout::DType;
use rayon::prelude::*;
use serde::Deserialize;

use crate::config::Config;
use crate::error::{checked_product, to_usize, ModelError};
use crate::inventory::{checkpoint_inventory, expected_tensors, ExpectedTensor, WeightKind};
use crate::weights::Weights;

/// Largest header accepted; real headers are well under 1 MB, and a larger
/// value means a corrupt or hostile file.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Sharded checkpoint index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Elements converted per parallel task when staging (a few hundred KB).
const STAGE_BLOCK: usize = 1 << 16;

/// Bits per element of every safetensors dtype; `None` for strings that
/// are not safetensors dtypes.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "U16" | "I16" | "F16" | "BF16" => 16,
        "U32" | "I32" | "F32" => 32,
        "U64" | "I64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// One tensor's header entry, validated against its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Name as in the file, e.g. `model.norm.weight`.
    pub name: String,
    /// dtype as written in the file, e.g. `BF16`.
    pub dtype: String,
    /// Row-major shape.
    pub shape: Vec<u64>,
    /// `[begin, end)` byte range relative to the data section.
    pub data_offsets: (u64, u64),
}

impl TensorEntry {
    /// The engine dtype this tensor can be staged from (BF16, F16 or F32).
    pub fn staged_dtype(&self) -> Option<DType> {
        match self.dtype.as_str() {
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "F32" => Some(DType::F32),
            _ => None,
        }
    }

    /// Element count (checked when the file was opened).
    pub fn elems(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The raw form of a header entry, before validation.
#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// A validated safetensors header: where the data starts and every tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Byte offset of the data section in the file (`8 + N`).
    pub data_start: u64,
    /// Length of the data section.
    pub data_len: u64,
    /// Every tensor by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// The error for a file too short to hold the 8-byte header length.
fn too_short(path: &Path, len: u64) -> ModelError {
    ModelError::Header {
        path: path.to_path_buf(),
        reason: format!("file is {len} bytes, too short for the 8-byte header length (truncated)"),
    }
}

/// Parses and validates the header of the safetensors file `bytes`
/// (conditions 1-6 of the module docs); `path` labels errors. Pure, so it
/// can be fuzzed.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header, ModelError> {
    let header_err = |reason: String| ModelError::Header {
        path: path.to_path_buf(),
        reason,
    };
    let file_len = bytes.len() as u64;
    // 1. length prefix and bounds
    let Some(prefix) = bytes.get(..8) else {
        return Err(too_short(path, file_len));
    };
    let n = u64::from_le_bytes(prefix.try_into().expect("slice of 8"));
    if n > MAX_HEADER_BYTES {
        return Err(header_err(format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    let data_start = n + 8; // n <= 1e8: cannot overflow
    if data_start > file_len {
        return Err(header_err(format!(
            "header length {n} runs past the end of the {file_len}-byte file (truncated)"
        )));
    }
    // 2. JSON object of entries
    let json = &bytes[8..to_usize("safetensors header", data_start)?];
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| header_err(format!("not a JSON object: {e}")))?;
    let data_len = file_len - data_start;
    let mut tensors = BTreeMap::new();
    for (name, value) in map {
        if name == "__metadata__" {
            continue; // free-form string map; nothing the engine needs
        }
        let bad = |reason: String| ModelError::BadTensorEntry {
            path: path.to_path_buf(),
            tensor: name.clone(),
            reason,
        };
        let raw: RawEntry = serde_json::from_value(value)
            .map_err(|e| bad(format!("malformed header entry: {e}")))?;
        // 3. dtype
        let Some(bits) = dtype_bits(&raw.dtype) else {
            return Err(ModelError::UnsupportedDtype {
                path: path.to_path_buf(),
                tensor: name,
                dtype: raw.dtype,
            });
        };
        // 4. offsets inside the data section
        let [begin, end] = raw.data_offsets;
        if begin > end {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}) end before they begin"
            )));
        }
        if end > data_len {
            return Err(ModelError::OutOfFile {
                path: path.to_path_buf(),
                tensor: name,
                begin,
                end,
                data_len,
            });
        }
        // 5. span == shape x dtype
        let what = format!("{}: tensor `{name}`", path.display());
        let numel = checked_product(&what, &raw.shape)?;
        let bits_total = numel.checked_mul(bits).ok_or_else(|| {
            ModelError::overflow(&what, format!("{numel} elements x {bits} bits"))
        })?;
        if bits_total % 8 != 0 {
            return Err(bad(format!(
                "shape {:?} x {} is not a whole number of bytes",
                raw.shape, raw.dtype
            )));
        }
        let expected = bits_total / 8;
        if end - begin != expected {
            return Err(ModelError::SizeMismatch {
                path: path.to_path_buf(),
                tensor: name,
                shape: raw.shape,
                dtype: raw.dtype,
                span: end - begin,
                expected,
            });
        }
        tensors.insert(
            name.clone(),
            TensorEntry {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
                data_offsets: (begin, end),
            },
        );
    }
    // 6. no overlaps: sweep by start, remembering the furthest end so far
    let mut by_start: Vec<&TensorEntry> = tensors
        .values()
        .filter(|t| t.data_offsets.0 < t.data_offsets.1)
        .collect();
    by_start.sort_by_key(|t| t.data_offsets);
    let mut furthest: Option<&TensorEntry> = None;
    for t in by_start {
        if let Some(prev) = furthest {
            if t.data_offsets.0 < prev.data_offsets.1 {
                return Err(ModelError::Overlap {
                    path: path.to_path_buf(),
                    first: prev.name.clone(),
                    first_begin: prev.data_offsets.0,
                    first_end: prev.data_offsets.1,
                    second: t.name.clone(),
                    second_begin: t.data_offsets.0,
                    second_end: t.data_offsets.1,
                });
            }
        }
        if furthest.is_none_or(|p| t.data_offsets.1 > p.data_offsets.1) {
            furthest = Some(t);
        }
    }
    Ok(Header {
        data_start,
        data_len,
        tensors,
    })
}

/// One memory-mapped, validated safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// Read with `pread` by the streamed path (no file page is mapped).
    file: File,
    mmap: Mmap,
    header: Header,
}

impl SafetensorsFile {
    /// Maps and validates `path` (see the module docs for the checks).
    pub fn open(path: &Path) -> Result<SafetensorsFile, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        if len < 8 {
            // Checked before mapping: mapping an empty file fails on some
            // platforms with a less useful message.
            return Err(too_short(path, len));
        }
        // SAFETY: the map is read-only and private to this process. As with
        // every mmap-based loader, another process truncating or rewriting
        // the file while it is mapped is undefined behaviour; checkpoints
        // are treated as immutable while loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let header = parse_header(path, &mmap)?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file,
            mmap,
            header,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The entry named `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.header.tensors.get(name)
    }

    /// The raw bytes of `entry` (an entry of this file).
    pub fn data(&self, entry: &TensorEntry) -> Result<&[u8], ModelError> {
        let (b, e) = entry.data_offsets;
        let range = (|| {
            let start = to_usize("offset", self.header.data_start.checked_add(b)?).ok()?;
            let end = to_usize("offset", self.header.data_start.checked_add(e)?).ok()?;
            self.mmap.get(start..end)
        })();
        // Validated at open; a miss means `entry` came from another file.
        range.ok_or_else(|| ModelError::OutOfFile {
            path: self.path.clone(),
            tensor: entry.name.clone(),
            begin: b,
            end: e,
            data_len: self.header.data_len,
        })
    }

    /// Converts `entry` to bf16 into `dst` (exactly its element count),
    /// in parallel. BF16 is copied, F16 and F32 are rounded to nearest even.
    pub fn read_bf16_into(&self, entry: &TensorEntry, dst: &mut [bf16]) -> Result<(), ModelError> {
        let Some(dtype) = entry.staged_dtype() else {
            return Err(ModelError::UnsupportedDtype {
                path: self.path.clone(),
                tensor: entry.name.clone(),
                dtype: entry.dtype.clone(),
            });
        };
        if dst.len() as u64 != entry.elems() {
            return Err(ModelError::ShapeMismatch {
                path: self.path.clone(),
                tensor: entry.name.clone(),
                expected: vec![dst.len() as u64],
                found: entry.shape.clone(),
            });
        }
        let src = self.data(entry)?;
        let es = to_usize("dtype size", dtype.size_bytes())?;
        dst.par_chunks_mut(STAGE_BLOCK)
            .zip(src.par_chunks(STAGE_BLOCK * es))
            .for_each(|(d, s)| stage_block(dtype, s, d));
        Ok(())
    }
}

/// Bytes one `pread` of the streamed path asks for: large enough for the
/// disk's full rate, small enough that parallel reads spread over threads.
const PREAD_BYTES: usize = 8 << 20;

impl SafetensorsFile {
    /// Converts elements `first..first + dst.len()` of `entry` (an entry of
    /// this file) to bf16 into `dst`, reading the file with `pread` in
    /// parallel blocks: no page of the file is mapped, so nothing of it
    /// enters the process's resident set, and the only extra memory is one
    /// block of source bytes per thread for F16 and F32.
    pub fn read_bf16_range(
        &self,
        entry: &TensorEntry,
        first: u64,
        dst: &mut [bf16],
    ) -> Result<(), ModelError> {
        let Some(dtype) = entry.staged_dtype() else {
            return Err(ModelError::UnsupportedDtype {
                path: self.path.clone(),
                tensor: entry.name.clone(),
                dtype: entry.dtype.clone(),
            });
        };
        let es = dtype.size_bytes();
        let inside = first
            .checked_add(dst.len() as u64)
            .is_some_and(|e| e <= entry.elems());
        let start = self
            .header
            .data_start
            .checked_add(entry.data_offsets.0)
            .and_then(|b| b.checked_add(first.checked_mul(es)?));
        let (true, Some(start)) = (inside, start) else {
            return Err(ModelError::OutOfFile {
                path: self.path.clone(),
                tensor: entry.name.clone(),
                begin: entry.data_offsets.0,
                end: entry.data_offsets.1,
                data_len: self.header.data_len,
            });
        };
        let es = to_usize("dtype size", es)?;
        let per_block = PREAD_BYTES / es;
        dst.par_chunks_mut(per_block)
            .enumerate()
            .try_for_each(|(i, d)| {
                let at = start + (i * per_block * es) as u64;
                let io = |e| ModelError::io(&self.path, e);
                if dtype == DType::BF16 && cfg!(target_endian = "little") {
                    // Little-endian bf16 bits are the host's bf16: straight in.
                    return read_at(&self.file, bytemuck::cast_slice_mut(d), at).map_err(io);
                }
                let mut src = vec![0u8; d.len() * es];
                read_at(&self.file, &mut src, at).map_err(io)?;
                stage_block(dtype, &src, d);
                Ok(())
            })
    }
}

/// Fills `buf` from `file` at byte `offset` (`pread`, retried until full).
#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

/// Fills `buf` from `file` at byte `offset`.
#[cfg(windows)]
fn read_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        match std::os::windows::fs::FileExt::seek_read(file, buf, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

/// Converts little-endian `src` of `dtype` into bf16 `dst` (same count).
pub(crate) fn stage_block(dtype: DType, src: &[u8], dst: &mut [bf16]) {
    match dtype {
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]]));
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_f32(f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32());
            }
        }
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = bf16::from_f32(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
            }
        }
    }
}

/// `model.safetensors.index.json`.
#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// A parsed, validated `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardIndex {
    /// Tensor name -> shard file name.
    pub weight_map: BTreeMap<String, String>,
    /// Every shard named, in name order, with the first tensor (by name)
    /// assigned to it (the tensor reported if that shard is bad).
    pub shards: Vec<(String, String)>,
}

/// Parses the index `text` read from `index_path` (which labels errors):
/// it must be a JSON object with a `weight_map` of tensor -> shard, and
/// every shard must be a plain file name, so the index cannot reach outside
/// its directory. Pure, so it can be fuzzed.
pub(crate) fn parse_index(index_path: &Path, text: &str) -> Result<ShardIndex, ModelError> {
    let index: Index = serde_json::from_str(text).map_err(|source| ModelError::Json {
        path: index_path.to_path_buf(),
        source,
    })?;
    let mut first_tensor: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, shard) in &index.weight_map {
        first_tensor
            .entry(shard.as_str())
            .or_insert(tensor.as_str());
    }
    let mut shards = Vec::with_capacity(first_tensor.len());
    for (&shard, &tensor) in &first_tensor {
        // Only plain names: an index must not reach outside its directory.
        let plain = Path::new(shard)
            .file_name()
            .is_some_and(|f| f == std::ffi::OsStr::new(shard))
            && shard != "."
            && shard != "..";
        if !plain {
            return Err(ModelError::BadShard {
                path: index_path.to_path_buf(),
                shard: shard.to_string(),
                tensor: tensor.to_string(),
                reason: "is not a plain file name inside the model directory",
            });
        }
        shards.push((shard.to_string(), tensor.to_string()));
    }
    Ok(ShardIndex {
        weight_map: index.weight_map,
        shards,
    })
}

/// A checkpoint directory: one file or a set of shards, every header
/// validated, every tensor located.
#[derive(Debug)]
pub struct Checkpoint {
    /// `model.safetensors` or `model.safetensors.index.json`: the file named
    /// in errors about tensors that are absent.
    source: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    locations: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors` if present, else the shards named by
    /// `dir/model.safetensors.index.json` (the order transformers uses).
    /// Every shard in the index must exist and hold the tensors the index
    /// assigns to it.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            let file = SafetensorsFile::open(&single)?;
            let locations = file.header.tensors.keys().map(|k| (k.clone(), 0)).collect();
            return Ok(Checkpoint {
                source: single,
                files: vec![file],
                locations,
            });
        }
        let index_path = dir.join(INDEX_FILE);
        if !index_path.is_file() {
            return Err(ModelError::NoCheckpoint {
                path: dir.to_path_buf(),
            });
        }
        let text = crate::read_small_file(&index_path, crate::SMALL_FILE_CAP)?;
        let index = parse_index(&index_path, &text)?;
        let mut shard_ids: BTreeMap<&str, usize> = BTreeMap::new();
        let mut files = Vec::new();
        for (shard, tensor) in &index.shards {
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(ModelError::BadShard {
                    path: index_path.clone(),
                    shard: shard.clone(),
                    tensor: tensor.clone(),
                    reason: "does not exist",
                });
            }
            shard_ids.insert(shard, files.len());
            files.push(SafetensorsFile::open(&path)?);
        }
        let mut locations = HashMap::new();
        for (tensor, shard) in &index.weight_map {
            let id = shard_ids[shard.as_str()];
            if files[id].get(tensor).is_none() {
                return Err(ModelError::MissingTensor {
                    path: files[id].path.clone(),
                    tensor: tensor.clone(),
                });
            }
            locations.insert(tensor.clone(), id);
        }
        Ok(Checkpoint {
            source: index_path,
            files,
            locations,
        })
    }

    /// `model.safetensors` or the index file.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.locations.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// The file holding `name` and its entry.
    pub fn entry(&self, name: &str) -> Option<(&SafetensorsFile, &TensorEntry)> {
        let file = &self.files[*self.locations.get(name)?];
        Some((file, file.get(name)?))
    }

    /// Checks that every tensor `config` needs is present, of the right
    /// shape and of a stageable dtype. Extra tensors are ignored, including
    /// `lm_head.weight` of a tied model.
    pub fn check(&self, config: &Config) -> Result<(), ModelError> {
        check_tensors(config, &self.source, |name| {
            self.entry(name).map(|(f, e)| (f.path(), e))
        })
    }

    /// Converts tensor `name` to bf16 into `dst` (exactly its element count).
    pub fn read_bf16_into(&self, name: &str, dst: &mut [bf16]) -> Result<(), ModelError> {
        let (file, entry) = self.entry(name).ok_or_else(|| ModelError::MissingTensor {
            path: self.source.clone(),
            tensor: name.to_string(),
        })?;
        file.read_bf16_into(entry, dst)
    }

    /// Tensor `name` as a new bf16 vector.
    pub fn read_bf16(&self, name: &str) -> Result<Vec<bf16>, ModelError> {
        let (_, entry) = self.entry(name).ok_or_else(|| ModelError::MissingTensor {
            path: self.source.clone(),
            tensor: name.to_string(),
        })?;
        let mut v = crate::weights::zeroed_bf16(name, to_usize(name, entry.elems())?)?;
        self.read_bf16_into(name, &mut v)?;
        Ok(v)
    }
}

/// The checks of [`Checkpoint::check`] over any tensor lookup (name -> the
/// file holding it and its entry); `source` names the checkpoint in errors
/// about absent tensors. Walks the inventory lazily, so a config claiming
/// 10^15 layers fails on the first missing tensor instead of listing them.
pub(crate) fn check_tensors<'a>(
    config: &Config,
    source: &Path,
    lookup: impl Fn(&str) -> Option<(&'a Path, &'a TensorEntry)>,
) -> Result<(), ModelError> {
    for t in expected_tensors(config)? {
        let Some((file, entry)) = lookup(&t.name) else {
            return Err(if t.kind == WeightKind::LmHead {
                ModelError::MissingLmHead {
                    path: source.to_path_buf(),
                }
            } else {
                ModelError::MissingTensor {
                    path: source.to_path_buf(),
                    tensor: t.name,
                }
            });
        };
        if entry.shape != t.shape {
            return Err(ModelError::ShapeMismatch {
                path: file.to_path_buf(),
                tensor: t.name,
                expected: t.shape,
                found: entry.shape.clone(),
            });
        }
        if entry.staged_dtype().is_none() {
            return Err(ModelError::UnsupportedDtype {
                path: file.to_path_buf(),
                tensor: t.name,
                dtype: entry.dtype.clone(),
            });
        }
    }
    Ok(())
}

/// Loads a Hugging Face Qwen2.5 checkpoint directory: reads and validates
/// `config.json`, opens the safetensors file(s), checks every tensor the
/// config needs (presence, shape, dtype), then stages each to bf16 and
/// stacks the per-layer tensors along axis 0, in parallel. Prints nothing.
pub fn load_weights(dir: &Path) -> Result<Weights, ModelError> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    ckpt.check(&config)?;
    let mut weights = Weights::zeroed(&config)?;
    weights
        .tensors_mut()
        .into_par_iter()
        .try_for_each(|(kind, buf)| {
            // Buffer sizes come from the same inventory, so this is exact.
            let per = (buf.len() / kind.items(&config)).max(1);
            buf.par_chunks_mut(per)
                .enumerate()
                .try_for_each(|(layer, dst)| ckpt.read_bf16_into(&kind.checkpoint_name(layer), dst))
        })?;
    Ok(weights)
}

/// A checkpoint directory opened for streaming: `config.json` read, every
/// tensor the config needs checked (presence, shape, dtype), nothing
/// loaded. [`CheckpointSource::read_stacked`] reads any range of a stacked
/// tensor straight from the files (`pread`, converted to bf16), so an
/// upload holds only its own buffers, whatever the model's size.
#[derive(Debug)]
pub struct CheckpointSource {
    config: Config,
    checkpoint: Checkpoint,
}

impl CheckpointSource {
    /// Opens and checks `dir` as [`load_weights`] does, without reading any
    /// weight.
    pub fn open(dir: &Path) -> Result<CheckpointSource, ModelError> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        checkpoint.check(&config)?;
        Ok(CheckpointSource { config, checkpoint })
    }

    /// The model.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The checkpoint's files.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Fills `dst` with elements `first..first + dst.len()` of the stacked
    /// tensor `kind` (layer-major, as [`Weights`] holds it), reading each
    /// layer's checkpoint tensor that the range touches.
    pub fn read_stacked(
        &self,
        kind: WeightKind,
        first: u64,
        dst: &mut [bf16],
    ) -> Result<(), ModelError> {
        crate::synthetic::check_range(&self.config, kind, first, dst.len())?;
        let per = kind.item_elems(&self.config)?;
        let (mut at, mut rest) = (first, dst);
        while !rest.is_empty() {
            let layer = at / per;
            let inner = at % per;
            let n = to_usize(kind.name(), (per - inner).min(rest.len() as u64))?;
            let (now, later) = rest.split_at_mut(n);
            let name = kind.checkpoint_name(to_usize(kind.name(), layer)?);
            let (file, entry) =
                self.checkpoint
                    .entry(&name)
                    .ok_or_else(|| ModelError::MissingTensor {
                        path: self.checkpoint.source.clone(),
                        tensor: name.clone(),
                    })?;
            file.read_bf16_range(entry, inner, now)?;
            at += n as u64;
            rest = later;
        }
        Ok(())
    }
}

// ---- writing ----------------------------------------------------------------

/// One tensor to write: safetensors dtype string (any, even invalid, so tests
/// can build bad files), shape and raw little-endian bytes.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// Tensor name in the header.
    pub name: &'a str,
    /// Safetensors dtype string, written as given.
    pub dtype: &'a str,
    /// Shape in the header.
    pub shape: &'a [u64],
    /// The tensor's bytes.
    pub data: &'a [u8],
}

/// The header JSON for `tensors` laid out back to back in the given order.
fn header_json(tensors: &[RawTensor<'_>]) -> String {
    header_of(
        tensors
            .iter()
            .map(|t| (t.name, t.dtype, t.shape, t.data.len() as u64)),
    )
}

/// The header JSON for tensors `(name, dtype, shape, bytes)` laid out back
/// to back in the given order.
fn header_of<'a>(tensors: impl Iterator<Item = (&'a str, &'a str, &'a [u64], u64)>) -> String {
    let mut map = serde_json::Map::new();
    let mut at = 0u64;
    for (name, dtype, shape, bytes) in tensors {
        let end = at + bytes;
        map.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    serde_json::Value::Object(map).to_string()
}

/// A complete safetensors file with `header` (any text, so tests can corrupt
/// it) and `data` appended; the header is space-padded to 8 bytes as the
/// reference writer does.
pub fn safetensors_from_parts(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + h.len() + data.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

/// Writes `tensors` back to back to a safetensors file at `path`.
pub fn write_safetensors(path: &Path, tensors: &[RawTensor<'_>]) -> Result<(), ModelError> {
    let data: Vec<u8> = tensors
        .iter()
        .flat_map(|t| t.data.iter().copied())
        .collect();
    let bytes = safetensors_from_parts(&header_json(tensors), &data);
    std::fs::write(path, bytes).map_err(|e| ModelError::io(path, e))
}

/// One checkpoint tensor ready to write: (name, shape, little-endian bytes).
type Encoded = (String, Vec<u64>, Vec<u8>);

/// Encodes bf16 values as little-endian `dtype` bytes.
fn encode(values: &[bf16], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(v.to_f32()).to_bits().to_le_bytes())
            .collect(),
        DType::F32 => values
            .iter()
            .flat_map(|v| v.to_f32().to_le_bytes())
            .collect(),
    }
}

/// Writes `weights` as a Hugging Face checkpoint directory: `config.json`
/// plus `model.safetensors`, or, with `max_shard_bytes`, shards of at most
/// that many data bytes (at least one tensor each) and an index. Tensors are
/// unstacked to their per-layer checkpoint names and stored as `dtype`.
/// Meant for tests and small models: each file is built in memory.
pub fn save_checkpoint(
    dir: &Path,
    weights: &Weights,
    dtype: DType,
    max_shard_bytes: Option<u64>,
) -> Result<(), ModelError> {
    weights.check_sizes()?;
    let config = &weights.config;
    let cfg_path = dir.join("config.json");
    let cfg_text = serde_json::to_string_pretty(config).map_err(|source| ModelError::Json {
        path: cfg_path.clone(),
        source,
    })?;
    std::fs::write(&cfg_path, cfg_text).map_err(|e| ModelError::io(&cfg_path, e))?;

    // (name, shape, bytes) per checkpoint tensor, in inventory order.
    let tensors: Vec<Encoded> = checkpoint_inventory(config)?
        .into_iter()
        .map(|t| {
            let slice =
                weights
                    .layer(t.kind, t.layer)
                    .ok_or_else(|| ModelError::MissingTensor {
                        path: "(in memory)".into(),
                        tensor: t.name.clone(),
                    })?;
            Ok((t.name, t.shape, encode(slice, dtype)))
        })
        .collect::<Result<_, ModelError>>()?;
    let dtype_name = dtype.name().to_ascii_uppercase();
    fn raw<'a>(group: &'a [Encoded], dtype: &'a str) -> Vec<RawTensor<'a>> {
        group
            .iter()
            .map(|(name, shape, data)| RawTensor {
                name,
                dtype,
                shape,
                data,
            })
            .collect()
    }
    let Some(limit) = max_shard_bytes else {
        return write_safetensors(&dir.join(SINGLE_FILE), &raw(&tensors, &dtype_name));
    };
    // Greedy grouping in order: a new shard when the next tensor would pass
    // the limit.
    let mut groups: Vec<&[Encoded]> = Vec::new();
    let (mut start, mut size) = (0usize, 0u64);
    for (i, t) in tensors.iter().enumerate() {
        let b = t.2.len() as u64;
        if i > start && size.saturating_add(b) > limit {
            groups.push(&tensors[start..i]);
            (start, size) = (i, 0);
        }
        size = size.saturating_add(b);
    }
    groups.push(&tensors[start..]);
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (i, group) in groups.iter().enumerate() {
        let shard = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        for (name, _, data) in group.iter() {
            weight_map.insert(name.clone(), shard.clone());
            total += data.len() as u64;
        }
        write_safetensors(&dir.join(&shard), &raw(group, &dtype_name))?;
    }
    let index_path = dir.join(INDEX_FILE);
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let file = File::create(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
    let mut w = BufWriter::new(file);
    serde_json::to_writer_pretty(&mut w, &index).map_err(|source| ModelError::Json {
        path: index_path.clone(),
        source,
    })?;
    w.flush().map_err(|e| ModelError::io(&index_path, e))
}

/// Elements generated and written per block by
/// [`write_synthetic_checkpoint`] (16 MiB of bf16).
const WRITE_BLOCK_ELEMS: usize = 8 << 20;

/// Writes the synthetic weights of `source` as a bf16 Hugging Face
/// checkpoint directory (`config.json`, then `model.safetensors` or, with
/// `max_shard_bytes`, shards of at most that many data bytes and an index),
/// generating and writing one block at a time: the memory it needs is one
/// block, whatever the model's size, so a 72B-shaped checkpoint can be
/// written on a machine with little RAM. Calls `progress(bytes)` after each
/// block; returns the data bytes written. Reading it back gives exactly
/// [`crate::synthetic_weights`]`(config, seed)`.
pub fn write_synthetic_checkpoint(
    dir: &Path,
    source: &crate::SyntheticSource,
    max_shard_bytes: Option<u64>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, ModelError> {
    let config = source.config();
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let cfg_path = dir.join("config.json");
    let cfg_text = serde_json::to_string_pretty(config).map_err(|source| ModelError::Json {
        path: cfg_path.clone(),
        source,
    })?;
    std::fs::write(&cfg_path, cfg_text).map_err(|e| ModelError::io(&cfg_path, e))?;
    // (tensor, bf16 bytes) in inventory order.
    let tensors: Vec<(ExpectedTensor, u64)> = checkpoint_inventory(config)?
        .into_iter()
        .map(|t| {
            let n = t.kind.item_elems(config)?;
            let bytes = n
                .checked_mul(2)
                .ok_or_else(|| ModelError::overflow(t.name.clone(), format!("{n} x 2 bytes")))?;
            Ok((t, bytes))
        })
        .collect::<Result<_, ModelError>>()?;
    // Greedy grouping in order, as save_checkpoint does.
    let mut groups: Vec<&[(ExpectedTensor, u64)]> = Vec::new();
    let (mut start, mut size) = (0usize, 0u64);
    for (i, (_, b)) in tensors.iter().enumerate() {
        if max_shard_bytes.is_some_and(|limit| i > start && size.saturating_add(*b) > limit) {
            groups.push(&tensors[start..i]);
            (start, size) = (i, 0);
        }
        size = size.saturating_add(*b);
    }
    groups.push(&tensors[start..]);
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let mut block = vec![bf16::ZERO; WRITE_BLOCK_ELEMS];
    for (i, group) in groups.iter().enumerate() {
        let shard = if max_shard_bytes.is_some() {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        } else {
            SINGLE_FILE.to_string()
        };
        let path = dir.join(&shard);
        let io = |e| ModelError::io(&path, e);
        let header = header_of(
            group
                .iter()
                .map(|(t, b)| (t.name.as_str(), "BF16", t.shape.as_slice(), *b)),
        );
        let mut h = header.into_bytes();
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&path).map_err(io)?);
        out.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
        out.write_all(&h).map_err(io)?;
        let mut bytes = Vec::with_capacity(WRITE_BLOCK_ELEMS * 2);
        for (t, b) in group.iter() {
            weight_map.insert(t.name.clone(), shard.clone());
            let per = t.kind.item_elems(config)?;
            let mut at = per * t.layer as u64;
            let end = at + per;
            while at < end {
                let len = to_usize(&t.name, (end - at).min(WRITE_BLOCK_ELEMS as u64))?;
                source.fill(t.kind, at, &mut block[..len])?;
                bytes.clear();
                bytes.extend(block[..len].iter().flat_map(|v| v.to_bits().to_le_bytes()));
                out.write_all(&bytes).map_err(io)?;
                progress(bytes.len() as u64);
                at += len as u64;
            }
            total += b;
        }
        out.flush().map_err(io)?;
    }
    if max_shard_bytes.is_some() {
        let index_path = dir.join(INDEX_FILE);
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let file = File::create(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
        let mut w = BufWriter::new(file);
        serde_json::to_writer_pretty(&mut w, &index).map_err(|source| ModelError::Json {
            path: index_path.clone(),
            source,
        })?;
        w.flush().map_err(|e| ModelError::io(&index_path, e))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::synthetic_weights;

    /// A valid config small enough to write in a test.
    fn tiny(tied: bool) -> Config {
        let mut c = Config::preset("0.5b").unwrap();
        c.hidden_size = 16;
        c.intermediate_size = 24;
        c.num_hidden_layers = 2;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = None; // implied 16 / 4 = 4
        c.vocab_size = 40;
        c.tie_word_embeddings = tied;
        c
    }

    /// A valid checkpoint dir for `tiny(tied)`, optionally sharded.
    fn good_dir(tied: bool, dtype: DType, shard: Option<u64>) -> (tempfile::TempDir, Weights) {
        let dir = tempfile::tempdir().unwrap();
        let w = synthetic_weights(&tiny(tied), 3);
        save_checkpoint(dir.path(), &w, dtype, shard).unwrap();
        (dir, w)
    }

    /// The checkpoint tensors of `w` as (name, shape, bf16 bytes), so tests
    /// can drop, reshape or retype one before writing.
    fn parts(w: &Weights) -> Vec<Encoded> {
        checkpoint_inventory(&w.config)
            .unwrap()
            .into_iter()
            .map(|t| {
                let data = encode(w.layer(t.kind, t.layer).unwrap(), DType::BF16);
                (t.name, t.shape, data)
            })
            .collect()
    }

    /// Writes config.json and a model.safetensors of `tensors` (all dtype
    /// `dtype` unless given per tensor) to a new dir.
    fn dir_with(
        config: &Config,
        tensors: &[Encoded],
        dtypes: &[(&str, &str)],
    ) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_string(config).unwrap(),
        )
        .unwrap();
        let raw: Vec<RawTensor<'_>> = tensors
            .iter()
            .map(|(name, shape, data)| RawTensor {
                name,
                dtype: dtypes
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or("BF16", |(_, d)| d),
                shape,
                data,
            })
            .collect();
        write_safetensors(&dir.path().join(SINGLE_FILE), &raw).unwrap();
        dir
    }

    /// A single file holding `bytes`, opened.
    fn open_bytes(bytes: &[u8]) -> (tempfile::TempDir, Result<SafetensorsFile, ModelError>) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        std::fs::write(&p, bytes).unwrap();
        let r = SafetensorsFile::open(&p);
        (dir, r)
    }

    /// The error of loading `dir` (without printing whole weights if it
    /// unexpectedly loads).
    fn load_err(dir: &Path) -> ModelError {
        match load_weights(dir) {
            Ok(_) => panic!("{} loaded, expected an error", dir.display()),
            Err(e) => e,
        }
    }

    /// Shard file names of a sharded checkpoint, sorted.
    fn shards(dir: &Path) -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        let mut s: Vec<String> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        s.sort();
        s.dedup();
        s
    }

    fn assert_names(e: &ModelError, parts: &[&str]) {
        let msg = e.to_string();
        for p in parts {
            assert!(msg.contains(p), "`{msg}` should name `{p}`");
        }
    }

    #[test]
    fn round_trip_every_dtype_and_sharding() {
        for tied in [true, false] {
            for (dtype, shard) in [
                (DType::BF16, None),
                (DType::F32, None),
                (DType::F16, None),
                (DType::BF16, Some(300)),
            ] {
                let (dir, w) = good_dir(tied, dtype, shard);
                let loaded = load_weights(dir.path()).unwrap();
                assert_eq!(loaded.config, w.config);
                for kind in WeightKind::ALL {
                    let (a, b) = (w.get(kind), loaded.get(kind));
                    let expect: Option<Vec<bf16>> = a.map(|a| match dtype {
                        // bf16 -> f16 may round (subnormal f16 range).
                        DType::F16 => a
                            .iter()
                            .map(|x| bf16::from_f32(f16::from_f32(x.to_f32()).to_f32()))
                            .collect(),
                        _ => a.to_vec(),
                    });
                    assert_eq!(expect.as_deref(), b, "{kind:?} {dtype} {shard:?}");
                }
                if shard.is_some() {
                    assert!(!dir.path().join(SINGLE_FILE).exists());
                    assert!(shards(dir.path()).len() > 2);
                }
            }
        }
    }

    #[test]
    fn f32_staging_rounds_to_nearest_even() {
        let vals: [f32; 4] = [1.0, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5e-3];
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bytes = safetensors_from_parts(
            &header_json(&[RawTensor {
                name: "t",
                dtype: "F32",
                shape: &[4],
                data: &data,
            }]),
            &data,
        );
        let (_d, f) = open_bytes(&bytes);
        let f = f.unwrap();
        let mut out = vec![bf16::ZERO; 4];
        f.read_bf16_into(f.get("t").unwrap(), &mut out).unwrap();
        let want: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(out, want);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins.
        assert_eq!(out[1], bf16::ONE);
        assert_eq!(out[2].to_f32(), 1.0 + 4.0 / 256.0);
    }

    #[test]
    fn tied_checkpoint_may_carry_lm_head() {
        let w = synthetic_weights(&tiny(true), 1);
        let mut t = parts(&w);
        t.push((
            "lm_head.weight".into(),
            vec![40, 16],
            encode(&w.embed_tokens, DType::BF16),
        ));
        t.push(("model.rotary_emb.inv_freq".into(), vec![2], vec![0; 8]));
        let dir = dir_with(&w.config, &t, &[("model.rotary_emb.inv_freq", "F32")]);
        let loaded = load_weights(dir.path()).unwrap();
        assert!(loaded.lm_head.is_none());
        assert_eq!(loaded.embed_tokens, w.embed_tokens);
    }

    #[test]
    fn truncated_header() {
        let (_d, r) = open_bytes(&[1, 2, 3]);
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Header { .. }));
        assert_names(&e, &["x.safetensors", "truncated"]);
        let (_d, r) = open_bytes(&[]);
        assert!(matches!(r.unwrap_err(), ModelError::Header { .. }));
        // Header length 1000, file holds far less.
        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let (_d, r) = open_bytes(&b);
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Header { .. }));
        assert_names(&e, &["x.safetensors", "1000", "truncated"]);
        // A real file cut in the middle of its header.
        let (dir, _) = good_dir(true, DType::BF16, None);
        let p = dir.path().join(SINGLE_FILE);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..200]).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::Header { .. }), "{e}");
        assert_names(&e, &["model.safetensors"]);
    }

    #[test]
    fn oversized_header() {
        let mut b = (MAX_HEADER_BYTES + 1).to_le_bytes().to_vec();
        b.extend_from_slice(&[b' '; 64]);
        let (_d, r) = open_bytes(&b);
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Header { .. }));
        assert_names(&e, &["x.safetensors", "exceeds"]);
        let mut b = u64::MAX.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let (_d, r) = open_bytes(&b);
        assert!(matches!(r.unwrap_err(), ModelError::Header { .. }));
    }

    #[test]
    fn header_not_json_or_not_entries() {
        for h in ["{not json", "[1, 2]", "\u{0}\u{0}"] {
            let (_d, r) = open_bytes(&safetensors_from_parts(h, &[]));
            let e = r.unwrap_err();
            assert!(matches!(e, ModelError::Header { .. }), "{h}: {e}");
        }
        let h = r#"{"a": {"dtype": "BF16", "shape": [2]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 4]));
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::BadTensorEntry { .. }), "{e}");
        assert_names(&e, &["x.safetensors", "`a`", "data_offsets"]);
        let h = r#"{"a": {"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 4]));
        assert!(matches!(r.unwrap_err(), ModelError::BadTensorEntry { .. }));
        let h = r#"{"__metadata__": {"format": "pt"}, "a": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 0]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 4]));
        assert!(matches!(r.unwrap_err(), ModelError::BadTensorEntry { .. }));
    }

    #[test]
    fn offsets_overlapping() {
        let h = r#"{"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
                    "b": {"dtype": "BF16", "shape": [4], "data_offsets": [6, 14]},
                    "c": {"dtype": "BF16", "shape": [0], "data_offsets": [4, 4]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 16]));
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Overlap { .. }), "{e}");
        assert_names(&e, &["x.safetensors", "`a`", "`b`"]);
        // Containment (b inside a, sorted after it) also counts.
        let h = r#"{"a": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]},
                    "b": {"dtype": "BF16", "shape": [1], "data_offsets": [10, 12]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 16]));
        assert!(matches!(r.unwrap_err(), ModelError::Overlap { .. }));
    }

    #[test]
    fn offsets_out_of_file() {
        let h = r#"{"a": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 12]));
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::OutOfFile {
                    end: 16,
                    data_len: 12,
                    ..
                }
            ),
            "{e}"
        );
        assert_names(&e, &["x.safetensors", "`a`"]);
        // A whole checkpoint whose data was cut off.
        let (dir, _) = good_dir(false, DType::BF16, None);
        let p = dir.path().join(SINGLE_FILE);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 1]).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::OutOfFile { .. }), "{e}");
        assert_names(&e, &["model.safetensors"]);
    }

    #[test]
    fn offsets_not_matching_shape_times_dtype() {
        let h = r#"{"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 16]));
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::SizeMismatch {
                    span: 8,
                    expected: 16,
                    ..
                }
            ),
            "{e}"
        );
        assert_names(&e, &["x.safetensors", "`a`", "F32"]);
    }

    #[test]
    fn size_arithmetic_overflow() {
        let h =
            r#"{"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 8]));
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Overflow { .. }), "{e}");
        assert_names(&e, &["x.safetensors", "`a`"]);
        let h =
            r#"{"a": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 8]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 8]));
        assert!(matches!(r.unwrap_err(), ModelError::Overflow { .. }));
    }

    #[test]
    fn unsupported_dtype() {
        // A safetensors dtype the loader cannot stage, on a needed tensor.
        for dt in ["I8", "F64"] {
            let w = synthetic_weights(&tiny(true), 1);
            let mut t = parts(&w);
            let i = t.iter().position(|x| x.0 == "model.norm.weight").unwrap();
            let bytes_per = if dt == "I8" { 1 } else { 8 };
            t[i].2 = vec![0; 16 * bytes_per];
            let dir = dir_with(&w.config, &t, &[("model.norm.weight", dt)]);
            let e = load_err(dir.path());
            assert!(matches!(e, ModelError::UnsupportedDtype { .. }), "{e}");
            assert_names(&e, &["model.safetensors", "model.norm.weight", dt]);
        }
        // Not a safetensors dtype at all: rejected when the header is read.
        let h = r#"{"a": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}}"#;
        let (_d, r) = open_bytes(&safetensors_from_parts(h, &[0; 2]));
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::UnsupportedDtype { .. }), "{e}");
        assert_names(&e, &["`a`", "Q4_K"]);
    }

    #[test]
    fn tensor_missing() {
        let w = synthetic_weights(&tiny(true), 1);
        let t: Vec<_> = parts(&w)
            .into_iter()
            .filter(|x| x.0 != "model.layers.1.self_attn.v_proj.bias")
            .collect();
        let dir = dir_with(&w.config, &t, &[]);
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::MissingTensor { .. }), "{e}");
        assert_names(
            &e,
            &["model.safetensors", "model.layers.1.self_attn.v_proj.bias"],
        );
    }

    #[test]
    fn tensor_wrong_shape() {
        let w = synthetic_weights(&tiny(true), 1);
        let mut t = parts(&w);
        let i = t
            .iter()
            .position(|x| x.0 == "model.layers.0.mlp.down_proj.weight")
            .unwrap();
        t[i].1 = vec![24, 16]; // transposed: [I, H] instead of [H, I]
        let dir = dir_with(&w.config, &t, &[]);
        let e = load_err(dir.path());
        assert!(
            matches!(&e, ModelError::ShapeMismatch { expected, found, .. }
                if expected == &vec![16, 24] && found == &vec![24, 16]),
            "{e}"
        );
        assert_names(
            &e,
            &["model.safetensors", "model.layers.0.mlp.down_proj.weight"],
        );
    }

    #[test]
    fn lm_head_missing_while_untied() {
        let w = synthetic_weights(&tiny(false), 1);
        let t: Vec<_> = parts(&w)
            .into_iter()
            .filter(|x| x.0 != "lm_head.weight")
            .collect();
        let dir = dir_with(&w.config, &t, &[]);
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::MissingLmHead { .. }), "{e}");
        assert_names(
            &e,
            &["model.safetensors", "lm_head.weight", "tie_word_embeddings"],
        );
    }

    #[test]
    fn sharded_index_naming_missing_shard() {
        let (dir, _) = good_dir(false, DType::BF16, Some(300));
        let names = shards(dir.path());
        assert!(names.len() > 2, "{names:?}");
        std::fs::remove_file(dir.path().join(&names[1])).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::BadShard { .. }), "{e}");
        assert_names(&e, &[INDEX_FILE, &names[1], "does not exist"]);
    }

    #[test]
    fn sharded_index_escaping_dir_or_lying() {
        let (dir, _) = good_dir(false, DType::BF16, Some(300));
        let first = shards(dir.path())[0].clone();
        let p = dir.path().join(INDEX_FILE);
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, text.replacen(&first, &format!("../{first}"), 1)).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::BadShard { .. }), "{e}");
        assert_names(&e, &["plain file name"]);
        // Index assigns a tensor to a shard that does not hold it.
        let (dir, _) = good_dir(false, DType::BF16, Some(300));
        let p = dir.path().join(INDEX_FILE);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["weight_map"]["model.norm.weight"] = first.clone().into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::MissingTensor { .. }), "{e}");
        assert_names(&e, &[&first, "model.norm.weight"]);
        // Malformed index JSON.
        std::fs::write(&p, "{\"weight_map\": 3}").unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::Json { .. }), "{e}");
        assert_names(&e, &[INDEX_FILE]);
    }

    #[test]
    fn config_json_errors_name_file_and_field() {
        let (dir, _) = good_dir(true, DType::BF16, None);
        let p = dir.path().join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["num_key_value_heads"] = 3.into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = load_err(dir.path());
        assert!(
            matches!(
                e,
                ModelError::InvalidConfig {
                    field: "num_key_value_heads",
                    ..
                }
            ),
            "{e}"
        );
        assert_names(&e, &["config.json", "num_key_value_heads"]);
        v["num_key_value_heads"] = 2.into();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        std::fs::write(&p, v.to_string()).unwrap();
        let e = load_err(dir.path());
        assert!(
            matches!(
                e,
                ModelError::InvalidConfig {
                    field: "architectures",
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::Io { .. }), "{e}");
        assert_names(&e, &["config.json"]);
    }

    #[test]
    fn no_checkpoint_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_string(&tiny(true)).unwrap(),
        )
        .unwrap();
        let e = load_err(dir.path());
        assert!(matches!(e, ModelError::NoCheckpoint { .. }), "{e}");
    }

    /// A small valid file: three tensors of different dtypes.
    fn small_file() -> Vec<u8> {
        let (a, b, c) = (vec![1u8; 8], vec![2u8; 12], vec![3u8; 2]);
        let t = [
            RawTensor {
                name: "a",
                dtype: "BF16",
                shape: &[2, 2],
                data: &a,
            },
            RawTensor {
                name: "b",
                dtype: "F32",
                shape: &[3],
                data: &b,
            },
            RawTensor {
                name: "c",
                dtype: "F16",
                shape: &[],
                data: &c,
            },
        ];
        let data: Vec<u8> = [a.clone(), b.clone(), c.clone()].concat();
        safetensors_from_parts(&header_json(&t), &data)
    }

    proptest::proptest! {
        /// Truncated or corrupted files never panic, and whatever parses
        /// keeps every tensor inside the data section, sized exactly.
        #[test]
        fn parse_header_survives_corruption(
            cut in 0usize..400,
            flips in proptest::collection::vec((0usize..400, proptest::prelude::any::<u8>()), 0..4),
        ) {
            let mut b = small_file();
            for (at, byte) in flips {
                let n = b.len();
                b[at % n] = byte;
            }
            b.truncate(cut);
            if let Ok(h) = parse_header(Path::new("fuzz"), &b) {
                for t in h.tensors.values() {
                    let (s, e) = t.data_offsets;
                    proptest::prop_assert!(s <= e && e <= h.data_len);
                    let bits = dtype_bits(&t.dtype).unwrap();
                    proptest::prop_assert_eq!((e - s) * 8, t.elems() * bits);
                }
            }
        }
    }

    #[test]
    fn small_file_parses() {
        let b = small_file();
        let h = parse_header(Path::new("x"), &b).unwrap();
        assert_eq!(h.tensors.len(), 3);
        assert_eq!(h.tensors["c"].shape, Vec::<u64>::new());
        assert_eq!(h.data_start + h.data_len, b.len() as u64);
    }

    /// Every range of every stacked tensor, read by the streamed path from
    /// a checkpoint of each stored dtype (single file and shards), equals
    /// the same range of what `load_weights` stages.
    #[test]
    fn streamed_ranges_equal_the_staged_weights() {
        for (tied, dtype, shard) in [
            (true, DType::BF16, None),
            (false, DType::F16, Some(300)),
            (false, DType::F32, None),
        ] {
            let (dir, _) = good_dir(tied, dtype, shard);
            let staged = load_weights(dir.path()).unwrap();
            let src = CheckpointSource::open(dir.path()).unwrap();
            for kind in WeightKind::ALL {
                let Some(want) = staged.get(kind) else {
                    assert!(src.read_stacked(kind, 0, &mut [bf16::ZERO]).is_err());
                    continue;
                };
                for piece in [1usize, 5, 17, want.len()] {
                    let mut got = vec![bf16::ZERO; want.len()];
                    for (i, d) in got.chunks_mut(piece).enumerate() {
                        src.read_stacked(kind, (i * piece) as u64, d).unwrap();
                    }
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kind:?} {dtype:?} in pieces of {piece}");
                }
                let e = src
                    .read_stacked(kind, want.len() as u64, &mut [bf16::ZERO])
                    .unwrap_err();
                assert!(matches!(e, ModelError::Range { .. }), "{e}");
            }
        }
    }

    /// The streamed writer gives a checkpoint that loads as exactly the
    /// synthetic weights, sharded or not.
    #[test]
    fn synthetic_checkpoint_round_trips() {
        for (tied, shard) in [(true, None), (false, Some(500))] {
            let c = tiny(tied);
            let dir = tempfile::tempdir().unwrap();
            let src = crate::SyntheticSource::new(&c, 9).unwrap();
            let mut reported = 0;
            let total = write_synthetic_checkpoint(dir.path(), &src, shard, &mut |b| reported += b)
                .unwrap();
            assert_eq!(total, reported);
            assert_eq!(dir.path().join(INDEX_FILE).is_file(), shard.is_some());
            let w = load_weights(dir.path()).unwrap();
            let want = synthetic_weights(&c, 9);
            for kind in WeightKind::ALL {
                assert_eq!(w.get(kind), want.get(kind), "{kind:?}");
            }
            assert_eq!(total, crate::weight_bytes(&c).unwrap().total.0);
        }
    }

    /// Loads the real Qwen2.5-Coder-0.5B-Instruct fixture when
    /// `QMK_REAL_QWEN` names its directory (build it with
    /// `scripts/fetch-real-qwen.sh`).
    #[test]
    fn real_checkpoint_loads() {
        let Some(dir) = std::env::var_os("QMK_REAL_QWEN") else {
            eprintln!("skipped: set QMK_REAL_QWEN to the fetch-real-qwen directory to run");
            return;
        };
        let dir = PathBuf::from(dir);
        let w = load_weights(&dir).unwrap();
        let c = &w.config;
        assert_eq!(
            (c.hidden_size, c.num_hidden_layers, c.vocab_size),
            (896, 24, 151936)
        );
        w.check_sizes().unwrap();
        let g = crate::GenerationConfig::from_dir_or_config(&dir, c).unwrap();
        assert_eq!(g.eos_token_id, vec![151645, 151643]);
        // Real weights: finite, not all zero, norms near their trained values.
        assert!(w.q_proj.iter().all(|x| x.is_finite()));
        assert!(w.gate_proj.iter().any(|x| x.to_f32() != 0.0));
        let mean_norm = w.norm.iter().map(|x| x.to_f32().abs()).sum::<f32>() / w.norm.len() as f32;
        assert!(mean_norm > 0.1 && mean_norm < 100.0, "{mean_norm}");
        // Stacking: layer 5 of k_bias equals the checkpoint's tensor.
        let ckpt = Checkpoint::open(&dir).unwrap();
        let k5 = ckpt
            .read_bf16("model.layers.5.self_attn.k_proj.bias")
            .unwrap();
        assert_eq!(w.layer(WeightKind::KBias, 5).unwrap(), &k5[..]);
    }
}
