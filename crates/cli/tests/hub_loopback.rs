//! Downloads through the CLI's Hub client from a Hub look-alike on loopback
//! (HF_ENDPOINT), into a temporary HF_HOME: a clean download, a warm cache,
//! offline runs, sharded checkpoints, truncated and corrupt transfers, a
//! damaged cache, an unknown model and no network; and a hostile or broken
//! server or cache: path-like ETag and commit values, an escaping
//! `--revision`, a stalled body, an over-long body, a redirect loop, two
//! downloads of one file at once, held and stale locks, and a cached link
//! to a file outside the cache.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::hub_server::{sha256_hex, Fault, HubRepo, HubServer, INFO};
use support::{qwen_mk, tiny_model, tokenizer_fixture, write_tiny_model, Run};

const ID: &str = "tiny-org/tiny-qwen";

fn generate(model: &str, endpoint: &str, home: &Path, offline: bool) -> Run {
    generate_env(model, endpoint, home, offline, &[])
}

/// `generate` with `extra` environment; retries follow each other quickly.
fn generate_env(
    model: &str,
    endpoint: &str,
    home: &Path,
    offline: bool,
    extra: &[(&str, &str)],
) -> Run {
    generate_rev(model, "main", endpoint, home, offline, extra)
}

fn generate_rev(
    model: &str,
    revision: &str,
    endpoint: &str,
    home: &Path,
    offline: bool,
    extra: &[(&str, &str)],
) -> Run {
    let home = home.to_str().unwrap();
    let mut env = vec![
        ("HF_ENDPOINT", endpoint),
        ("HF_HOME", home),
        ("QMK_HUB_RETRY_DELAY_MS", "10"),
    ];
    if offline {
        env.push(("HF_HUB_OFFLINE", "1"));
    }
    env.extend_from_slice(extra);
    qwen_mk(
        &[
            "generate",
            "--model",
            model,
            "--revision",
            revision,
            "--prompt",
            "Hi",
            "--backend",
            "cpu",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--temperature",
            "0",
            "--json",
        ],
        &env,
        "",
        Duration::from_secs(120),
    )
}

/// The output of the same run from the local directory.
fn local_output() -> serde_json::Value {
    let m = tiny_model().unwrap().to_str().unwrap();
    let r = generate(m, "http://127.0.0.1:9", Path::new("/nonexistent"), true);
    r.assert_ok();
    let mut j = r.json();
    j.as_object_mut()
        .unwrap()
        .retain(|k, _| k == "prompt_ids" || k == "output_ids");
    j
}

fn ids(r: &Run) -> serde_json::Value {
    let mut j = r.json();
    j.as_object_mut()
        .unwrap()
        .retain(|k, _| k == "prompt_ids" || k == "output_ids");
    j
}

fn snapshot(home: &Path, repo: &HubRepo) -> PathBuf {
    home.join("hub")
        .join(format!("models--{}", repo.id.replace('/', "--")))
        .join("snapshots")
        .join(&repo.commit)
}

fn resolves(server: &HubServer) -> usize {
    server
        .log()
        .iter()
        .filter(|l| l.contains("/resolve/"))
        .count()
}

#[test]
fn clean_download_then_warm_cache_then_offline() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();

    let r = generate(ID, &server.url, home.path(), false);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    assert_eq!(r.json()["model"], ID);
    let log = server.log();
    assert!(
        log[0].starts_with("GET /api/models/tiny-org/tiny-qwen/revision/main"),
        "{log:#?}"
    );
    // Every file hf-hub fetched is byte-identical to the repo's.
    let snap = snapshot(home.path(), &repo);
    for name in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "generation_config.json",
    ] {
        let got = std::fs::read(snap.join(name)).unwrap();
        assert_eq!(sha256_hex(&got), sha256_hex(&repo.files[name]), "{name}");
    }

    // Warm cache: only the model info is asked for.
    server.clear_log();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    assert_eq!(resolves(&server), 0, "{:#?}", server.log());

    // Offline with the cache: no request at all.
    server.clear_log();
    let r = generate(ID, &server.url, home.path(), true);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    assert!(server.log().is_empty(), "{:#?}", server.log());

    // Network gone, cache warm: falls back to the cache, saying so.
    let r = generate(ID, "http://127.0.0.1:9", home.path(), false);
    r.assert_ok();
    assert!(r.stderr.contains("using the cached copy"), "{r:#?}");
}

#[test]
fn sharded_checkpoint_and_revision() {
    let Some(tok) = tokenizer_fixture() else {
        return;
    };
    let src = tempfile::tempdir().unwrap();
    write_tiny_model(src.path(), &tok, Some(3 << 20));
    assert!(src.path().join("model.safetensors.index.json").is_file());
    let repo = HubRepo::from_dir("tiny-org/sharded", src.path());
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();
    let r = generate("tiny-org/sharded", &server.url, home.path(), false);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    let shards = server
        .log()
        .iter()
        .filter(|l| l.contains("-of-") && l.contains("/resolve/"))
        .count();
    assert!(shards >= 2, "{:#?}", server.log());

    // An explicit commit works; an unknown revision is a clear error.
    let home2 = tempfile::tempdir().unwrap();
    let env = [
        ("HF_ENDPOINT", server.url.as_str()),
        ("HF_HOME", home2.path().to_str().unwrap()),
    ];
    let args = |rev: &'static str| -> Vec<String> {
        [
            "generate",
            "--model",
            "tiny-org/sharded",
            "--revision",
            rev,
            "--prompt",
            "Hi",
            "--backend",
            "cpu",
            "--max-new-tokens",
            "2",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let commit: &'static str = Box::leak(repo.commit.clone().into_boxed_str());
    let a = args(commit);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    qwen_mk(&a, &env, "", Duration::from_secs(120)).assert_ok();
    let a = args("no-such-tag");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    qwen_mk(&a, &env, "", Duration::from_secs(120))
        .assert_error(&["tiny-org/sharded", "no revision `no-such-tag`"]);
}

#[test]
fn truncated_transfer_is_resumed() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(
        vec![repo.clone()],
        &[("model.safetensors", Fault::TruncateOnce)],
    );
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    // The second transfer asked only for the missing tail.
    let resumed = server
        .log()
        .iter()
        .any(|l| l.contains("model.safetensors [bytes=") && !l.contains("[bytes=0-"));
    assert!(resumed, "{:#?}", server.log());
}

#[test]
fn always_truncated_file_is_an_error_and_never_loaded() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(
        vec![repo.clone()],
        &[("model.safetensors", Fault::TruncateAlways)],
    );
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_error(&["model.safetensors", ID, "cannot download"]);
    assert!(!snapshot(home.path(), &repo)
        .join("model.safetensors")
        .exists());
}

#[test]
fn corrupt_file_is_refetched_then_refused_and_deleted() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[("model.safetensors", Fault::Corrupt)]);
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_error(&["model.safetensors", "sha256", "deleted"]);
    assert!(!snapshot(home.path(), &repo)
        .join("model.safetensors")
        .exists());
    let blob = home
        .path()
        .join("hub/models--tiny-org--tiny-qwen/blobs")
        .join(sha256_hex(&repo.files["model.safetensors"]));
    assert!(!blob.exists());
    let fetches = server
        .log()
        .iter()
        .filter(|l| l.contains("model.safetensors") && !l.contains("bytes=0-0"))
        .count();
    assert!(
        fetches >= 2,
        "fetched again before giving up: {:#?}",
        server.log()
    );
}

#[test]
fn damaged_cache_is_detected_and_repaired() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();
    generate(ID, &server.url, home.path(), false).assert_ok();
    // Flip one byte of the cached weights, keeping the size.
    let path = snapshot(home.path(), &repo).join("model.safetensors");
    let blob = std::fs::canonicalize(&path).unwrap();
    let mut bytes = std::fs::read(&blob).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&blob, &bytes).unwrap();

    // Offline: reported, not loaded.
    generate(ID, &server.url, home.path(), true).assert_error(&["model.safetensors", "sha256"]);
    // Online: fetched again, and right.
    server.clear_log();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    assert!(r.stderr.contains("damaged"), "{r:#?}");
    assert!(resolves(&server) >= 1);
}

#[test]
fn offline_cache_miss_is_an_error() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(vec![HubRepo::from_dir(ID, m)], &[]);
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), true);
    r.assert_error(&["HF_HUB_OFFLINE", ID, "not in the Hub cache"]);
    assert!(
        server.log().is_empty(),
        "offline means no request: {:#?}",
        server.log()
    );
}

#[test]
fn unknown_model_is_an_error() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(vec![HubRepo::from_dir(ID, m)], &[]);
    let home = tempfile::tempdir().unwrap();
    let r = generate("tiny-org/no-such-model", &server.url, home.path(), false);
    r.assert_error(&["tiny-org/no-such-model", "not found"]);
}

#[test]
fn no_network_is_an_error() {
    if tiny_model().is_none() {
        return;
    }
    // A port nobody listens on: bind, note, close.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let home = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let r = generate(ID, &endpoint, home.path(), false);
    r.assert_error(&["cannot reach", &endpoint, "HF_HUB_OFFLINE"]);
}

#[test]
fn download_command_prints_or_copies_the_model() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let env = [
        ("HF_ENDPOINT", server.url.as_str()),
        ("HF_HOME", home.path().to_str().unwrap()),
    ];
    let r = qwen_mk(
        &["download", "--model", ID],
        &env,
        "",
        Duration::from_secs(120),
    );
    r.assert_ok();
    assert_eq!(PathBuf::from(r.stdout.trim()), snapshot(home.path(), &repo));
    let dest = out.path().join("copy");
    let r = qwen_mk(
        &["download", "--model", ID, "--out", dest.to_str().unwrap()],
        &env,
        "",
        Duration::from_secs(120),
    );
    r.assert_ok();
    for (name, bytes) in &repo.files {
        assert_eq!(&std::fs::read(dest.join(name)).unwrap(), bytes, "{name}");
    }
    // The copy is a plain local model directory.
    let g = generate(
        dest.to_str().unwrap(),
        "http://127.0.0.1:9",
        Path::new("/nonexistent"),
        true,
    );
    g.assert_ok();
    assert_eq!(ids(&g), local_output());
}

#[test]
fn hf_token_is_sent() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(vec![HubRepo::from_dir(ID, m)], &[]);
    let home = tempfile::tempdir().unwrap();
    let env = [
        ("HF_ENDPOINT", server.url.as_str()),
        ("HF_HOME", home.path().to_str().unwrap()),
        ("HF_TOKEN", "hf_test_secret"),
    ];
    qwen_mk(
        &["download", "--model", ID],
        &env,
        "",
        Duration::from_secs(120),
    )
    .assert_ok();
    let log = server.log();
    assert!(!log.is_empty());
    assert!(
        log.iter().all(|l| l.ends_with("<Bearer hf_test_secret>")),
        "{log:#?}"
    );
}

/// Every path under `dir`, links not followed.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.symlink_metadata().unwrap().is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// The names directly in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Requests for `file`'s bytes (not the one-byte probes).
fn body_requests(server: &HubServer, file: &str) -> usize {
    server
        .log()
        .iter()
        .filter(|l| l.contains(&format!("/{file}")) && !l.contains("[bytes=0-0]"))
        .count()
}

fn repo_dir(home: &Path) -> PathBuf {
    home.join("hub/models--tiny-org--tiny-qwen")
}

#[test]
fn hostile_etag_writes_nothing_outside_the_cache() {
    let Some(m) = tiny_model() else { return };
    // config.json is a plain git file (ETag), model.safetensors an LFS one
    // (X-Linked-Etag).
    for file in ["config.json", "model.safetensors"] {
        let repo = HubRepo::from_dir(ID, m);
        let server = HubServer::start(vec![repo], &[(file, Fault::HostileEtag)]);
        let top = tempfile::tempdir().unwrap();
        let home = top.path().join("home");
        let r = generate(ID, &server.url, &home, false);
        r.assert_error(&[file, "ETag", "../../../../x", "not a file hash"]);
        // Refused before the cache was even created, or inside it.
        assert!(names(top.path()).iter().all(|n| n == "home"), "{file}");
        let stray: Vec<PathBuf> = walk(&home)
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains('x') && n.len() <= 6)
            })
            .collect();
        assert!(stray.is_empty(), "{stray:?}");
        assert!(!snapshot_dir(&home).join(file).exists());
    }
}

fn snapshot_dir(home: &Path) -> PathBuf {
    repo_dir(home).join("snapshots")
}

#[test]
fn hostile_commit_values_write_nothing_outside_the_cache() {
    let Some(m) = tiny_model() else { return };
    // In the resolve answer's X-Repo-Commit, and as the model info's sha.
    let cases = [
        (
            "config.json",
            &["config.json", "X-Repo-Commit", "not a commit id"][..],
        ),
        (INFO, &["../../../../evil", "not a commit id"][..]),
    ];
    for (key, needles) in cases {
        let server = HubServer::start(
            vec![HubRepo::from_dir(ID, m)],
            &[(key, Fault::HostileCommit)],
        );
        let top = tempfile::tempdir().unwrap();
        let home = top.path().join("home");
        let r = generate(ID, &server.url, &home, false);
        r.assert_error(needles);
        assert!(names(top.path()).iter().all(|n| n == "home"), "{key}");
        let evil: Vec<PathBuf> = walk(&home)
            .into_iter()
            .filter(|p| p.to_string_lossy().contains("evil"))
            .collect();
        assert!(evil.is_empty(), "{evil:?}");
    }
}

#[test]
fn revision_escaping_the_cache_is_refused_before_any_request() {
    let Some(m) = tiny_model() else { return };
    // A permissive mirror answers any revision name.
    let server = HubServer::start(
        vec![HubRepo::from_dir(ID, m)],
        &[(INFO, Fault::AnyRevision)],
    );
    let top = tempfile::tempdir().unwrap();
    let home = top.path().join("home");
    // An absolute revision would make `refs/<rev>` that very path.
    let absolute = top.path().join("abs-escape");
    let absolute = absolute.to_str().unwrap();
    for rev in ["../../../../escape", absolute, "a/../../escape", "a\\b"] {
        for offline in [false, true] {
            let r = generate_rev(ID, rev, &server.url, &home, offline, &[]);
            r.assert_usage_error(&["--revision", "not a branch, tag or commit"]);
        }
    }
    assert!(server.log().is_empty(), "{:#?}", server.log());
    // Nothing at all was written: no `escape`, no `abs-escape`, no HF_HOME.
    assert!(names(top.path()).is_empty(), "{:?}", names(top.path()));
    // A proper branch name still goes through the same mirror.
    generate_rev(ID, "some-branch", &server.url, &home, false, &[]).assert_ok();
    assert!(repo_dir(&home).join("refs/some-branch").is_file());
}

#[test]
fn stalled_body_times_out_and_is_resumed() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo], &[("model.safetensors", Fault::StallOnce)]);
    let home = tempfile::tempdir().unwrap();
    let r = generate_env(
        ID,
        &server.url,
        home.path(),
        false,
        &[("QMK_HUB_READ_TIMEOUT_MS", "300")],
    );
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
    assert!(r.stderr.contains("no data for 300 ms"), "{r:#?}");
    // The retry asked only for the missing tail.
    let resumed = server
        .log()
        .iter()
        .any(|l| l.contains("model.safetensors [bytes=") && !l.contains("[bytes=0-"));
    assert!(resumed, "{:#?}", server.log());
}

#[test]
fn body_longer_than_announced_is_cut_off_and_deleted() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(
        vec![HubRepo::from_dir(ID, m)],
        &[("model.safetensors", Fault::Overlong)],
    );
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_error(&[
        "model.safetensors",
        "more than the",
        "bytes announced",
        "deleted",
    ]);
    // Not retried: one transfer, and nothing of it left in the cache.
    assert_eq!(
        body_requests(&server, "model.safetensors"),
        1,
        "{:#?}",
        server.log()
    );
    let sha = sha256_hex(&HubRepo::from_dir(ID, m).files["model.safetensors"]);
    let left: Vec<PathBuf> = walk(&repo_dir(home.path()).join("blobs"))
        .into_iter()
        .filter(|p| {
            p.to_string_lossy().contains(&sha) || p.to_string_lossy().ends_with(".incomplete")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(!snapshot(home.path(), &HubRepo::from_dir(ID, m))
        .join("model.safetensors")
        .exists());
}

#[test]
fn redirect_loop_is_followed_a_bounded_number_of_times() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(
        vec![HubRepo::from_dir(ID, m)],
        &[("config.json", Fault::RedirectLoop)],
    );
    let home = tempfile::tempdir().unwrap();
    let r = generate(ID, &server.url, home.path(), false);
    r.assert_error(&["config.json", "more than 10 redirects"]);
    // The first request and ten redirects, not retried.
    assert_eq!(body_requests(&server, "config.json"), 0);
    let asked = server
        .log()
        .iter()
        .filter(|l| l.contains("/config.json"))
        .count();
    assert_eq!(asked, 11, "{:#?}", server.log());
}

#[test]
fn concurrent_downloads_of_one_model_share_one_transfer() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    // Slow enough that the two runs overlap.
    let server = HubServer::start(vec![repo.clone()], &[("model.safetensors", Fault::Slow)]);
    let home = tempfile::tempdir().unwrap();
    let env = [
        ("HF_ENDPOINT", server.url.as_str()),
        ("HF_HOME", home.path().to_str().unwrap()),
    ];
    let runs: Vec<Run> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    qwen_mk(
                        &["download", "--model", ID],
                        &env,
                        "",
                        Duration::from_secs(120),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &runs {
        r.assert_ok();
        assert_eq!(PathBuf::from(r.stdout.trim()), snapshot(home.path(), &repo));
        eprintln!("{}", r.stderr);
    }
    for (name, bytes) in &repo.files {
        let got = std::fs::read(snapshot(home.path(), &repo).join(name)).unwrap();
        assert_eq!(&got, bytes, "{name}");
    }
    assert_eq!(
        body_requests(&server, "model.safetensors"),
        1,
        "{:#?}",
        server.log()
    );
}

#[test]
fn timeout_settings_that_are_not_numbers_are_errors_naming_them() {
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(vec![HubRepo::from_dir(ID, m)], &[]);
    let home = tempfile::tempdir().unwrap();
    for var in [
        "QMK_HUB_CONNECT_TIMEOUT_MS",
        "QMK_HUB_READ_TIMEOUT_MS",
        "QMK_HUB_RETRIES",
        "QMK_HUB_RETRY_DELAY_MS",
        "QMK_HUB_LOCK_WAIT_MS",
    ] {
        let r = generate_env(ID, &server.url, home.path(), false, &[(var, "3s")]);
        r.assert_error(&[var, "\"3s\"", "not a whole number"]);
    }
    assert!(server.log().is_empty(), "{:#?}", server.log());
}

/// Takes the lock `qwen-mk` takes for `file`'s blob, as another downloader
/// (huggingface_hub's filelock takes the same one) would.
#[cfg(unix)]
fn hold_lock(home: &Path, repo: &HubRepo, file: &str) -> std::fs::File {
    use std::os::unix::io::AsRawFd;
    let dir = home.join("hub/.locks/models--tiny-org--tiny-qwen");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.lock", sha256_hex(&repo.files[file])));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    // SAFETY: flock on a descriptor owned by `f`.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(r, 0);
    f
}

#[cfg(unix)]
#[test]
fn held_lock_is_waited_for_and_the_other_process_file_is_used() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();
    let sha = sha256_hex(&repo.files["model.safetensors"]);
    let blobs = repo_dir(home.path()).join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();

    // Held beyond a short bound: an error naming the lock, and the other
    // process's partial file is left alone.
    let part = blobs.join(format!("{sha}.incomplete"));
    std::fs::write(&part, b"another process's first bytes").unwrap();
    let lock = hold_lock(home.path(), &repo, "model.safetensors");
    let r = generate_env(
        ID,
        &server.url,
        home.path(),
        false,
        &[("QMK_HUB_LOCK_WAIT_MS", "200")],
    );
    r.assert_error(&["model.safetensors", "another process", ".lock"]);
    assert_eq!(
        std::fs::read(&part).unwrap(),
        b"another process's first bytes"
    );
    assert_eq!(body_requests(&server, "model.safetensors"), 0);

    // Held while the run starts, then the holder finishes: the run waits
    // and uses that file without fetching it.
    server.clear_log();
    std::thread::scope(|s| {
        let run = s.spawn(|| {
            generate_env(
                ID,
                &server.url,
                home.path(),
                false,
                &[("QMK_HUB_LOCK_WAIT_MS", "120000")],
            )
        });
        // The run asks about the file just before it takes the lock.
        for _ in 0..6000 {
            if server
                .log()
                .iter()
                .any(|l| l.contains("model.safetensors [bytes=0-0]"))
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(500));
        std::fs::remove_file(&part).unwrap();
        std::fs::write(blobs.join(&sha), &repo.files["model.safetensors"]).unwrap();
        drop(lock);
        let r = run.join().unwrap();
        r.assert_ok();
        assert_eq!(ids(&r), local_output());
        eprintln!("{}", r.stderr);
    });
    assert_eq!(
        body_requests(&server, "model.safetensors"),
        0,
        "{:#?}",
        server.log()
    );
}

#[test]
fn stale_lock_of_a_dead_process_does_not_block() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let home = tempfile::tempdir().unwrap();
    // A lock file left by a process that died: present, but not held.
    let dir = home.path().join("hub/.locks/models--tiny-org--tiny-qwen");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::write(
            dir.join(format!("{}.lock", sha256_hex(&repo.files[f]))),
            "pid 4194303 since 0 s after the epoch",
        )
        .unwrap();
    }
    let r = generate_env(
        ID,
        &server.url,
        home.path(),
        false,
        &[("QMK_HUB_LOCK_WAIT_MS", "0")],
    );
    r.assert_ok();
    assert_eq!(ids(&r), local_output());
}

#[cfg(unix)]
#[test]
fn damaged_link_to_a_file_outside_the_cache_never_deletes_that_file() {
    let Some(m) = tiny_model() else { return };
    let repo = HubRepo::from_dir(ID, m);
    let server = HubServer::start(vec![repo.clone()], &[]);
    let top = tempfile::tempdir().unwrap();
    let home = top.path().join("home");
    generate(ID, &server.url, &home, false).assert_ok();
    let victim = top.path().join("precious.bin");
    let sha = sha256_hex(&repo.files["model.safetensors"]);
    let snap_entry = snapshot(&home, &repo).join("model.safetensors");
    let blob = repo_dir(&home).join("blobs").join(&sha);
    // The snapshot entry itself links outside; then the blob does.
    for link in [&snap_entry, &blob] {
        std::fs::write(&victim, b"the user's own file").unwrap();
        if link == &blob {
            std::fs::remove_file(&blob).unwrap();
            // Not the verified blob any more: a new mtime.
        }
        let _ = std::fs::remove_file(link);
        std::os::unix::fs::symlink(&victim, link).unwrap();

        generate(ID, &server.url, &home, true).assert_error(&["model.safetensors"]);
        assert_eq!(std::fs::read(&victim).unwrap(), b"the user's own file");

        let r = generate(ID, &server.url, &home, false);
        r.assert_ok();
        assert_eq!(ids(&r), local_output());
        assert!(r.stderr.contains("damaged"), "{r:#?}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"the user's own file");
        assert_eq!(
            std::fs::read(&snap_entry).unwrap(),
            repo.files["model.safetensors"]
        );
    }
}

/// True when this process can create files in `dir` despite its mode (root
/// ignores permission bits).
#[cfg(unix)]
fn mode_is_ignored(dir: &Path) -> bool {
    let probe = dir.join(".probe");
    let ok = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

#[cfg(unix)]
#[test]
fn an_unwritable_cache_is_an_error_naming_the_path() {
    use std::os::unix::fs::PermissionsExt;
    let Some(m) = tiny_model() else { return };
    let server = HubServer::start(vec![HubRepo::from_dir(ID, m)], &[]);
    let top = tempfile::tempdir().unwrap();
    // HF_HOME below a regular file: every directory under it fails to be
    // created (ENOTDIR), whoever runs the test.
    let file = top.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let home = file.join("hf");
    let r = generate(ID, &server.url, &home, false);
    r.assert_error(&[home.to_str().unwrap(), "Not a directory"]);
    // A read-only HF_HOME ("Permission denied" without a path, before).
    let ro = top.path().join("read-only");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if mode_is_ignored(&ro) {
        eprintln!("SKIP: running as root, a read-only directory is writable here");
        return;
    }
    let r = generate(ID, &server.url, &ro, false);
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    r.assert_error(&[ro.to_str().unwrap(), "Permission denied"]);
}
