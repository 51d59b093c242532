//! Model files from the Hugging Face Hub, checked before use.
//!
//! Downloads go through `hf-hub`'s sync client into the standard Hub cache
//! (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), so
//! Python tools share it. What this module adds on top:
//!
//! 1. The file list comes from the model-info API (`/api/models/{id}/revision/
//!    {rev}?blobs=true`): the commit, and every file's size and, for LFS
//!    files, sha256.
//! 2. Every file is checked (size, then sha256 where the Hub gives one) before
//!    the directory is handed to the loader, whether it was just downloaded
//!    or found in the cache. A verified blob is remembered (size + mtime) in
//!    `.qwen-mk-verified/` beside the repo's `blobs/`, so a multi-GB
//!    checkpoint is hashed once, not on every run.
//! 3. An interrupted download is resumed (hf-hub keeps a `.part` file); a file
//!    whose size or hash is wrong is deleted and fetched again once; if it is
//!    still wrong the command fails naming the file. A bad file is never
//!    returned.
//! 4. `HF_HUB_OFFLINE=1` uses the cache only, and an unreachable endpoint
//!    falls back to a complete cached snapshot (saying so).
//!
//! Environment: `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`,
//! `HF_TOKEN` (else the token file `$HF_HOME/token`).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Repo, RepoType};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::ui::Ui;

/// Files a model directory needs (besides the weights).
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
/// Files used when present.
const OPTIONAL: [&str; 4] = [
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
];
const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Attempts per file: the first, a resume after an interrupted transfer, and
/// a fresh fetch after a file failed its check.
const ATTEMPTS: usize = 3;
/// The model-info request answers in well under a second; a stalled server
/// is reported as unreachable after this long.
const INFO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Where and how to reach the Hub; from the environment by default.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub endpoint: String,
    pub cache_dir: PathBuf,
    pub token: Option<String>,
    pub offline: bool,
}

impl HubConfig {
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let hf_home = var("HF_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache").join("huggingface")));
        let cache_dir = match (var("HF_HUB_CACHE"), &hf_home) {
            (Some(c), _) => PathBuf::from(c),
            (None, Some(home)) => home.join("hub"),
            (None, None) => bail!("cannot place the Hub cache: set HF_HOME or HF_HUB_CACHE"),
        };
        let token = var("HF_TOKEN").or_else(|| {
            let path = hf_home?.join("token");
            let t = std::fs::read_to_string(path).ok()?;
            Some(t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        Ok(HubConfig {
            endpoint,
            cache_dir,
            token,
            offline,
        })
    }
}

/// Whether `spec` names a Hub repository (`name` or `owner/name`), as opposed
/// to a local path.
pub fn looks_like_repo_id(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    let ok_part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && !p.starts_with('-')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (1..=2).contains(&parts.len()) && parts.iter().all(|p| ok_part(p))
}

/// One file of the repository as the Hub describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub size: Option<u64>,
    /// Lowercase hex; LFS files only.
    pub sha256: Option<String>,
}

#[derive(Debug, Deserialize)]
struct InfoJson {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<SiblingJson>,
}

#[derive(Debug, Deserialize)]
struct SiblingJson {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<LfsJson>,
}

#[derive(Debug, Deserialize)]
struct LfsJson {
    sha256: String,
    #[serde(default)]
    size: Option<u64>,
}

/// Downloads (or finds in the cache) a model's files and returns the
/// snapshot directory holding them, every needed file checked.
pub fn fetch_model(model: &str, revision: &str, ui: &Ui) -> Result<PathBuf> {
    let hub = HubConfig::from_env()?;
    fetch_model_with(&hub, model, revision, ui)
}

pub fn fetch_model_with(hub: &HubConfig, model: &str, revision: &str, ui: &Ui) -> Result<PathBuf> {
    let cache = RepoCache::new(hub, model, revision);
    if hub.offline {
        return cache.offline_snapshot(ui).with_context(|| {
            format!("HF_HUB_OFFLINE is set: model `{model}` (revision `{revision}`) must come from the cache")
        });
    }
    let api = ApiBuilder::from_cache(hf_hub::Cache::new(hub.cache_dir.clone()))
        .with_endpoint(hub.endpoint.clone())
        .with_token(hub.token.clone())
        .with_progress(false)
        .build()
        .context("cannot start the Hub client")?;
    let repo = api.repo(Repo::with_revision(
        model.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));

    let (commit, files) = match model_info(&repo, hub, model, revision) {
        Ok(info) => info,
        Err(InfoError::Unreachable(reason)) => {
            // No network: a complete cached snapshot is as good (Python's
            // huggingface_hub does the same).
            if let Ok(dir) = cache.offline_snapshot(ui) {
                ui.note(format!(
                    "cannot reach {} ({reason}); using the cached copy of `{model}`",
                    hub.endpoint
                ));
                return Ok(dir);
            }
            bail!(
                "cannot reach the Hub at {} ({reason}) and `{model}` is not in the cache at {}; \
                 check the network (or HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use only the cache",
                hub.endpoint,
                cache.repo_dir.display()
            );
        }
        Err(InfoError::Other(e)) => return Err(e),
    };

    let snapshot = cache.repo_dir.join("snapshots").join(&commit);
    // Download by commit, not branch: every file then comes from the commit
    // the file list describes, even if the branch moves meanwhile.
    let at_commit = api.repo(Repo::with_revision(
        model.to_string(),
        RepoType::Model,
        commit.clone(),
    ));
    let fetcher = Fetcher {
        repo: &at_commit,
        cache: &cache,
        snapshot: &snapshot,
        model,
        ui,
    };
    for name in REQUIRED {
        let exp = files.get(name).ok_or_else(|| {
            anyhow!("`{model}` (revision `{revision}`) has no {name}: not a Hugging Face transformers model")
        })?;
        fetcher.file(name, exp)?;
    }
    for name in OPTIONAL {
        if let Some(exp) = files.get(name) {
            fetcher.file(name, exp)?;
        }
    }
    if let Some(exp) = files.get(INDEX) {
        let index = fetcher.file(INDEX, exp)?;
        for shard in shard_names(&index)? {
            let exp = files.get(&shard).ok_or_else(|| {
                anyhow!("{INDEX} of `{model}` names shard `{shard}`, which the repository does not have")
            })?;
            fetcher.file(&shard, exp)?;
        }
    } else if let Some(exp) = files.get(SINGLE) {
        fetcher.file(SINGLE, exp)?;
    } else {
        bail!(
            "`{model}` (revision `{revision}`) has no {SINGLE} or {INDEX}: only safetensors checkpoints are supported"
        );
    }
    // Record the revision -> commit mapping for later offline runs (hf-hub
    // does this too, but not when every file was already cached).
    if !looks_like_commit(revision) {
        let ref_path = cache.repo_dir.join("refs").join(revision);
        if let Some(parent) = ref_path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&ref_path, &commit);
    }
    Ok(snapshot)
}

fn looks_like_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
}

/// Shard file names from a `model.safetensors.index.json`, each checked to be
/// a plain relative path inside the repository.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(index).with_context(|| format!("{}", index.display()))?;
    let idx: Index = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid sharded-checkpoint index", index.display()))?;
    let mut names: Vec<String> = idx.weight_map.into_values().collect();
    names.sort();
    names.dedup();
    for n in &names {
        if n.is_empty() || n.starts_with('/') || n.split('/').any(|p| p == ".." || p.is_empty()) {
            bail!(
                "{}: shard name `{n}` is not a plain file name",
                index.display()
            );
        }
    }
    Ok(names)
}

enum InfoError {
    /// No answer at all: DNS, refused connection, timeout, TLS.
    Unreachable(String),
    Other(anyhow::Error),
}

/// The commit and file list of `model` at `revision`.
fn model_info(
    repo: &ApiRepo,
    hub: &HubConfig,
    model: &str,
    revision: &str,
) -> std::result::Result<(String, BTreeMap<String, Expected>), InfoError> {
    let request = repo
        .info_request()
        .query("blobs", "true")
        .timeout(INFO_TIMEOUT);
    let resp = match request.call() {
        Ok(r) => r,
        Err(ureq::Error::Status(code, resp)) => {
            let kind = resp.header("x-error-code").unwrap_or("").to_string();
            let endpoint = &hub.endpoint;
            let msg = match (code, kind.as_str()) {
                (_, "RevisionNotFound") => {
                    format!("model `{model}` has no revision `{revision}` at {endpoint}")
                }
                (_, "GatedRepo") | (403, _) => format!(
                    "model `{model}` at {endpoint} is gated: accept its license on the Hub and set HF_TOKEN"
                ),
                (401 | 404, _) if hub.token.is_none() => format!(
                    "model `{model}` not found at {endpoint} (HTTP {code}); check the id, or set HF_TOKEN if it is private"
                ),
                (401, _) => format!(
                    "model `{model}` not found at {endpoint}, or HF_TOKEN gives no access to it (HTTP 401)"
                ),
                (404, _) => format!("model `{model}` (revision `{revision}`) not found at {endpoint} (HTTP 404)"),
                _ => format!("the Hub at {endpoint} answered HTTP {code} for model `{model}`"),
            };
            return Err(InfoError::Other(anyhow!(msg)));
        }
        Err(ureq::Error::Transport(t)) => {
            let reason = match t.message() {
                Some(m) => format!("{}: {m}", t.kind()),
                None => t.kind().to_string(),
            };
            let reason = match std::error::Error::source(&t) {
                Some(src) => format!("{reason}: {src}"),
                None => reason,
            };
            return Err(InfoError::Unreachable(reason));
        }
    };
    let text = resp
        .into_string()
        .map_err(|e| InfoError::Unreachable(format!("reading the model info failed: {e}")))?;
    let info: InfoJson = serde_json::from_str(&text).map_err(|e| {
        InfoError::Other(anyhow!(
            "the Hub at {} sent model info for `{model}` that does not parse: {e}",
            hub.endpoint
        ))
    })?;
    let commit = info
        .sha
        .filter(|s| !s.is_empty() && !s.contains(['/', '\\']) && s != "." && s != "..")
        .ok_or_else(|| {
            InfoError::Other(anyhow!(
                "the Hub at {} sent no commit for `{model}`",
                hub.endpoint
            ))
        })?;
    let files = info
        .siblings
        .into_iter()
        .map(|s| {
            let (size, sha256) = match s.lfs {
                Some(l) => (l.size.or(s.size), Some(l.sha256.to_ascii_lowercase())),
                None => (s.size, None),
            };
            (s.rfilename, Expected { size, sha256 })
        })
        .collect();
    Ok((commit, files))
}

/// Paths of one repository inside the Hub cache.
struct RepoCache {
    repo_dir: PathBuf,
    revision: String,
    model: String,
}

impl RepoCache {
    fn new(hub: &HubConfig, model: &str, revision: &str) -> Self {
        let folder = Repo::with_revision(model.to_string(), RepoType::Model, revision.to_string())
            .folder_name();
        RepoCache {
            repo_dir: hub.cache_dir.join(folder),
            revision: revision.to_string(),
            model: model.to_string(),
        }
    }

    fn marker_dir(&self) -> PathBuf {
        self.repo_dir.join(".qwen-mk-verified")
    }

    /// The cached snapshot of the revision, every needed file present and
    /// checked; errors say what is missing.
    fn offline_snapshot(&self, ui: &Ui) -> Result<PathBuf> {
        let commit = if looks_like_commit(&self.revision) {
            self.revision.clone()
        } else {
            let ref_path = self.repo_dir.join("refs").join(&self.revision);
            std::fs::read_to_string(&ref_path)
                .map(|s| s.trim().to_string())
                .map_err(|_| {
                    anyhow!(
                        "`{}` (revision `{}`) is not in the Hub cache at {}",
                        self.model,
                        self.revision,
                        self.repo_dir.display()
                    )
                })?
        };
        let snap = self.repo_dir.join("snapshots").join(&commit);
        let mut needed: Vec<String> = REQUIRED.iter().map(|s| s.to_string()).collect();
        if snap.join(INDEX).is_file() {
            needed.push(INDEX.to_string());
            needed.extend(shard_names(&snap.join(INDEX))?);
        } else {
            needed.push(SINGLE.to_string());
        }
        for name in &needed {
            let path = snap.join(name);
            if !path.is_file() {
                bail!(
                    "{name} of `{}` is not in the Hub cache (looked in {})",
                    self.model,
                    snap.display()
                );
            }
            // Blobs named by a sha256 (LFS files) can be checked offline.
            let exp = Expected {
                size: None,
                sha256: blob_sha_name(&path),
            };
            self.check(&path, name, &exp, ui)
                .with_context(|| format!("cached {name} of `{}` is damaged", self.model))?;
        }
        Ok(snap)
    }

    /// Checks `path` against `exp`; a previous successful hash of the same
    /// blob (same size and mtime) is reused.
    fn check(&self, path: &Path, name: &str, exp: &Expected, ui: &Ui) -> Result<()> {
        let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
        if let Some(size) = exp.size {
            if meta.len() != size {
                bail!("{name} is {} bytes, expected {size}", meta.len());
            }
        }
        let Some(sha) = &exp.sha256 else {
            return Ok(());
        };
        let stamp = format!(
            "{} {}",
            meta.len(),
            meta.modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos())
        );
        let marker = self.marker_dir().join(sha);
        if std::fs::read_to_string(&marker).is_ok_and(|s| s == stamp) {
            return Ok(());
        }
        let got = sha256_file(path, name, meta.len(), ui)?;
        if &got != sha {
            bail!("{name} has sha256 {got}, expected {sha}");
        }
        let _ = std::fs::create_dir_all(self.marker_dir());
        let _ = std::fs::write(&marker, stamp);
        Ok(())
    }
}

/// The blob name behind a snapshot symlink when it is a sha256 (LFS file).
fn blob_sha_name(pointer: &Path) -> Option<String> {
    let target = std::fs::read_link(pointer).ok()?;
    let name = target.file_name()?.to_str()?;
    (name.len() == 64 && name.chars().all(|c| c.is_ascii_hexdigit()))
        .then(|| name.to_ascii_lowercase())
}

fn sha256_file(path: &Path, name: &str, len: u64, ui: &Ui) -> Result<String> {
    let bar = if len > 64 << 20 {
        ui.bytes_bar(len, format!("checking {name}"))
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

struct Fetcher<'a> {
    repo: &'a ApiRepo,
    cache: &'a RepoCache,
    snapshot: &'a Path,
    model: &'a str,
    ui: &'a Ui,
}

impl Fetcher<'_> {
    /// One file: from the snapshot when present and good, else downloaded
    /// (resumed, or fetched again when it fails its check).
    fn file(&self, name: &str, exp: &Expected) -> Result<PathBuf> {
        let pointer = self.snapshot.join(name);
        if pointer.is_file() {
            match self.cache.check(&pointer, name, exp, self.ui) {
                Ok(()) => return Ok(pointer),
                Err(e) => {
                    self.ui.note(format!(
                        "cached {name} is damaged ({e:#}); fetching it again"
                    ));
                    remove_cached(&pointer);
                }
            }
        } else if pointer.symlink_metadata().is_ok() {
            // A dangling link (its blob was deleted): hf-hub would refuse to
            // replace it.
            let _ = std::fs::remove_file(&pointer);
        }
        let mut last: Option<anyhow::Error> = None;
        for attempt in 1..=ATTEMPTS {
            let bar = self.ui.bytes_bar(exp.size.unwrap_or(0), name.to_string());
            let got = self
                .repo
                .download_with_progress(name, BarProgress(bar.clone()));
            bar.finish_and_clear();
            match got {
                Ok(path) => match self.cache.check(&path, name, exp, self.ui) {
                    Ok(()) => {
                        if !pointer.is_file() {
                            bail!(
                                "the Hub at its resolve URL answered with another commit than its model info \
                                 for {name} of `{}` ({} instead of {})",
                                self.model,
                                path.display(),
                                pointer.display()
                            );
                        }
                        return Ok(pointer);
                    }
                    Err(e) => {
                        // Wrong bytes: never keep them, start over.
                        remove_cached(&path);
                        if attempt < ATTEMPTS {
                            self.ui.note(format!(
                                "downloaded {name} failed its check ({e:#}); fetching it again"
                            ));
                        }
                        last = Some(anyhow!("{e:#} (the bad copy was deleted)"));
                    }
                },
                Err(e) => {
                    // hf-hub leaves a `.part` file behind; the next attempt
                    // resumes it. A part that cannot be resumed is dropped.
                    if matches!(e, ApiError::InvalidResume) {
                        self.remove_parts(exp);
                    }
                    if attempt < ATTEMPTS {
                        self.ui.note(format!(
                            "download of {name} was interrupted ({}); retrying",
                            describe_api_error(&e)
                        ));
                    }
                    last = Some(anyhow!(describe_api_error(&e)));
                }
            }
        }
        self.remove_parts(exp);
        let err = last.unwrap_or_else(|| anyhow!("no attempt was made"));
        Err(err.context(format!(
            "cannot download {name} of `{}` intact after {ATTEMPTS} attempts",
            self.model
        )))
    }

    /// Deletes leftover `.part` files of this file's blob.
    fn remove_parts(&self, exp: &Expected) {
        if let Some(sha) = &exp.sha256 {
            let _ = std::fs::remove_file(
                self.cache
                    .repo_dir
                    .join("blobs")
                    .join(format!("{sha}.part")),
            );
        }
    }
}

/// Deletes a cached snapshot entry and the blob it points to.
fn remove_cached(pointer: &Path) {
    if let Ok(blob) = std::fs::canonicalize(pointer) {
        let _ = std::fs::remove_file(blob);
    }
    let _ = std::fs::remove_file(pointer);
}

fn describe_api_error(e: &ApiError) -> String {
    match e {
        ApiError::RequestError(inner) => match inner.as_ref() {
            ureq::Error::Status(code, _) => format!("HTTP {code}"),
            ureq::Error::Transport(t) => t.to_string(),
        },
        ApiError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the connection closed before the whole file arrived".to_string()
        }
        other => other.to_string(),
    }
}

/// hf-hub's progress hook drawing one of our bars.
struct BarProgress(indicatif::ProgressBar);

impl hf_hub::api::Progress for BarProgress {
    fn init(&mut self, size: usize, _filename: &str) {
        self.0.set_length(size as u64);
        self.0.set_position(0);
    }
    fn update(&mut self, size: usize) {
        self.0.inc(size as u64);
    }
    fn finish(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths_are_told_apart() {
        assert!(looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct"));
        assert!(looks_like_repo_id("gpt2"));
        assert!(!looks_like_repo_id("./model"));
        assert!(!looks_like_repo_id("/abs/path"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("../x"));
        assert!(!looks_like_repo_id(""));
    }

    #[test]
    fn shard_names_reject_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(INDEX);
        std::fs::write(
            &p,
            r#"{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(
            shard_names(&p).unwrap(),
            vec!["s1.safetensors", "s2.safetensors"]
        );
        std::fs::write(&p, r#"{"weight_map":{"a":"../evil"}}"#).unwrap();
        assert!(shard_names(&p)
            .unwrap_err()
            .to_string()
            .contains("not a plain file name"));
    }
}
