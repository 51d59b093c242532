//! Model files from the Hugging Face Hub, checked before use.
//!
//! Files go into the standard Hub cache (`$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`) in its usual layout
//! (`models--org--name/{blobs,snapshots/<commit>,refs}`, snapshot entries
//! linking to `../../blobs/<etag>`), so Python tools share it. The transfer
//! is this crate's own (`transfer`): hf-hub 0.4.3 writes the server's `ETag`
//! and `X-Repo-Commit` into paths unchecked, has no read timeout, no cap on
//! a body and no redirect limit. hf-hub still names the repository
//! (`Repo`: cache folder and API path). What this module does:
//!
//! 1. The file list comes from the model-info API (`/api/models/{id}/revision/
//!    {rev}?blobs=true`): the commit, and every file's size and, for LFS
//!    files, sha256.
//! 2. Every server or user value that becomes a path is checked first
//!    (`paths`): commit 40 hex, ETag a hash form, revision and file names
//!    plain relative paths. Writes never follow a link; deletes remove the
//!    cache's own entries, never a link's target.
//! 3. Every file is checked (size, then sha256 where the Hub gives one) before
//!    the directory is handed to the loader, whether it was just downloaded
//!    or found in the cache. A verified blob is remembered (size + mtime) in
//!    `.qwen-mk-verified/` beside the repo's `blobs/`, so a multi-GB
//!    checkpoint is hashed once, not on every run.
//! 4. A blob is fetched under a lock (`.locks/<repo>/<blob>.lock`, the one
//!    huggingface_hub takes): a second process waits (bounded) and then
//!    uses the first one's file. An interrupted transfer is resumed from its
//!    `.incomplete` file; one longer than announced is cut off and deleted;
//!    a file whose size or hash is wrong is deleted and fetched again. A bad
//!    file is never returned.
//! 5. `HF_HUB_OFFLINE=1` uses the cache only, and an unreachable endpoint
//!    falls back to a complete cached snapshot (saying so).
//!
//! Environment: `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`,
//! `HF_TOKEN` (else the token file `$HF_HOME/token`), and the `QMK_HUB_*`
//! timeouts and retries of [`NetConfig`].

mod paths;
mod transfer;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::{Repo, RepoType};
use serde::Deserialize;
use sha2::{Digest, Sha256};

pub use paths::revision_problem;
pub use transfer::NetConfig;
use transfer::{Failure, GetError, Net};

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

/// Where and how to reach the Hub; from the environment by default.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `HF_ENDPOINT` without a trailing `/`.
    pub endpoint: String,
    /// The Hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`).
    pub cache_dir: PathBuf,
    /// `HF_TOKEN`, else the token file.
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE`: the cache only.
    pub offline: bool,
    /// Timeouts, retries and the lock wait (`QMK_HUB_*`).
    pub net: NetConfig,
}

impl HubConfig {
    /// From `HF_*` and `QMK_HUB_*`; a malformed `QMK_HUB_*` value is an error.
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
            let t = qmk_model::read_small_file(&path, 64 << 10).ok()?;
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
            net: NetConfig::from_env()?,
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

/// [`fetch_model`] with an explicit configuration.
pub fn fetch_model_with(hub: &HubConfig, model: &str, revision: &str, ui: &Ui) -> Result<PathBuf> {
    // The revision names a file under `refs/`: checked before any use.
    paths::check_revision(revision)?;
    let cache = RepoCache::new(hub, model, revision);
    if hub.offline {
        return cache.offline_snapshot(ui).with_context(|| {
            format!("HF_HUB_OFFLINE is set: model `{model}` (revision `{revision}`) must come from the cache")
        });
    }
    let net = Net::new(&hub.endpoint, hub.token.clone(), hub.net.clone());

    let (commit, files) = match model_info(&net, hub, model, revision) {
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
    let fetcher = Fetcher {
        net: &net,
        endpoint: &hub.endpoint,
        commit: &commit,
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
    // Record the revision -> commit mapping for later offline runs.
    if !paths::is_commit(revision) {
        let ref_path = cache.repo_dir.join("refs").join(revision);
        if let Some(parent) = ref_path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = paths::write_nofollow(&ref_path, commit.as_bytes());
    }
    Ok(snapshot)
}

/// Shard file names from a `model.safetensors.index.json`, each checked to be
/// a plain relative path inside the repository.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = qmk_model::read_small_file(index, qmk_model::SMALL_FILE_CAP)?;
    let idx: Index = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid sharded-checkpoint index", index.display()))?;
    let mut names: Vec<String> = idx.weight_map.into_values().collect();
    names.sort();
    names.dedup();
    for n in &names {
        if paths::check_file_name(n).is_err() {
            bail!(
                "{}: shard name {n:?} is not a plain file name",
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
    net: &Net,
    hub: &HubConfig,
    model: &str,
    revision: &str,
) -> std::result::Result<(String, BTreeMap<String, Expected>), InfoError> {
    let repo = Repo::with_revision(model.to_string(), RepoType::Model, revision.to_string());
    let url = format!("{}/api/{}?blobs=true", hub.endpoint, repo.api_url());
    let endpoint = &hub.endpoint;
    let resp = match net.get(&url, None, false) {
        Ok(a) => a.resp,
        Err(GetError::Status(code, kind)) => {
            let msg = match (code, kind.as_deref().unwrap_or("")) {
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
        Err(GetError::Transport(reason)) => return Err(InfoError::Unreachable(reason)),
        Err(e @ GetError::Redirect(_)) => {
            return Err(InfoError::Other(anyhow!(
                "the Hub at {endpoint} sent no model info for `{model}`: {e}"
            )))
        }
    };
    // ureq caps this read at 10 MB.
    let text = resp
        .into_string()
        .map_err(|e| InfoError::Unreachable(format!("reading the model info failed: {e}")))?;
    let info: InfoJson = serde_json::from_str(&text).map_err(|e| {
        InfoError::Other(anyhow!(
            "the Hub at {endpoint} sent model info for `{model}` that does not parse: {e}"
        ))
    })?;
    let commit = match info.sha {
        Some(sha) => paths::commit(&sha).ok_or_else(|| {
            InfoError::Other(anyhow!(
                "the Hub at {endpoint} sent the commit {sha:?} for `{model}`, which is not a commit id (40 hex digits)"
            ))
        })?,
        None => {
            return Err(InfoError::Other(anyhow!(
                "the Hub at {endpoint} sent no commit for `{model}`"
            )))
        }
    };
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
    locks_dir: PathBuf,
    revision: String,
    model: String,
}

impl RepoCache {
    fn new(hub: &HubConfig, model: &str, revision: &str) -> Self {
        let folder = Repo::with_revision(model.to_string(), RepoType::Model, revision.to_string())
            .folder_name();
        RepoCache {
            repo_dir: hub.cache_dir.join(&folder),
            locks_dir: hub.cache_dir.join(".locks").join(&folder),
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
        let commit = if paths::is_commit(&self.revision) {
            self.revision.to_ascii_lowercase()
        } else {
            let ref_path = self.repo_dir.join("refs").join(&self.revision);
            let text = std::fs::read_to_string(&ref_path).map_err(|_| {
                anyhow!(
                    "`{}` (revision `{}`) is not in the Hub cache at {}",
                    self.model,
                    self.revision,
                    self.repo_dir.display()
                )
            })?;
            paths::commit(&text).ok_or_else(|| {
                anyhow!(
                    "{} does not hold a commit id (40 hex digits)",
                    ref_path.display()
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
                sha256: paths::linked_blob(&path).filter(|b| paths::is_sha256(b)),
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
        if !paths::is_sha256(sha) {
            bail!("the sha256 {sha:?} given for {name} is not 64 hex digits");
        }
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
        let _ = paths::write_nofollow(&marker, stamp.as_bytes());
        Ok(())
    }
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
    net: &'a Net,
    endpoint: &'a str,
    commit: &'a str,
    cache: &'a RepoCache,
    snapshot: &'a Path,
    model: &'a str,
    ui: &'a Ui,
}

impl Fetcher<'_> {
    /// One file: from the snapshot when present and good, else downloaded
    /// (resumed, or fetched again when it fails its check).
    fn file(&self, name: &str, exp: &Expected) -> Result<PathBuf> {
        paths::check_file_name(name)?;
        // A bad sha256 in the model info must not make a good cached file
        // look damaged (and deleted).
        if let Some(sha) = exp.sha256.as_deref().filter(|s| !paths::is_sha256(s)) {
            bail!(
                "the Hub at {} gives {name} of `{}` the sha256 {sha:?}, which is not 64 hex digits",
                self.endpoint,
                self.model
            );
        }
        let pointer = self.snapshot.join(name);
        if pointer.is_file() {
            match self.cache.check(&pointer, name, exp, self.ui) {
                Ok(()) => return Ok(pointer),
                Err(e) => {
                    self.ui.note(format!(
                        "cached {name} is damaged ({e:#}); fetching it again"
                    ));
                    paths::remove_snapshot_entry(&self.cache.repo_dir, &pointer);
                }
            }
        } else if pointer.symlink_metadata().is_ok() {
            // A dangling link (its blob was deleted).
            paths::remove_snapshot_entry(&self.cache.repo_dir, &pointer);
        }
        let cfg = &self.net.config;
        let attempts = cfg.retries + 1;
        let mut last: Option<anyhow::Error> = None;
        for attempt in 1..=attempts {
            if attempt > 1 {
                std::thread::sleep(cfg.retry_delay * (attempt as u32 - 1));
            }
            match self.fetch_once(name, exp, &pointer) {
                Ok(()) => return Ok(pointer),
                Err(Failure { retry: true, error }) => {
                    if attempt < attempts {
                        self.ui
                            .note(format!("download of {name}: {error:#}; retrying"));
                    }
                    last = Some(error);
                }
                Err(Failure {
                    retry: false,
                    error,
                }) => {
                    return Err(error.context(format!(
                        "cannot download {name} of `{}` from {}",
                        self.model, self.endpoint
                    )))
                }
            }
        }
        let err = last.unwrap_or_else(|| anyhow!("no attempt was made"));
        Err(err.context(format!(
            "cannot download {name} of `{}` intact after {attempts} attempts",
            self.model
        )))
    }

    /// One try: probe, check what the server says, lock the blob, fetch it
    /// (unless another process just did), check it, link it.
    fn fetch_once(
        &self,
        name: &str,
        exp: &Expected,
        pointer: &Path,
    ) -> std::result::Result<(), Failure> {
        let fatal = |m: String| Failure::fatal(anyhow!(m));
        let url = format!(
            "{}/{}/resolve/{}/{name}",
            self.endpoint, self.model, self.commit
        );
        let meta = self.net.probe(&url)?;
        if let Some(raw) = &meta.commit {
            match paths::commit(raw) {
                Some(c) if c == self.commit => {}
                Some(c) => {
                    return Err(fatal(format!(
                        "the server answered for commit {c} instead of {}",
                        self.commit
                    )))
                }
                None => {
                    return Err(fatal(format!(
                        "the server sent X-Repo-Commit {raw:?}, which is not a commit id (40 hex digits)"
                    )))
                }
            }
        }
        let blob = match (&meta.etag, &exp.sha256) {
            (Some(raw), sha) => {
                let tag = paths::etag(raw).ok_or_else(|| {
                    fatal(format!(
                        "the server sent ETag {raw:?}, which is not a file hash (sha256 or git blob id)"
                    ))
                })?;
                match sha {
                    Some(sha) if paths::is_sha256(&tag) && &tag != sha => {
                        return Err(fatal(format!(
                            "the server names the file {tag}, but the model info gives sha256 {sha}"
                        )))
                    }
                    Some(sha) => sha.clone(),
                    None => tag,
                }
            }
            (None, Some(sha)) => sha.clone(),
            (None, None) => return Err(fatal("the server sent no ETag".to_string())),
        };
        if !(paths::is_sha256(&blob) || paths::is_commit(&blob)) {
            return Err(fatal(format!(
                "the model info gives sha256 {blob:?}, which is not 64 hex digits"
            )));
        }
        let size = match (exp.size, meta.size) {
            (Some(a), Some(b)) if a != b => {
                return Err(fatal(format!(
                    "the server announced {b} bytes, the model info {a}"
                )))
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => return Err(fatal("the server announced no size".to_string())),
        };
        let want = Expected {
            size: Some(size),
            sha256: exp.sha256.clone(),
        };
        let blobs = self.cache.repo_dir.join("blobs");
        std::fs::create_dir_all(&blobs)
            .with_context(|| format!("cannot create {}", blobs.display()))
            .map_err(Failure::fatal)?;
        let blob_path = blobs.join(&blob);
        let lock_path = self.cache.locks_dir.join(format!("{blob}.lock"));
        let _lock = transfer::lock_blob(&lock_path, self.net.config.lock_wait, |holder| {
            self.ui.note(format!(
                "another process ({holder}) is downloading {name}; waiting for it"
            ))
        })
        .map_err(Failure::fatal)?;
        let link = || {
            paths::link_snapshot(pointer, name, &blob).map_err(Failure::fatal)?;
            Ok(())
        };
        // Another process may have fetched it while this one waited.
        if blob_path.symlink_metadata().is_ok_and(|m| m.is_file()) {
            if self.cache.check(&blob_path, name, &want, self.ui).is_ok() {
                return link();
            }
            let _ = std::fs::remove_file(&blob_path);
        }
        let part = blobs.join(format!("{blob}.incomplete"));
        let bar = self.ui.bytes_bar(size, name.to_string());
        let got = self.net.fetch_into(&meta.url, &part, size, &bar);
        bar.finish_and_clear();
        got?;
        if let Err(e) = self.cache.check(&part, name, &want, self.ui) {
            // Wrong bytes: never keep them, start over.
            let _ = std::fs::remove_file(&part);
            return Err(Failure::retry(anyhow!("{e:#} (the bad copy was deleted)")));
        }
        std::fs::rename(&part, &blob_path)
            .with_context(|| format!("cannot move {} into place", part.display()))
            .map_err(Failure::fatal)?;
        link()
    }
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
