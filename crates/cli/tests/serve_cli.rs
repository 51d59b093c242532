//! `qwen-mk serve` as a process, on the tiny model (CPU): it prints the
//! address it bound, answers over a real socket, logs one line per request
//! unless `--quiet`, and refuses bad flags (exit 2) and a busy port (exit 1)
//! with one error line. The client suite on the real model is
//! `serve_openai.rs`.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::time::Duration;

use support::{command, run, tiny_model};

/// Only a guard against a hang.
const HANG_GUARD: Duration = Duration::from_secs(300);

/// A running server; killed when dropped.
struct Serve {
    child: Child,
    addr: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &str, extra: &[&str]) -> Serve {
    let mut args = vec![
        "serve",
        "--model",
        model,
        "--backend",
        "cpu",
        "--port",
        "0",
        "--context",
        "64",
    ];
    args.extend_from_slice(extra);
    let mut child = command(&args, &[])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qwen-mk serve");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(HANG_GUARD)
        .expect("the server printed its address");
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_string();
    Serve { child, addr }
}

/// One HTTP/1.1 request; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap();
    (status, body)
}

/// The server's stderr so far (it is killed first).
fn stderr_of(mut s: Serve) -> String {
    let _ = s.child.kill();
    let _ = s.child.wait();
    let mut err = String::new();
    s.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

#[test]
fn serves_over_a_socket_and_logs_each_request_unless_quiet() {
    let Some(model) = tiny_model() else {
        eprintln!("SKIP: no tokenizer fixture");
        return;
    };
    let model = model.to_str().unwrap();
    for quiet in [false, true] {
        let s = serve(model, if quiet { &["--quiet"] } else { &[] });
        let (status, body) = http(&s.addr, "GET", "/health", "");
        assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
        let (status, body) = http(
            &s.addr,
            "POST",
            "/v1/completions",
            r#"{"prompt": "Hi", "max_tokens": 3, "temperature": 0}"#,
        );
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 3);
        let (status, _) = http(&s.addr, "POST", "/v1/completions", "{oops");
        assert_eq!(status, 400);
        let err = stderr_of(s);
        let logged = err
            .lines()
            .filter(|l| l.contains("cmpl-") && l.contains("time to first token"))
            .count();
        assert_eq!(logged, usize::from(!quiet), "quiet={quiet}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn bad_flags_and_a_busy_port_are_one_error_line() {
    run(&["serve", "--model", "x", "--max-queue", "0"]).assert_usage_error(&["--max-queue"]);
    run(&["serve", "--model", "x", "--port", "70000"]).assert_usage_error(&["--port"]);
    let Some(model) = tiny_model() else {
        eprintln!("SKIP: no tokenizer fixture");
        return;
    };
    let model = model.to_str().unwrap();
    run(&[
        "serve",
        "--model",
        model,
        "--backend",
        "cpu",
        "--context",
        "999999999",
    ])
    .assert_error(&["--context 999999999"]);
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let args = [
        "serve",
        "--model",
        model,
        "--backend",
        "cpu",
        "--context",
        "64",
        "--port",
        &port,
        "-q",
    ];
    run(&args).assert_error(&["cannot listen on 127.0.0.1:", &port]);
}
