//! The HTTP side of Hub downloads: one `ureq` agent with connect and read
//! timeouts, redirects followed by hand and counted (the token goes only to
//! the endpoint's origin), the resolve probe that names the blob, a body
//! transfer resumed from a partial file and capped at the announced size,
//! and the per-blob lock other downloaders of the same cache also take.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use super::paths;

/// Redirects followed per request: the Hub sends one (to its CDN), a
/// renamed repository one more.
pub const MAX_REDIRECTS: usize = 10;

/// Timeouts, retries and waits of the transfers; from `QMK_HUB_*`
/// environment variables, with defaults for real networks.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of a response.
    pub read_timeout: Duration,
    /// Transfers of one file after the first fails.
    pub retries: usize,
    /// Pause before retry n is n times this.
    pub retry_delay: Duration,
    /// Longest wait for another process's download of the same blob.
    pub lock_wait: Duration,
}

impl NetConfig {
    /// Reads `QMK_HUB_CONNECT_TIMEOUT_MS`, `QMK_HUB_READ_TIMEOUT_MS`,
    /// `QMK_HUB_RETRIES`, `QMK_HUB_RETRY_DELAY_MS`, `QMK_HUB_LOCK_WAIT_MS`;
    /// a value that is not a number is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        let num = |k: &str, default: u64| -> Result<u64> {
            match std::env::var(k) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| anyhow!("{k}={v:?} is not a whole number")),
                _ => Ok(default),
            }
        };
        let ms = Duration::from_millis;
        Ok(NetConfig {
            connect_timeout: ms(num("QMK_HUB_CONNECT_TIMEOUT_MS", 10_000)?.max(1)),
            read_timeout: ms(num("QMK_HUB_READ_TIMEOUT_MS", 30_000)?.max(1)),
            retries: num("QMK_HUB_RETRIES", 3)?.min(100) as usize,
            retry_delay: ms(num("QMK_HUB_RETRY_DELAY_MS", 1_000)?),
            lock_wait: ms(num("QMK_HUB_LOCK_WAIT_MS", 30 * 60_000)?),
        })
    }
}

/// Why a request failed.
#[derive(Debug)]
pub enum GetError {
    /// The server answered with an error status (and `X-Error-Code`).
    Status(u16, Option<String>),
    /// No answer: DNS, refused connection, timeout, TLS.
    Transport(String),
    /// Too many redirects, or one to a place that is not http(s).
    Redirect(String),
}

impl std::fmt::Display for GetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GetError::Status(code, _) => write!(f, "HTTP {code}"),
            GetError::Transport(m) | GetError::Redirect(m) => f.write_str(m),
        }
    }
}

/// A failed transfer step: worth trying again (network trouble, a cut
/// body), or not (the server says no, or sent something hostile).
#[derive(Debug)]
pub struct Failure {
    /// Whether another try may succeed.
    pub retry: bool,
    /// What went wrong.
    pub error: anyhow::Error,
}

impl Failure {
    /// A failure worth another try.
    pub fn retry(error: anyhow::Error) -> Self {
        Failure { retry: true, error }
    }
    /// A failure another try would repeat.
    pub fn fatal(error: anyhow::Error) -> Self {
        Failure {
            retry: false,
            error,
        }
    }
}

impl From<GetError> for Failure {
    fn from(e: GetError) -> Self {
        let retry = match &e {
            GetError::Status(code, _) => *code == 429 || *code >= 500,
            GetError::Transport(_) => true,
            GetError::Redirect(_) => false,
        };
        Failure {
            retry,
            error: anyhow!(e.to_string()),
        }
    }
}

/// A response and the URL that gave it; `next` is the other-origin place a
/// probe was sent to (the CDN holding the bytes).
pub struct Answer {
    /// The response, body unread.
    pub resp: ureq::Response,
    /// The URL that answered.
    pub url: String,
    /// Where a probe's redirect to another origin points.
    pub next: Option<String>,
}

/// What the resolve probe learned about a file.
#[derive(Debug)]
pub struct Meta {
    /// `X-Repo-Commit`, as sent.
    pub commit: Option<String>,
    /// `X-Linked-Etag`, else `ETag`, as sent.
    pub etag: Option<String>,
    /// `X-Linked-Size`, else the total of `Content-Range`, else (a whole
    /// file answered) `Content-Length`.
    pub size: Option<u64>,
    /// Where the bytes are fetched from.
    pub url: String,
}

/// The Hub client: one agent, the endpoint the token belongs to, and the
/// timeouts and retries.
pub struct Net {
    agent: ureq::Agent,
    endpoint_origin: String,
    token: Option<String>,
    /// Timeouts, retries and the lock wait.
    pub config: NetConfig,
}

impl Net {
    /// A client for `endpoint`; `token` is sent to its origin only.
    pub fn new(endpoint: &str, token: Option<String>, config: NetConfig) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(config.connect_timeout)
            .timeout_read(config.read_timeout)
            .timeout_write(config.read_timeout)
            .redirects(0)
            .try_proxy_from_env(true)
            .user_agent(concat!("qwen-mk/", env!("CARGO_PKG_VERSION")))
            .build();
        Net {
            agent,
            endpoint_origin: origin(endpoint).to_string(),
            token,
            config,
        }
    }

    fn send(
        &self,
        url: &str,
        range: Option<&str>,
    ) -> std::result::Result<ureq::Response, GetError> {
        let mut req = self.agent.get(url);
        if let Some(r) = range {
            req = req.set("Range", r);
        }
        if let Some(t) = &self.token {
            if origin(url).eq_ignore_ascii_case(&self.endpoint_origin) {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
        }
        match req.call() {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(code, resp)) => Err(GetError::Status(
                code,
                resp.header("x-error-code").map(str::to_string),
            )),
            Err(ureq::Error::Transport(t)) => {
                let mut reason = match t.message() {
                    Some(m) => format!("{}: {m}", t.kind()),
                    None => t.kind().to_string(),
                };
                if let Some(src) = std::error::Error::source(&t) {
                    reason = format!("{reason}: {src}");
                }
                Err(GetError::Transport(reason))
            }
        }
    }

    /// GET `url`, following at most [`MAX_REDIRECTS`] redirects. A probe
    /// stops at a redirect to another origin and returns that answer (its
    /// headers describe the file; `next` is where the bytes are).
    pub fn get(
        &self,
        url: &str,
        range: Option<&str>,
        probe: bool,
    ) -> std::result::Result<Answer, GetError> {
        let mut url = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let resp = self.send(&url, range)?;
            if !(300..400).contains(&resp.status()) {
                return Ok(Answer {
                    resp,
                    url,
                    next: None,
                });
            }
            let loc = resp.header("location").ok_or_else(|| {
                GetError::Redirect(format!(
                    "{url} answered HTTP {} without a Location",
                    resp.status()
                ))
            })?;
            let next = resolve(&url, loc).map_err(GetError::Redirect)?;
            if probe && !origin(&next).eq_ignore_ascii_case(origin(&url)) {
                return Ok(Answer {
                    resp,
                    url,
                    next: Some(next),
                });
            }
            url = next;
        }
        Err(GetError::Redirect(format!(
            "more than {MAX_REDIRECTS} redirects, the last to {url}"
        )))
    }

    /// Asks the Hub about one file (`Range: bytes=0-0`, as hf-hub and
    /// huggingface_hub do): commit, blob name, size and the bytes' URL.
    pub fn probe(&self, url: &str) -> std::result::Result<Meta, GetError> {
        let a = self.get(url, Some("bytes=0-0"), true)?;
        let h = |k: &str| a.resp.header(k).map(str::to_string);
        let size = h("x-linked-size")
            .and_then(|s| s.trim().parse().ok())
            .or_else(|| {
                h("content-range")
                    .and_then(|r| r.rsplit_once('/').and_then(|(_, t)| t.trim().parse().ok()))
            })
            .or_else(|| {
                // A server that ignores the range sends the whole file.
                (a.resp.status() == 200)
                    .then(|| h("content-length").and_then(|l| l.trim().parse().ok()))
                    .flatten()
            });
        Ok(Meta {
            commit: h("x-repo-commit"),
            etag: h("x-linked-etag").or_else(|| h("etag")),
            size,
            url: a.next.clone().unwrap_or(a.url),
        })
    }

    /// Brings `part` to `size` bytes from `url`, resuming what it holds.
    /// More bytes than announced is an error and the part is deleted; a cut
    /// transfer keeps the part for the next try.
    pub fn fetch_into(
        &self,
        url: &str,
        part: &Path,
        size: u64,
        bar: &indicatif::ProgressBar,
    ) -> std::result::Result<(), Failure> {
        let disk = |e: std::io::Error, what: &str| {
            Failure::fatal(anyhow!("cannot {what} {}: {e}", part.display()))
        };
        let mut file = paths::open_nofollow(part, false).map_err(Failure::fatal)?;
        let mut have = file.metadata().map_err(|e| disk(e, "read"))?.len();
        if have > size {
            file.set_len(0).map_err(|e| disk(e, "truncate"))?;
            have = 0;
        }
        bar.set_length(size);
        bar.set_position(have);
        if have == size {
            return Ok(());
        }
        let range = (have > 0).then(|| format!("bytes={have}-"));
        let a = self.get(url, range.as_deref(), false)?;
        match a.resp.status() {
            206 => {
                let from = a
                    .resp
                    .header("content-range")
                    .and_then(|r| r.trim().strip_prefix("bytes "))
                    .and_then(|r| r.split_once('-'))
                    .and_then(|(s, _)| s.trim().parse::<u64>().ok());
                if from != Some(have) {
                    file.set_len(0).map_err(|e| disk(e, "truncate"))?;
                    return Err(Failure::retry(anyhow!(
                        "{} answered a range other than the one asked for; starting over",
                        a.url
                    )));
                }
            }
            200 => {
                if have > 0 {
                    // The server ignored the range: the body is the whole file.
                    file.set_len(0).map_err(|e| disk(e, "truncate"))?;
                    have = 0;
                    bar.set_position(0);
                }
            }
            code => {
                return Err(Failure::fatal(anyhow!(
                    "{} answered HTTP {code} to a download",
                    a.url
                )))
            }
        }
        let remaining = size - have;
        let too_long = || {
            let _ = std::fs::remove_file(part);
            Failure::fatal(anyhow!(
                "the server sent more than the {size} bytes announced (the partial download was deleted)"
            ))
        };
        let declared = a
            .resp
            .header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|d| d > remaining) {
            drop(file);
            return Err(too_long());
        }
        file.seek(SeekFrom::Start(have))
            .map_err(|e| disk(e, "seek in"))?;
        // One byte past the announced size tells a longer body apart.
        let mut body = a.resp.into_reader().take(remaining + 1);
        let mut buf = vec![0u8; 256 << 10];
        let mut got = 0u64;
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = file.flush();
                    let why = if matches!(
                        e.kind(),
                        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                    ) {
                        format!("no data for {} ms", self.config.read_timeout.as_millis())
                    } else {
                        e.to_string()
                    };
                    return Err(Failure::retry(anyhow!(
                        "the transfer stopped after {} of {size} bytes ({why})",
                        have + got
                    )));
                }
            };
            got += n as u64;
            if got > remaining {
                drop(file);
                return Err(too_long());
            }
            file.write_all(&buf[..n]).map_err(|e| disk(e, "write"))?;
            bar.inc(n as u64);
        }
        file.flush().map_err(|e| disk(e, "write"))?;
        if got < remaining {
            return Err(Failure::retry(anyhow!(
                "the connection closed after {} of {size} bytes",
                have + got
            )));
        }
        Ok(())
    }
}

/// `scheme://host[:port]` of an absolute URL.
fn origin(url: &str) -> &str {
    let Some(i) = url.find("://") else {
        return url;
    };
    let rest = &url[i + 3..];
    let end = rest.find(['/', '?', '#']).map_or(url.len(), |j| i + 3 + j);
    &url[..end]
}

/// The absolute URL a `Location` header names, seen from `base`.
fn resolve(base: &str, loc: &str) -> std::result::Result<String, String> {
    let loc = loc.trim();
    if let Some(i) = loc.find("://") {
        let scheme = loc[..i].to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(format!("a redirect to {loc:?}, which is not http(s)"));
        }
        return Ok(loc.to_string());
    }
    if let Some(rest) = loc.strip_prefix("//") {
        let scheme = &base[..base.find("://").unwrap_or(0)];
        return Ok(format!("{scheme}://{rest}"));
    }
    let o = origin(base);
    if loc.starts_with('/') {
        return Ok(format!("{o}{loc}"));
    }
    let path = &base[o.len()..];
    let path = &path[..path.find(['?', '#']).unwrap_or(path.len())];
    let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
    let dir = if dir.is_empty() { "/" } else { dir };
    Ok(format!("{o}{dir}{loc}"))
}

/// Holds a blob's lock while it lives; the lock goes with the process, so
/// a crashed downloader never leaves a lock that blocks the next one.
pub struct BlobLock {
    _file: File,
}

/// Takes the lock file `path` (`<cache>/.locks/<repo>/<blob>.lock`, the
/// place huggingface_hub locks too), waiting up to `wait` while another
/// process holds it; `on_wait` is called once with the holder's note when
/// waiting starts.
pub fn lock_blob(path: &Path, wait: Duration, on_wait: impl FnOnce(&str)) -> Result<BlobLock> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut file = paths::open_nofollow(path, false)?;
    let start = Instant::now();
    let mut on_wait = Some(on_wait);
    loop {
        if try_lock(&file).with_context(|| format!("cannot lock {}", path.display()))? {
            // Who holds it, for the message of a process that waits.
            let note = format!(
                "pid {} since {} s after the epoch",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            );
            let _ = file.set_len(0);
            let _ = file.write_all(note.as_bytes());
            return Ok(BlobLock { _file: file });
        }
        let holder = holder_note(path);
        if let Some(f) = on_wait.take() {
            f(&holder);
        }
        if start.elapsed() >= wait {
            anyhow::bail!(
                "another process ({holder}) has been downloading the same file for longer than {} ms \
                 (lock {}); try again later, or raise QMK_HUB_LOCK_WAIT_MS",
                wait.as_millis(),
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100).min(wait));
    }
}

fn holder_note(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(f) = File::open(path) {
        let _ = f.take(200).read_to_string(&mut s);
    }
    let s: String = s.chars().filter(|c| !c.is_control()).collect();
    if s.trim().is_empty() {
        "holder unknown".to_string()
    } else {
        s.trim().to_string()
    }
}

/// A non-blocking exclusive `flock`: the kernel drops it when its holder
/// exits, however it exits.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor this File owns for the whole call.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The CLI runs on Linux (CUDA); on other systems downloads of one blob by
/// two processes are not serialised.
#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets_resolve() {
        let b = "http://h:1/a/resolve/c/f.json?x=1";
        assert_eq!(resolve(b, "/x/y").unwrap(), "http://h:1/x/y");
        assert_eq!(resolve(b, "g").unwrap(), "http://h:1/a/resolve/c/g");
        assert_eq!(resolve(b, "//cdn/z").unwrap(), "http://cdn/z");
        assert_eq!(resolve(b, "https://cdn/z").unwrap(), "https://cdn/z");
        assert!(resolve(b, "file:///etc/passwd").is_err());
        assert_eq!(origin("https://Hub.example:8/x?y"), "https://Hub.example:8");
        assert_eq!(origin("http://h:1"), "http://h:1");
    }

    #[cfg(unix)]
    #[test]
    fn a_held_lock_is_waited_for_up_to_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("locks/x.lock");
        let held = lock_blob(&p, Duration::ZERO, |_| {}).unwrap();
        let mut waited = String::new();
        let e = lock_blob(&p, Duration::from_millis(200), |h| waited = h.to_string())
            .err()
            .unwrap();
        assert!(
            waited.contains(&format!("pid {}", std::process::id())),
            "{waited}"
        );
        assert!(e.to_string().contains("x.lock"), "{e}");
        drop(held);
        lock_blob(&p, Duration::ZERO, |_| {}).unwrap();
    }
}
