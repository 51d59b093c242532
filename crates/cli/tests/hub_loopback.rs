//! Downloads through the real hf-hub client from a Hub look-alike on
//! loopback (HF_ENDPOINT), into a temporary HF_HOME: a clean download, a
//! warm cache, offline runs, sharded checkpoints, truncated and corrupt
//! transfers, a damaged cache, an unknown model and no network.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::hub_server::{sha256_hex, Fault, HubRepo, HubServer};
use support::{qwen_mk, tiny_model, tokenizer_fixture, write_tiny_model, Run};

const ID: &str = "tiny-org/tiny-qwen";

fn generate(model: &str, endpoint: &str, home: &Path, offline: bool) -> Run {
    let home = home.to_str().unwrap();
    let mut env = vec![("HF_ENDPOINT", endpoint), ("HF_HOME", home)];
    if offline {
        env.push(("HF_HUB_OFFLINE", "1"));
    }
    qwen_mk(
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "Hi",
            "--backend",
            "cpu",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
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
    let a = args("v9.9");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    qwen_mk(&a, &env, "", Duration::from_secs(120))
        .assert_error(&["tiny-org/sharded", "no revision `v9.9`"]);
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
