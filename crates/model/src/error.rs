//! The one error type of the model crate.
//!
//! Every variant names what is at fault: the file (`path`), the tensor
//! (`tensor`) or the config field (`field`), so a message read on its own
//! tells the user which input to fix. New modules add variants here in the
//! same style: `#[error("{}: ...")]` with the path first.

use std::path::PathBuf;

/// Everything that can go wrong reading, validating or describing a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    // ---- files and JSON -------------------------------------------------
    /// An I/O error on a named file or directory.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory at fault.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (config.json, generation_config.json, an index) that does
    /// not parse, or parses to the wrong shape.
    #[error("{}: invalid JSON: {source}", .path.display())]
    Json {
        /// The file or directory at fault.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },

    // ---- config ---------------------------------------------------------
    /// A config field with a value the engine cannot run.
    #[error("{}: field `{field}`: {reason}", .path.display())]
    InvalidConfig {
        /// The file or directory at fault.
        path: PathBuf,
        /// The config field.
        field: &'static str,
        /// What is wrong with the value.
        reason: String,
    },

    /// `Config::preset` with a name not in [`crate::config::PRESETS`].
    #[error("unknown preset `{name}` (known: {known})")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The preset names there are.
        known: String,
    },

    // ---- checkpoint files -------------------------------------------------
    /// The directory holds neither `model.safetensors` nor
    /// `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json", .path.display())]
    NoCheckpoint {
        /// The file or directory at fault.
        path: PathBuf,
    },

    /// The safetensors header itself is bad: truncated, too large, not JSON,
    /// or not the expected shape.
    #[error("{}: safetensors header: {reason}", .path.display())]
    Header {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong with the header.
        reason: String,
    },

    /// One tensor's header entry is malformed (bad shape, bad offsets).
    #[error("{}: tensor `{tensor}`: {reason}", .path.display())]
    BadTensorEntry {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with the entry.
        reason: String,
    },

    /// A tensor's data range runs past the end of the file.
    #[error(
        "{}: tensor `{tensor}`: data_offsets [{begin}, {end}) run past the end of the data \
         section ({data_len} bytes)",
        .path.display()
    )]
    OutOfFile {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Start of the data range, in bytes.
        begin: u64,
        /// End of the data range (exclusive), in bytes.
        end: u64,
        /// Bytes in the file's data section.
        data_len: u64,
    },

    /// A tensor's data range length differs from shape x dtype size.
    #[error(
        "{}: tensor `{tensor}`: data_offsets span {span} bytes but shape {shape:?} x {dtype} \
         needs {expected}",
        .path.display()
    )]
    SizeMismatch {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape in the header.
        shape: Vec<u64>,
        /// The dtype in the header.
        dtype: String,
        /// Bytes the data range covers.
        span: u64,
        /// Bytes the shape and dtype need.
        expected: u64,
    },

    /// Two tensors' data ranges overlap.
    #[error(
        "{}: tensors `{first}` and `{second}` overlap (data_offsets [{first_begin}, \
         {first_end}) and [{second_begin}, {second_end}))",
        .path.display()
    )]
    Overlap {
        /// The file or directory at fault.
        path: PathBuf,
        /// The first tensor's name.
        first: String,
        /// Start of the first tensor's data range.
        first_begin: u64,
        /// End of the first tensor's data range (exclusive).
        first_end: u64,
        /// The second tensor's name.
        second: String,
        /// Start of the second tensor's data range.
        second_begin: u64,
        /// End of the second tensor's data range (exclusive).
        second_end: u64,
    },

    /// A dtype the loader does not stage (only BF16, F16 and F32 are).
    #[error(
        "{}: tensor `{tensor}` has dtype {dtype}; only BF16, F16 and F32 are supported",
        .path.display()
    )]
    UnsupportedDtype {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype in the header.
        dtype: String,
    },

    /// A tensor the config requires is not in the checkpoint.
    #[error("{}: tensor `{tensor}` is missing", .path.display())]
    MissingTensor {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },

    /// `lm_head.weight` is absent while `tie_word_embeddings` is false.
    #[error(
        "{}: tensor `lm_head.weight` is missing but config.json has tie_word_embeddings = false",
        .path.display()
    )]
    MissingLmHead {
        /// The file or directory at fault.
        path: PathBuf,
    },

    /// A tensor whose shape does not match the config.
    #[error(
        "{}: tensor `{tensor}` has shape {found:?} but the config needs {expected:?}",
        .path.display()
    )]
    ShapeMismatch {
        /// The file or directory at fault.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the config needs.
        expected: Vec<u64>,
        /// The shape in the checkpoint.
        found: Vec<u64>,
    },

    /// The sharded index names a shard file that does not exist (or is not a
    /// plain file name inside the model directory).
    #[error(
        "{}: weight_map names shard `{shard}` (for tensor `{tensor}`), which {reason}",
        .path.display()
    )]
    BadShard {
        /// The file or directory at fault.
        path: PathBuf,
        /// The shard file name the index gives.
        shard: String,
        /// The tensor's name.
        tensor: String,
        /// Why the shard cannot be used.
        reason: &'static str,
    },

    // ---- arithmetic and layout -------------------------------------------
    /// A tensor-parallel group size the model cannot be split into.
    #[error("tensor parallel over {ranks} ranks: {field} {reason}")]
    TensorParallel {
        /// Ranks asked for.
        ranks: usize,
        /// The config field (or `ranks`) at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },

    /// A size or offset computation overflowed its integer type.
    #[error("size of `{what}` overflows: {detail}")]
    Overflow {
        /// What was being computed or allocated.
        what: String,
        /// The operands, or why they do not fit.
        detail: String,
    },

    /// A weight buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes for `{what}`")]
    OutOfMemory {
        /// What was being computed or allocated.
        what: String,
        /// Bytes asked for.
        bytes: u64,
    },

    /// The layout crate rejected a tensor's layout or plan (boxed: the
    /// layout error is large and would bloat every `Result` of this crate).
    #[error("tensor `{tensor}`: layout: {source}")]
    Layout {
        /// The tensor's name.
        tensor: String,
        /// The layout crate's error.
        #[source]
        source: Box<qmk_layout::LayoutError>,
    },

    // ---- tokenizer, chat template, CPU reference ---------------------------
    /// tokenizer.json that cannot be read or parsed, or an encode/decode
    /// failure (the path names the tokenizer file).
    #[error("{}: {message}", .path.display())]
    Tokenizer {
        /// The file or directory at fault.
        path: PathBuf,
        /// What failed.
        message: String,
    },

    /// A chat template that cannot be found, compiled or rendered; `origin`
    /// names the file it came from.
    #[error("{origin}: chat template: {message}")]
    ChatTemplate {
        /// Where the template came from (a file, or the name given).
        origin: String,
        /// What failed.
        message: String,
    },

    /// A chat template that hit a resource limit while rendering
    /// (instructions, recursion depth or output size; see
    /// [`crate::chat`]): a hostile or broken template.
    #[error("{origin}: chat template: {what} passed the limit of {limit}")]
    TemplateLimit {
        /// Where the template came from (a file, or the name given).
        origin: String,
        /// The limit that tripped: `instructions executed`, `recursion depth`, `rendered bytes`, `operator bytes` or `sequence items`.
        what: &'static str,
        /// The limit.
        limit: u64,
    },

    /// A token id at or past the model's `vocab_size`.
    #[error("token id {token} is outside the vocabulary (vocab_size = {vocab_size})")]
    TokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },

    /// A position at or past the KV cache capacity.
    #[error("position {pos} is outside the KV cache (capacity {capacity} positions)")]
    PositionOutOfRange {
        /// The position.
        pos: usize,
        /// Positions the KV cache holds.
        capacity: usize,
    },

    /// Prompt plus new tokens need more KV cache positions than there are.
    #[error(
        "prompt of {prompt} tokens + {new_tokens} new tokens exceeds the KV cache capacity of \
         {capacity} positions"
    )]
    KvCapacity {
        /// Prompt tokens.
        prompt: usize,
        /// New tokens asked for.
        new_tokens: usize,
        /// Positions the KV cache holds.
        capacity: usize,
    },

    /// A prompt with no tokens (there is nothing to condition on).
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,

    /// A weight vector whose length does not match its config (for `Weights`
    /// built in memory rather than loaded).
    #[error("weights: tensor `{tensor}` has {found} elements but the config needs {expected}")]
    WeightLength {
        /// The tensor's name.
        tensor: &'static str,
        /// Elements the config needs.
        expected: usize,
        /// Elements the buffer has.
        found: usize,
    },

    /// A read of elements outside a stacked tensor (or of an absent one).
    #[error("tensor `{tensor}`: elements {first}..+{len} are outside its {total} elements{note}")]
    Range {
        /// The stacked tensor's name.
        tensor: &'static str,
        /// First element asked for.
        first: u64,
        /// Elements asked for.
        len: u64,
        /// Elements of the stacked tensor (0 when absent).
        total: u64,
        /// Why, when the tensor is absent.
        note: &'static str,
    },

    /// Arguments to the CPU reference that do not fit together (the message
    /// says which).
    #[error("cpu reference: {0}")]
    InvalidArgument(String),
}

impl ModelError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    /// An overflow while computing the size of `what`.
    pub(crate) fn overflow(what: impl Into<String>, detail: impl Into<String>) -> Self {
        ModelError::Overflow {
            what: what.into(),
            detail: detail.into(),
        }
    }
}

/// Checked product of `dims`, naming `what` on overflow.
pub(crate) fn checked_product(what: &str, dims: &[u64]) -> Result<u64, ModelError> {
    dims.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| ModelError::overflow(what, format!("product of {dims:?} exceeds u64")))
    })
}

/// `u64` to `usize`, naming `what` when it does not fit (32-bit hosts).
pub(crate) fn to_usize(what: &str, n: u64) -> Result<usize, ModelError> {
    usize::try_from(n).map_err(|_| ModelError::overflow(what, format!("{n} exceeds usize")))
}
