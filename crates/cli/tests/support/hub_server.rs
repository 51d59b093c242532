//! A Hugging Face Hub look-alike on 127.0.0.1 for the CLI's Hub client:
//! the model-info API (`/api/models/{id}/revision/{rev}`, with sizes and LFS
//! sha256 as `?blobs=true` gives them) and `/{id}/resolve/{rev}/{file}` with
//! the headers Hub clients read (`x-repo-commit`, `etag` / `x-linked-etag`,
//! `x-linked-size`, `content-range`) and byte ranges. Faults can be injected
//! per file. Every request is logged. The server stops when dropped, or by
//! itself after a deadline.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Files at or above this size are served as LFS files (sha256 known).
const LFS_MIN: usize = 1024;
/// The server shuts itself down after this long, whatever happens.
const LIFETIME: Duration = Duration::from_secs(300);

/// What goes wrong when a file's body is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The first body response declares the full length but sends half and
    /// closes the connection; later ones are fine.
    TruncateOnce,
    /// Every body response is cut that way.
    TruncateAlways,
    /// The bytes are served whole but one is flipped (size right, sha wrong).
    Corrupt,
    /// `ETag` (and `X-Linked-Etag`) `"../../../../x"`.
    HostileEtag,
    /// `X-Repo-Commit: ../../../../evil`; under [`INFO`], the model info's
    /// `sha` is that value.
    HostileCommit,
    /// The first body response sends half the bytes, then nothing more
    /// while keeping the connection open (up to [`STALL`]); later ones
    /// are fine.
    StallOnce,
    /// Body responses carry no length and go on past the file's end, up to
    /// [`OVERLONG_CAP`] bytes, until the client hangs up.
    Overlong,
    /// The resolve URL redirects to itself, forever.
    RedirectLoop,
    /// Body responses are sent in 64 KiB pieces 20 ms apart.
    Slow,
    /// Under [`INFO`]: every revision name is taken to mean the repository's
    /// one commit (a permissive mirror).
    AnyRevision,
}

/// The key of faults that apply to the model info, not to a file.
pub const INFO: &str = "@info";
/// Longest stall of [`Fault::StallOnce`].
pub const STALL: Duration = LIFETIME;
/// Most bytes a [`Fault::Overlong`] body sends.
pub const OVERLONG_CAP: usize = 64 << 20;

/// One repository: id, commit and files.
#[derive(Debug, Clone)]
pub struct HubRepo {
    pub id: String,
    pub commit: String,
    pub files: BTreeMap<String, Vec<u8>>,
}

impl HubRepo {
    /// Every file of `dir` (not recursive).
    pub fn from_dir(id: &str, dir: &Path) -> Self {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                let name = e.file_name().to_string_lossy().into_owned();
                files.insert(name, std::fs::read(e.path()).unwrap());
            }
        }
        let mut h = Sha256::new();
        h.update(id.as_bytes());
        for (n, b) in &files {
            h.update(n.as_bytes());
            h.update(b);
        }
        let commit = hex(&h.finalize())[..40].to_string();
        HubRepo {
            id: id.to_string(),
            commit,
            files,
        }
    }
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct State {
    repos: Vec<HubRepo>,
    faults: HashMap<String, Fault>,
    /// Files already truncated once.
    truncated: Mutex<Vec<String>>,
    log: Mutex<Vec<String>>,
    stop: Arc<AtomicBool>,
}

pub struct HubServer {
    pub url: String,
    stop: Arc<AtomicBool>,
    state: Arc<State>,
    thread: Option<JoinHandle<()>>,
}

impl HubServer {
    pub fn start(repos: Vec<HubRepo>, faults: &[(&str, Fault)]) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(State {
            repos,
            faults: faults.iter().map(|(f, k)| (f.to_string(), *k)).collect(),
            truncated: Mutex::new(Vec::new()),
            log: Mutex::new(Vec::new()),
            stop: stop.clone(),
        });
        let (stop2, state2) = (stop.clone(), state.clone());
        let thread = std::thread::spawn(move || {
            let born = Instant::now();
            while !stop2.load(Ordering::SeqCst) && born.elapsed() < LIFETIME {
                match listener.accept() {
                    Ok((sock, _)) => {
                        let st = state2.clone();
                        std::thread::spawn(move || {
                            let _ = serve_connection(sock, &st);
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => break,
                }
            }
        });
        HubServer {
            url,
            stop,
            state,
            thread: Some(thread),
        }
    }

    /// Requests so far, as `METHOD path [range]`.
    pub fn log(&self) -> Vec<String> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.state.log.lock().unwrap().clear();
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Request {
    method: String,
    path: String,
    headers: HashMap<String, String>,
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = HashMap::new();
    for _ in 0..100 {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Some(Request {
        method,
        path,
        headers,
    })
}

fn serve_connection(sock: TcpStream, st: &State) -> std::io::Result<()> {
    sock.set_nonblocking(false)?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    sock.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(sock.try_clone()?);
    let mut w = sock;
    for _ in 0..1000 {
        let Some(req) = read_request(&mut reader) else {
            return Ok(());
        };
        let range = req.headers.get("range").cloned();
        let auth = req.headers.get("authorization").cloned();
        st.log.lock().unwrap().push(format!(
            "{} {}{}{}",
            req.method,
            req.path,
            range
                .as_deref()
                .map(|r| format!(" [{r}]"))
                .unwrap_or_default(),
            auth.as_deref()
                .map(|a| format!(" <{a}>"))
                .unwrap_or_default()
        ));
        if !respond(&mut w, st, &req, range.as_deref())? {
            let _ = w.shutdown(Shutdown::Both);
            return Ok(());
        }
    }
    Ok(())
}

fn send(
    w: &mut TcpStream,
    status: &str,
    headers: &[(&str, String)],
    body: &[u8],
    head_only: bool,
) -> std::io::Result<()> {
    let mut s = format!("HTTP/1.1 {status}\r\n");
    for (k, v) in headers {
        s.push_str(&format!("{k}: {v}\r\n"));
    }
    s.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    w.write_all(s.as_bytes())?;
    if !head_only {
        w.write_all(body)?;
    }
    w.flush()
}

fn not_found(w: &mut TcpStream, code: &str, msg: &str) -> std::io::Result<bool> {
    let body = format!("{{\"error\":\"{msg}\"}}");
    send(
        w,
        "404 Not Found",
        &[
            ("Content-Type", "application/json".into()),
            ("X-Error-Code", code.into()),
        ],
        body.as_bytes(),
        false,
    )?;
    Ok(true)
}

/// Answers one request; false when the connection must be closed.
fn respond(
    w: &mut TcpStream,
    st: &State,
    req: &Request,
    range: Option<&str>,
) -> std::io::Result<bool> {
    let head_only = req.method == "HEAD";
    let path = req.path.split('?').next().unwrap_or("");
    // --- model info -------------------------------------------------------
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let (id, rev) = match rest.split_once("/revision/") {
            Some((id, rev)) => (id, rev),
            None => (rest, "main"),
        };
        let Some(repo) = st.repos.iter().find(|r| r.id == id) else {
            return not_found(w, "RepoNotFound", "Repository not found");
        };
        let info_fault = st.faults.get(INFO).copied();
        if rev != "main" && rev != repo.commit && info_fault != Some(Fault::AnyRevision) {
            return not_found(w, "RevisionNotFound", "Invalid rev id");
        }
        let sha = if info_fault == Some(Fault::HostileCommit) {
            "../../../../evil".to_string()
        } else {
            repo.commit.clone()
        };
        let siblings: Vec<serde_json::Value> = repo
            .files
            .iter()
            .map(|(name, bytes)| {
                let mut s = serde_json::json!({"rfilename": name, "size": bytes.len()});
                if bytes.len() >= LFS_MIN {
                    s["lfs"] = serde_json::json!({
                        "sha256": sha256_hex(bytes), "size": bytes.len(), "pointerSize": 134
                    });
                }
                s
            })
            .collect();
        let body = serde_json::json!({
            "id": repo.id, "modelId": repo.id, "sha": sha, "siblings": siblings
        })
        .to_string();
        send(
            w,
            "200 OK",
            &[("Content-Type", "application/json".into())],
            body.as_bytes(),
            head_only,
        )?;
        return Ok(true);
    }
    // --- file download ----------------------------------------------------
    let Some((id, rest)) = path.trim_start_matches('/').split_once("/resolve/") else {
        return not_found(w, "EntryNotFound", "no such route");
    };
    let Some(repo) = st.repos.iter().find(|r| r.id == id) else {
        return not_found(w, "RepoNotFound", "Repository not found");
    };
    let Some((rev, file)) = rest.split_once('/') else {
        return not_found(w, "EntryNotFound", "no file");
    };
    if rev != "main" && rev != repo.commit && st.faults.get(INFO) != Some(&Fault::AnyRevision) {
        return not_found(w, "RevisionNotFound", "Invalid rev id");
    }
    let Some(bytes) = repo.files.get(file) else {
        return not_found(w, "EntryNotFound", "Entry not found");
    };
    let fault = st.faults.get(file).copied();
    if fault == Some(Fault::RedirectLoop) {
        send(
            w,
            "302 Found",
            &[("Location", req.path.clone())],
            b"",
            head_only,
        )?;
        return Ok(true);
    }
    let mut data = bytes.clone();
    if fault == Some(Fault::Corrupt) {
        let mid = data.len() / 2;
        data[mid] ^= 0x5a;
    }
    let total = data.len();
    let sha = sha256_hex(bytes);
    let commit = if fault == Some(Fault::HostileCommit) {
        "../../../../evil".to_string()
    } else {
        repo.commit.clone()
    };
    let mut headers = vec![
        ("x-repo-commit", commit),
        ("Accept-Ranges", "bytes".to_string()),
        ("Content-Type", "application/octet-stream".to_string()),
    ];
    if fault == Some(Fault::HostileEtag) {
        if bytes.len() >= LFS_MIN {
            headers.push(("x-linked-etag", "\"../../../../x\"".to_string()));
            headers.push(("x-linked-size", total.to_string()));
        }
        headers.push(("ETag", "\"../../../../x\"".to_string()));
    } else if bytes.len() >= LFS_MIN {
        headers.push(("x-linked-etag", format!("\"{sha}\"")));
        headers.push(("x-linked-size", total.to_string()));
        headers.push(("ETag", format!("\"{}\"", &sha[..40])));
    } else {
        headers.push(("ETag", format!("\"{}\"", &sha[..40])));
    }
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(spec) => {
            let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
            let a: usize = a.parse().unwrap_or(0);
            let b: usize = if b.is_empty() {
                total.saturating_sub(1)
            } else {
                b.parse().unwrap_or(total - 1).min(total.saturating_sub(1))
            };
            (a, b + 1)
        }
        None => (0, total),
    };
    if start >= end.max(1) && total > 0 {
        send(
            w,
            "416 Range Not Satisfiable",
            &[("Content-Range", format!("bytes */{total}"))],
            b"",
            head_only,
        )?;
        return Ok(true);
    }
    let status = if range.is_some() {
        headers.push((
            "Content-Range",
            format!("bytes {start}-{}/{total}", end - 1),
        ));
        "206 Partial Content"
    } else {
        "200 OK"
    };
    let body = &data[start..end];
    // A metadata probe (bytes=0-0) is never cut; a body may be.
    let cut = body.len() > 1
        && !head_only
        && match fault {
            Some(Fault::TruncateAlways) => true,
            Some(Fault::TruncateOnce) => {
                let mut done = st.truncated.lock().unwrap();
                if done.iter().any(|f| f == file) {
                    false
                } else {
                    done.push(file.to_string());
                    true
                }
            }
            _ => false,
        };
    let probe = body.len() <= 1 || head_only;
    if !probe && fault == Some(Fault::Overlong) {
        let mut s = format!("HTTP/1.1 {status}\r\n");
        for (k, v) in &headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        s.push_str("Connection: close\r\n\r\n");
        w.write_all(s.as_bytes())?;
        w.write_all(body)?;
        let junk = vec![0x42u8; 1 << 20];
        let mut sent = body.len();
        while sent < OVERLONG_CAP {
            w.write_all(&junk)?;
            sent += junk.len();
        }
        return Ok(false);
    }
    let stall = !probe && fault == Some(Fault::StallOnce) && {
        let mut done = st.truncated.lock().unwrap();
        if done.iter().any(|f| f == file) {
            false
        } else {
            done.push(file.to_string());
            true
        }
    };
    if stall {
        let mut s = format!("HTTP/1.1 {status}\r\n");
        for (k, v) in &headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        s.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        w.write_all(s.as_bytes())?;
        w.write_all(&body[..body.len() / 2])?;
        w.flush()?;
        let since = Instant::now();
        while since.elapsed() < STALL && !st.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
        }
        return Ok(false);
    }
    if !probe && fault == Some(Fault::Slow) {
        let mut s = format!("HTTP/1.1 {status}\r\n");
        for (k, v) in &headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        s.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        w.write_all(s.as_bytes())?;
        for piece in body.chunks(64 << 10) {
            w.write_all(piece)?;
            w.flush()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        return Ok(true);
    }
    if cut {
        let mut s = format!("HTTP/1.1 {status}\r\n");
        for (k, v) in &headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        s.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        ));
        w.write_all(s.as_bytes())?;
        w.write_all(&body[..body.len() / 2])?;
        w.flush()?;
        return Ok(false);
    }
    send(w, status, &headers, body, head_only)?;
    Ok(true)
}
