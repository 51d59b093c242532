//! Tokenizer: `tokenizer.json` through the `tokenizers` crate, plus an
//! incremental decoder for streaming output.
//!
//! `encode` never adds special tokens (no BOS/EOS): chat prompts already carry
//! their markers from the template, and Qwen2.5 adds none to raw text either,
//! so this matches transformers' `tok(text).input_ids` for these models. Text
//! such as `<|im_start|>` inside the input *is* matched as the special token,
//! as transformers does.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::ModelError;

/// A loaded `tokenizer.json`. Cheap to clone (the vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// Where it came from, for error messages.
    origin: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_file(dir.as_ref().join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let bytes =
            crate::small_file::read_small_bytes(path, crate::SMALL_FILE_CAP).map_err(|e| {
                ModelError::Tokenizer {
                    path: path.to_path_buf(),
                    message: format!("cannot read: {e}"),
                }
            })?;
        Self::from_bytes_named(&bytes, path)
    }

    /// Parses `tokenizer.json` contents; `origin` names it in errors.
    pub fn from_bytes_named(bytes: &[u8], origin: impl AsRef<Path>) -> Result<Self, ModelError> {
        let origin = origin.as_ref().to_path_buf();
        let inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| ModelError::Tokenizer {
                path: origin.clone(),
                message: format!("malformed tokenizer.json: {e}"),
            })?;
        Ok(Self {
            inner: Arc::new(inner),
            origin,
        })
    }

    /// Text to token ids, without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| self.err(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids to text. Ids the tokenizer does not know (the model's vocab
    /// is padded past the tokenizer's) decode to nothing, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(format!("decode failed: {e}")))
    }

    /// Number of tokens the tokenizer knows, added (special) tokens included.
    /// Smaller than the model's `vocab_size`, which is padded.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string (e.g. `"<|im_end|>"`), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (byte-level form for BPE pieces).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// A fresh incremental decoder over this tokenizer.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }

    /// The underlying `tokenizers` object, for anything not wrapped here.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn err(&self, message: String) -> ModelError {
        ModelError::Tokenizer {
            path: self.origin.clone(),
            message,
        }
    }
}

/// Incremental decoding for streaming: push ids one at a time, get back only
/// text that is final.
///
/// Why not decode each id alone: a byte-level BPE token can end in the middle
/// of a multi-byte UTF-8 character (emoji and CJK often span tokens), and
/// decoders may treat a token differently at the start of a text (leading
/// spaces). So this decodes a short window `ids[prefix..]` and emits the part
/// beyond the text of `ids[prefix..read]`, and holds everything back while the
/// window ends in U+FFFD (an incomplete character). Same scheme as
/// text-generation-inference and `tokenizers::DecodeStream`, but owning its
/// tokenizer handle so it can live in an engine without a borrow.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special_tokens: bool,
    /// The window of ids still needed for context, `[n]`.
    ids: Vec<u32>,
    /// `ids[..prefix]` is context only; its text was emitted earlier.
    prefix: usize,
    /// `ids[prefix..read]` has been emitted; `ids[read..]` is pending.
    read: usize,
}

impl StreamDecoder {
    /// A decoder with nothing pushed yet.
    pub fn new(tok: Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tok,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one id; returns newly completed text, or `None` while the text so
    /// far ends inside a UTF-8 character (or produced nothing yet).
    pub fn push(&mut self, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let before = self
            .tok
            .decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = self
            .tok
            .decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let new_text = after_common_prefix(&before, &after).to_string();
        // Keep the last emitted stretch as context for the next window.
        self.ids.drain(..self.prefix);
        self.prefix = self.read - self.prefix;
        self.read = self.ids.len();
        Ok(Some(new_text))
    }

    /// Emits whatever is still held back (an incomplete character at the end
    /// of generation decodes to U+FFFD, as `decode` would show it).
    pub fn flush(&mut self) -> Result<Option<String>, ModelError> {
        let before = self
            .tok
            .decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = self
            .tok
            .decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        if after.len() <= before.len() {
            return Ok(None);
        }
        Ok(Some(after_common_prefix(&before, &after).to_string()))
    }
}

/// The part of `after` beyond its longest common prefix with `before`, cut at
/// a character boundary. Normally `after` simply extends `before`; the common
/// prefix keeps a decoder that rewrites earlier text from panicking here.
fn after_common_prefix<'a>(before: &str, after: &'a str) -> &'a str {
    if let Some(rest) = after.strip_prefix(before) {
        return rest;
    }
    let mut cut = 0;
    for ((i, a), b) in after.char_indices().zip(before.chars()) {
        if a != b {
            break;
        }
        cut = i + a.len_utf8();
    }
    &after[cut..]
}

#[cfg(test)]
mod tests {
    use super::after_common_prefix;

    #[test]
    fn common_prefix_cuts_at_char_boundary() {
        assert_eq!(after_common_prefix("ab", "abc"), "c");
        assert_eq!(after_common_prefix("aé", "aèx"), "èx");
        assert_eq!(after_common_prefix("", "x"), "x");
    }
}
