//! The server end to end over a scripted backend: every endpoint's shape,
//! streaming, tool calls, the key check, error statuses, the queue limit,
//! cancellation by a client that goes away, and a backend failure turning
//! the server unhealthy. Requests go straight into the application (no
//! socket); the backend replays a fixed reply, and a gate lets a test hold
//! the engine inside a step, so nothing depends on timing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use qmk_engine::{Backend, BackendKind, Engine, StepOutput};
use qmk_model::chat::ChatTemplate;
use qmk_model::tokenizer::Tokenizer;
use qmk_server::{ModelInfo, Server, ServerConfig};
use serde_json::{json, Value};
use tower::ServiceExt;

const VOCAB: usize = 151_936;
const IM_END: u32 = 151_645;
const MODEL: &str = "test-model";
/// Longest any test waits on the gate: only a guard against a hang.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn tokenizer_dir() -> String {
    format!(
        "{}/../model/tests/data/qwen-tokenizer",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(tokenizer_dir()).unwrap()
}

/// Holds the engine inside a step until the test lets it go on.
#[derive(Default)]
struct Gate {
    /// (permits left, steps waiting); `None` permits: open.
    state: Mutex<(Option<usize>, usize)>,
    cv: Condvar,
}

impl Gate {
    fn closed() -> Arc<Gate> {
        let g = Gate::default();
        g.state.lock().unwrap().0 = Some(0);
        Arc::new(g)
    }

    fn pass(&self) {
        let mut s = self.state.lock().unwrap();
        s.1 += 1;
        self.cv.notify_all();
        while s.0 == Some(0) {
            let (next, timeout) = self.cv.wait_timeout(s, HANG_GUARD).unwrap();
            s = next;
            assert!(!timeout.timed_out(), "the gate was never opened");
        }
        if let Some(p) = s.0.as_mut() {
            *p -= 1;
        }
        s.1 -= 1;
        self.cv.notify_all();
    }

    fn allow(&self, n: usize) {
        let mut s = self.state.lock().unwrap();
        if let Some(p) = s.0.as_mut() {
            *p += n;
        }
        self.cv.notify_all();
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = None;
        self.cv.notify_all();
    }

    /// Waits until a step is blocked at the gate.
    fn wait_blocked(&self) {
        let s = self.state.lock().unwrap();
        let (_s, timeout) = self
            .cv
            .wait_timeout_while(s, HANG_GUARD, |s| s.1 == 0)
            .unwrap();
        assert!(!timeout.timed_out(), "no step reached the gate");
    }
}

/// Replays `reply` token by token (greedy picks and logits agree), counts
/// the steps of each generation, and can fail at a given step.
struct Scripted {
    reply: Vec<u32>,
    next: usize,
    capacity: usize,
    gate: Option<Arc<Gate>>,
    /// Steps run by each generation (prefill counts as one).
    steps: Arc<Mutex<Vec<usize>>>,
    fail_at_step: Option<usize>,
    panic_at_step: Option<usize>,
    total: Arc<AtomicUsize>,
}

#[derive(Debug, thiserror::Error)]
#[error("device lost (scripted)")]
struct Lost;

impl Scripted {
    fn advance(&mut self) -> Result<StepOutput, Lost> {
        if let Some(g) = &self.gate {
            g.pass();
        }
        let n = self.total.fetch_add(1, Ordering::SeqCst);
        if self.fail_at_step == Some(n) {
            return Err(Lost);
        }
        if self.panic_at_step == Some(n) {
            panic!("scripted panic");
        }
        if let Some(last) = self.steps.lock().unwrap().last_mut() {
            *last += 1;
        }
        let tok = self.reply[self.next.min(self.reply.len() - 1)];
        self.next += 1;
        Ok(StepOutput { argmax: tok })
    }
}

impl Backend for Scripted {
    type Error = Lost;
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn step(&mut self, _token: u32, _pos: usize) -> Result<StepOutput, Lost> {
        self.advance()
    }
    fn prefill(&mut self, _tokens: &[u32], _start: usize) -> Result<StepOutput, Lost> {
        self.advance()
    }
    fn logits(&mut self) -> Result<Vec<f32>, Lost> {
        let mut l = vec![0.0; VOCAB];
        l[self.reply[(self.next.max(1) - 1).min(self.reply.len() - 1)] as usize] = 30.0;
        Ok(l)
    }
    fn reset(&mut self) -> Result<(), Lost> {
        self.next = 0;
        self.steps.lock().unwrap().push(0);
        Ok(())
    }
}

struct Setup {
    reply: String,
    end_of_turn: bool,
    capacity: usize,
    config: ServerConfig,
    gate: Option<Arc<Gate>>,
    fail_at_step: Option<usize>,
    panic_at_step: Option<usize>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            reply: "Hello there, friend! How can I help?".into(),
            end_of_turn: true,
            capacity: 512,
            config: ServerConfig::default(),
            gate: None,
            fail_at_step: None,
            panic_at_step: None,
        }
    }
}

struct Harness {
    app: Router,
    steps: Arc<Mutex<Vec<usize>>>,
    runtime: tokio::runtime::Runtime,
}

fn harness(setup: Setup) -> Harness {
    let tok = tokenizer();
    let mut reply = tok.encode(&setup.reply).unwrap();
    if setup.end_of_turn {
        reply.push(IM_END);
    }
    let steps = Arc::new(Mutex::new(Vec::new()));
    let backend = Scripted {
        reply,
        next: 0,
        capacity: setup.capacity,
        gate: setup.gate,
        steps: steps.clone(),
        fail_at_step: setup.fail_at_step,
        panic_at_step: setup.panic_at_step,
        total: Arc::new(AtomicUsize::new(0)),
    };
    let model = ModelInfo {
        name: MODEL.into(),
        tokenizer: tok,
        template: Some(Arc::new(ChatTemplate::from_dir(tokenizer_dir()).unwrap())),
        stop_ids: vec![IM_END, 151_643],
        vocab_size: VOCAB,
        sampling: qmk_engine::SamplingDefaults::GREEDY,
        speculation: qmk_engine::SpeculativeOptions::default(),
    };
    let mut config = setup.config;
    config.quiet = true;
    let server = Server::start(model, config, move || Ok(Engine::new(backend, VOCAB))).unwrap();
    assert_eq!(server.capacity(), setup.capacity);
    Harness {
        app: server.router(),
        steps,
        runtime: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    }
}

fn request(method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> Request<Body> {
    let mut r = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        r = r.header("authorization", format!("Bearer {k}"));
    }
    if body.is_some() {
        r = r.header("content-type", "application/json");
    }
    r.body(body.map_or(Body::empty(), |b| Body::from(b.to_string())))
        .unwrap()
}

impl Harness {
    fn send(&self, req: Request<Body>) -> (StatusCode, String) {
        self.runtime.block_on(async {
            let resp = self.app.clone().oneshot(req).await.unwrap();
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(bytes.to_vec()).unwrap())
        })
    }

    fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let (s, text) = self.send(request("POST", path, Some(&body.to_string()), None));
        (s, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A streamed response's events, parsed; the body must end in `[DONE]`.
    fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let (s, text) = self.send(request("POST", path, Some(&body.to_string()), None));
        assert_eq!(s, StatusCode::OK, "{text}");
        events(&text)
    }
}

/// Checks SSE framing and returns the JSON chunks before `[DONE]`.
fn events(text: &str) -> Vec<Value> {
    let body = text.strip_suffix("\n\n").expect("ends with a blank line");
    let mut out = Vec::new();
    let frames: Vec<&str> = body.split("\n\n").collect();
    assert_eq!(frames.last(), Some(&"data: [DONE]"), "{text}");
    for f in &frames[..frames.len() - 1] {
        let payload = f.strip_prefix("data: ").expect("a data event");
        assert!(!payload.contains('\n'));
        out.push(serde_json::from_str(payload).unwrap());
    }
    out
}

fn user(text: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0})
}

#[test]
fn chat_completion_whole_and_streamed_agree() {
    let h = harness(Setup::default());
    let (s, v) = h.post("/v1/chat/completions", &user("Say hello."));
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"],
        "Hello there, friend! How can I help?"
    );
    assert_eq!(choice["finish_reason"], "stop");
    let usage = &v["usage"];
    let reply_tokens = tokenizer()
        .encode("Hello there, friend! How can I help?")
        .unwrap()
        .len();
    // The end-of-turn token is generated, so it counts.
    assert_eq!(usage["completion_tokens"], reply_tokens + 1);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + reply_tokens as u64 + 1
    );

    let mut body = user("Say hello.");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let chunks = h.stream("/v1/chat/completions", &body);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, choice["message"]["content"]);
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], *usage);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    // Without include_usage there is no usage chunk and no usage key.
    body.as_object_mut().unwrap().remove("stream_options");
    let chunks = h.stream("/v1/chat/completions", &body);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[test]
fn max_tokens_ends_with_length() {
    let h = harness(Setup::default());
    let mut body = user("hi");
    body["max_completion_tokens"] = json!(3);
    let (s, v) = h.post("/v1/chat/completions", &body);
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn completions_take_text_or_ids() {
    let h = harness(Setup {
        end_of_turn: false,
        reply: " world, and more".into(),
        ..Setup::default()
    });
    let (s, v) = h.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " world,");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 1);
    let (s, v) = h.post(
        "/v1/completions",
        &json!({"prompt": [9707, 11], "max_tokens": 2}),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    let chunks = h.stream(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2, "stream": true}),
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, " world,");
    let (s, v) = h.post(
        "/v1/completions",
        &json!({"prompt": [1, VOCAB], "max_tokens": 2}),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "prompt");
}

const WEATHER_TOOL: &str = r#"{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}"#;

#[test]
fn tool_calls_are_parsed_when_tools_are_offered() {
    let reply = std::fs::read_to_string(format!(
        "{}/tests/data/tool_calls/with_preamble.txt",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let h = harness(Setup {
        reply: reply.clone(),
        ..Setup::default()
    });
    let tool: Value = serde_json::from_str(WEATHER_TOOL).unwrap();
    let mut body = user("What is the weather in Berlin?");
    body["tools"] = json!([tool]);
    let (s, v) = h.post("/v1/chat/completions", &body);
    assert_eq!(s, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(
        choice["message"]["content"],
        "Let me look up the weather in Berlin for you."
    );
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_current_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"location": "Berlin"}));

    // Streamed: the content, then the call, never the raw tag.
    body["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", &body);
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.contains("<tool_call>"), "{content}");
    assert_eq!(
        content.trim(),
        "Let me look up the weather in Berlin for you."
    );
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][0]["index"], 0);
    assert_eq!(calls[0][0]["function"]["name"], "get_current_weather");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // tool_choice none (or no tools): the reply is plain content.
    body["stream"] = json!(false);
    body["tool_choice"] = json!("none");
    let (_, v) = h.post("/v1/chat/completions", &body);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["content"], reply);
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());

    // A conversation that carries the call and its result renders.
    let follow = json!({"messages": [
        {"role": "user", "content": "What is the weather in Berlin?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_current_weather", "arguments": "{\"location\": \"Berlin\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}],
        "tools": [tool], "temperature": 0});
    let (s, v) = h.post("/v1/chat/completions", &follow);
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[test]
fn the_key_is_required_on_v1_only() {
    let h = harness(Setup {
        config: ServerConfig {
            api_key: Some("sekrit".into()),
            ..ServerConfig::default()
        },
        ..Setup::default()
    });
    let body = user("hi").to_string();
    for key in [
        None,
        Some("wrong"),
        Some("sekri"),
        Some("sekrit2"),
        Some(""),
    ] {
        let (s, text) = h.send(request("POST", "/v1/chat/completions", Some(&body), key));
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{key:?}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let (s, _) = h.send(request("GET", "/v1/models", None, None));
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = h.send(request(
        "POST",
        "/v1/chat/completions",
        Some(&body),
        Some("sekrit"),
    ));
    assert_eq!(s, StatusCode::OK);
    let mut r = request("GET", "/v1/models", None, None);
    r.headers_mut()
        .insert("authorization", "bearer sekrit".parse().unwrap());
    assert_eq!(h.send(r).0, StatusCode::OK);
    assert_eq!(
        h.send(request("GET", "/health", None, None)).0,
        StatusCode::OK
    );
}

#[test]
fn models_and_health() {
    let h = harness(Setup::default());
    let (s, text) = h.send(request("GET", "/v1/models", None, None));
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], 512);
    let (s, _) = h.send(request("GET", &format!("/v1/models/{MODEL}"), None, None));
    assert_eq!(s, StatusCode::OK);
    let (s, _) = h.send(request("GET", "/v1/models/other", None, None));
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, text) = h.send(request("GET", "/health", None, None));
    assert_eq!((s, text.as_str()), (StatusCode::OK, r#"{"status":"ok"}"#));
}

/// Every error answers in OpenAI's shape with its status.
#[test]
fn errors_have_the_right_status_and_shape() {
    let h = harness(Setup {
        capacity: 64,
        config: ServerConfig {
            max_body_bytes: 4096,
            ..ServerConfig::default()
        },
        ..Setup::default()
    });
    let long = "word ".repeat(100);
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        (
            "POST",
            "/v1/chat/completions",
            "{not json".into(),
            400,
            None,
        ),
        ("POST", "/v1/chat/completions", "".into(), 400, None),
        (
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}], "top_p": "high"}"#.into(),
            400,
            Some("top_p"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#.into(),
            400,
            Some("n"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            r#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}"#.into(),
            404,
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 60}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "x".repeat(5000)}).to_string(),
            413,
            None,
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": ""}"#.into(),
            400,
            Some("prompt"),
        ),
        ("GET", "/v1/chat/completions", String::new(), 405, None),
        ("GET", "/v2/anything", String::new(), 404, None),
    ];
    for (method, path, body, status, param) in cases {
        let b = (!body.is_empty() || method == "POST").then_some(body.as_str());
        let (s, text) = h.send(request(method, path, b, None));
        assert_eq!(s.as_u16(), status, "{method} {path} {body:.80}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
        assert_eq!(e["param"].as_str(), param, "{path} {body:.80}: {v}");
    }
    // The over-long request was refused before any work.
    assert!(h.steps.lock().unwrap().is_empty());
    // And the server still works.
    let (s, _) = h.post("/v1/chat/completions", &user("hi"));
    assert_eq!(s, StatusCode::OK);
}

#[test]
fn a_full_queue_answers_429_and_queued_requests_complete_in_order() {
    let gate = Gate::closed();
    let h = harness(Setup {
        gate: Some(gate.clone()),
        config: ServerConfig {
            max_queue: 2,
            ..ServerConfig::default()
        },
        ..Setup::default()
    });
    let mut body = user("hi");
    body["max_tokens"] = json!(4);
    let body = body.to_string();
    h.runtime.block_on(async {
        // The first request runs (held at the gate); two wait; one more is
        // refused.
        let first = tokio::spawn(h.app.clone().oneshot(request(
            "POST",
            "/v1/chat/completions",
            Some(&body),
            None,
        )));
        tokio::task::spawn_blocking({
            let g = gate.clone();
            move || g.wait_blocked()
        })
        .await
        .unwrap();
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let mut b: Value = serde_json::from_str(&body).unwrap();
                b["stream"] = json!(true);
                request("POST", "/v1/chat/completions", Some(&b.to_string()), None)
            })
            .collect();
        let mut streams = Vec::new();
        for r in waiting {
            let resp = h.app.clone().oneshot(r).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            streams.push(resp);
        }
        let resp = h
            .app
            .clone()
            .oneshot(request("POST", "/v1/chat/completions", Some(&body), None))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["code"], "queue_full");

        gate.open();
        let resp = first.await.unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "Hello there, friend");
        for s in streams {
            let bytes = s.into_body().collect().await.unwrap().to_bytes();
            let chunks = events(std::str::from_utf8(&bytes).unwrap());
            let text: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                .collect();
            assert_eq!(text, "Hello there, friend");
        }
    });
    assert_eq!(*h.steps.lock().unwrap(), [4, 4, 4]);
}

#[test]
fn a_client_that_goes_away_stops_its_generation_within_one_step() {
    let gate = Gate::closed();
    let h = harness(Setup {
        gate: Some(gate.clone()),
        ..Setup::default()
    });
    let mut body = user("hi");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(8);
    h.runtime.block_on(async {
        let resp = h
            .app
            .clone()
            .oneshot(request(
                "POST",
                "/v1/chat/completions",
                Some(&body.to_string()),
                None,
            ))
            .await
            .unwrap();
        let mut body = resp.into_body();
        // The role chunk comes at once; the first token after one step.
        let role = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(std::str::from_utf8(&role).unwrap().contains("assistant"));
        gate.allow(1);
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(std::str::from_utf8(&first).unwrap().contains("Hello"));
        // The client hangs up.
        drop(body);
        gate.open();
    });
    // The next request is served, and the dropped one ran at most one
    // step past the token its client saw.
    let (s, v) = h.post("/v1/chat/completions", &user("again"));
    assert_eq!(s, StatusCode::OK, "{v}");
    let steps = h.steps.lock().unwrap().clone();
    assert_eq!(steps.len(), 2, "{steps:?}");
    assert!(
        steps[0] <= 2,
        "the abandoned generation ran {} steps",
        steps[0]
    );

    // A non-streamed request whose future is dropped is cancelled too.
    let gate = Gate::closed();
    let h = harness(Setup {
        gate: Some(gate.clone()),
        ..Setup::default()
    });
    h.runtime.block_on(async {
        let fut = h.app.clone().oneshot(request(
            "POST",
            "/v1/chat/completions",
            Some(&user("hi").to_string()),
            None,
        ));
        let task = tokio::spawn(fut);
        tokio::task::spawn_blocking({
            let g = gate.clone();
            move || g.wait_blocked()
        })
        .await
        .unwrap();
        task.abort();
        let _ = task.await;
        gate.open();
    });
    let (s, _) = h.post("/v1/chat/completions", &user("again"));
    assert_eq!(s, StatusCode::OK);
    let steps = h.steps.lock().unwrap().clone();
    assert!(
        steps[0] <= 2,
        "the abandoned generation ran {} steps",
        steps[0]
    );
}

#[test]
fn a_backend_failure_makes_the_server_unhealthy() {
    let h = harness(Setup {
        fail_at_step: Some(2),
        ..Setup::default()
    });
    let (s, v) = h.post("/v1/chat/completions", &user("hi"));
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("device lost"));
    let (s, text) = h.send(request("GET", "/health", None, None));
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(text.contains("device lost"), "{text}");
    let (s, _) = h.post("/v1/chat/completions", &user("hi"));
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    // Streamed: the failure arrives as an error event before [DONE].
    let h = harness(Setup {
        fail_at_step: Some(1),
        ..Setup::default()
    });
    let mut body = user("hi");
    body["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", &body);
    assert!(chunks.last().unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("device lost"));
}

#[test]
fn a_panic_in_the_engine_is_a_500_and_the_server_stays_up_unhealthy() {
    let h = harness(Setup {
        panic_at_step: Some(1),
        ..Setup::default()
    });
    let (s, v) = h.post("/v1/chat/completions", &user("hi"));
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scripted panic"));
    let (s, text) = h.send(request("GET", "/health", None, None));
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(text.contains("panicked"), "{text}");
    let (s, text) = h.send(request("GET", "/v1/models", None, None));
    assert_eq!(s, StatusCode::OK, "{text}");
}

#[test]
fn hostile_bodies_never_break_the_server() {
    let h = harness(Setup::default());
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let bodies = [
        deep.as_str(),
        "\u{feff}{}",
        r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}"#,
        r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 18446744073709551615}"#,
        r#"{"messages": [{"role": "user", "content": "{% for x in range(10) %}{{x}}{% endfor %}"}]}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
        r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]}"#,
        r#"{"prompt": [[]]}"#,
    ];
    for b in bodies {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let (s, text) = h.send(request("POST", path, Some(b), None));
            assert!(
                s == StatusCode::OK || s.is_client_error(),
                "{path} {b:.60}: {s} {text}"
            );
            if s != StatusCode::OK {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert!(v["error"]["message"].is_string());
            }
        }
    }
    assert_eq!(
        h.send(request("GET", "/health", None, None)).0,
        StatusCode::OK
    );
}
