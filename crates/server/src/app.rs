//! The HTTP side: routes, the bearer-key check, and the OpenAI response
//! shapes (whole and streamed).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use qmk_engine::StopReason;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tower_http::catch_panic::CatchPanicLayer;

use crate::request::{
    check_model, fit_to_context, generate_options, parse_body, ChatRequest, CommonFields,
    CompletionRequest, Delivery, GenParams, PromptInput, WithCommon,
};
use crate::tools::{self, ToolCall, ToolStream};
use crate::worker::{Event, Outcome, Ticket, Worker};
use crate::{log::Log, sse, ModelInfo, ServerError};

/// Everything the handlers share.
pub(crate) struct AppState {
    pub model: ModelInfo,
    /// SHA-256 of the API key, when one is required.
    pub key: Option<[u8; 32]>,
    pub worker: Worker,
    pub log: Log,
    pub max_body_bytes: usize,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
    ids: AtomicU64,
    salt: u64,
}

impl AppState {
    pub fn new(
        model: ModelInfo,
        api_key: Option<&str>,
        worker: Worker,
        log: Log,
        max_body_bytes: usize,
    ) -> Self {
        AppState {
            model,
            key: api_key.map(|k| Sha256::digest(k.as_bytes()).into()),
            worker,
            log,
            max_body_bytes,
            started: unix_now(),
            ids: AtomicU64::new(0),
            salt: std::collections::hash_map::RandomState::new().hash_one(0u8),
        }
    }

    /// A fresh id: `prefix` and hex digits unique to this server's life.
    fn next_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}{:08x}{n:06x}", self.salt as u32)
    }

    /// Logs a refused request and answers it.
    fn refuse(&self, id: &str, e: ServerError) -> Response {
        self.log.line(format!("{id}: {} {e}", e.status().as_u16()));
        e.into_response()
    }

    /// 503 once the engine has failed for good.
    fn check_health(&self) -> Result<(), ServerError> {
        match self.worker.health().failure() {
            Some(why) => Err(ServerError::Unavailable(why)),
            None => Ok(()),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The application: every route, the key check on `/v1`, the body limit,
/// and a 500 for a handler that panics.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(respond::<ChatRequest>))
        .route("/v1/completions", post(respond::<CompletionRequest>))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let limit = state.max_body_bytes;
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .fallback(no_route)
        .method_not_allowed_fallback(not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ServerError::Internal("the request handler panicked".into()).into_response()
            },
        ))
        .with_state(state)
}

/// Whether `given` is the key whose digest is `want`, in time that does
/// not depend on where they differ (digests of equal length are compared
/// whole; the length of the key given tells nothing about the real one).
fn key_matches(want: &[u8; 32], given: &str) -> bool {
    let got: [u8; 32] = Sha256::digest(given.as_bytes()).into();
    let diff = want
        .iter()
        .zip(got.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(want) = &st.key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim());
        if !given.is_some_and(|k| key_matches(want, k)) {
            let what = format!("{} {}", req.method(), req.uri().path());
            return st.refuse(&what, ServerError::Unauthorized);
        }
    }
    next.run(req).await
}

async fn no_route(method: Method, uri: Uri) -> Response {
    ServerError::NoRoute {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_response()
}

async fn not_allowed(method: Method, uri: Uri) -> Response {
    ServerError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.check_health() {
        Ok(()) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

fn model_card(st: &AppState) -> Value {
    json!({
        "id": st.model.name,
        "object": "model",
        "created": st.started,
        "owned_by": "qwen-mk",
        "max_model_len": st.worker.capacity(),
    })
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match check_model(Some(&id), &st.model.name) {
        Ok(()) => Json(model_card(&st)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn read_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ServerError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ServerError::PayloadTooLarge { limit }
        } else {
            ServerError::InvalidRequest {
                message: format!("cannot read the request body: {r}"),
                param: None,
                code: None,
            }
        }
    })
}

/// What every response of one request repeats.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    /// The sampling seed used (drawn at random when the request gave none),
    /// so any reply can be reproduced.
    seed: u64,
    prompt_tokens: usize,
    include_usage: bool,
}

impl Meta {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }
}

fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Length => "length",
        // A cancelled job has no client left to read this.
        StopReason::Eos | StopReason::StopString | StopReason::Caller => "stop",
    }
}

/// What one OpenAI endpoint does its own way: the body it takes, how that
/// becomes prompt ids, and the shape of its answer, whole or streamed. The
/// rest (parse, validate, fit to the context, enqueue, answer) is
/// [`respond`]'s, the same for every endpoint.
trait Endpoint: WithCommon + Send + 'static {
    /// What [`Endpoint::prompt_ids`] turns into prompt ids.
    type Prompt: Send;
    /// What the answer needs of the request besides [`Meta`].
    type Reply: Send;
    /// The start of its response ids.
    const ID_PREFIX: &'static str;
    /// The request field blamed for a prompt that leaves no room to generate.
    const PROMPT_FIELD: &'static str;

    /// The shared fields.
    fn common(&self) -> &CommonFields;

    /// Checks the request and splits it up.
    fn check(&self) -> Result<(Self::Prompt, Self::Reply, GenParams, Delivery), ServerError>;

    /// The prompt's token ids (CPU work goes off the async threads).
    fn prompt_ids(
        st: &AppState,
        prompt: Self::Prompt,
    ) -> impl Future<Output = Result<Vec<u32>, ServerError>> + Send;

    /// How the streamed answer's chunks read.
    fn stream(st: &Arc<AppState>, reply: Self::Reply, meta: Meta) -> Box<dyn ChunkFormat>;

    /// The whole answer.
    fn whole(st: &Arc<AppState>, reply: Self::Reply, meta: Meta, outcome: Outcome) -> Value;
}

/// The handler of endpoint `E`: its answer, or the logged refusal.
async fn respond<E: Endpoint>(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = st.next_id(E::ID_PREFIX);
    match response::<E>(&st, &id, body).await {
        Ok(r) => r,
        Err(e) => st.refuse(&id, e),
    }
}

/// The answer to one request of endpoint `E`, or why it is refused.
async fn response<E: Endpoint>(
    st: &Arc<AppState>,
    id: &str,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ServerError> {
    let bytes = read_body(body, st.max_body_bytes)?;
    let req: E = parse_body(&bytes)?;
    check_model(req.common().model.as_deref(), &st.model.name)?;
    let (prompt, reply, params, delivery) = req.check()?;
    st.check_health()?;
    let prompt_ids = E::prompt_ids(st, prompt).await?;
    let max_new = fit_to_context(
        prompt_ids.len(),
        params.max_tokens,
        st.worker.capacity(),
        E::PROMPT_FIELD,
    )?;
    let (options, stops) = generate_options(&params, max_new, &st.model)?;
    let meta = Meta {
        id: id.to_string(),
        created: unix_now(),
        model: st.model.name.clone(),
        seed: options.sampling.seed,
        prompt_tokens: prompt_ids.len(),
        include_usage: delivery.include_usage,
    };
    let (work, ticket) = Ticket::new(id.to_string(), prompt_ids, options, stops);
    st.worker.submit(work)?;
    if delivery.stream {
        return Ok(sse_response(Chunks::new(
            ticket,
            E::stream(st, reply, meta),
        )));
    }
    let outcome = collect(ticket).await?;
    Ok(Json(E::whole(st, reply, meta, outcome)).into_response())
}

impl Endpoint for ChatRequest {
    /// The messages and the tools, as the chat template takes them.
    type Prompt = (Vec<Value>, Option<Vec<Value>>);
    /// The names of the tools offered, if any.
    type Reply = Option<Vec<String>>;
    const ID_PREFIX: &'static str = "chatcmpl-";
    const PROMPT_FIELD: &'static str = "messages";

    fn common(&self) -> &CommonFields {
        &self.common
    }

    fn check(&self) -> Result<(Self::Prompt, Self::Reply, GenParams, Delivery), ServerError> {
        let job = self.validate()?;
        let offered = job.tools.as_deref().map(tools::names);
        Ok(((job.messages, job.tools), offered, job.params, job.delivery))
    }

    async fn prompt_ids(
        st: &AppState,
        (messages, tools): Self::Prompt,
    ) -> Result<Vec<u32>, ServerError> {
        let Some(template) = st.model.template.clone() else {
            return Err(ServerError::invalid(
                "the model has no chat template; use /v1/completions",
                "messages",
            ));
        };
        let tokenizer = st.model.tokenizer.clone();
        // Rendering (fuel-bounded) and tokenizing take CPU: off the async threads.
        tokio::task::spawn_blocking(move || {
            let text = template
                .render_with(&messages, tools.as_ref(), true)
                .map_err(|e| {
                    ServerError::invalid(
                        format!("the chat template cannot render these messages: {e}"),
                        "messages",
                    )
                })?;
            tokenizer
                .encode(&text)
                .map_err(|e| ServerError::Internal(format!("tokenizer: {e}")))
        })
        .await
        .map_err(|e| ServerError::Internal(format!("prompt rendering failed: {e}")))?
    }

    fn stream(st: &Arc<AppState>, offered: Self::Reply, meta: Meta) -> Box<dyn ChunkFormat> {
        Box::new(ChatStream {
            meta,
            tools: offered.map(ToolStream::new),
            call_ids: CallIds(st.clone()),
        })
    }

    fn whole(st: &Arc<AppState>, offered: Self::Reply, meta: Meta, outcome: Outcome) -> Value {
        let mut message = json!({"role": "assistant", "content": outcome.text});
        let mut finish = finish_reason(outcome.stop);
        if let Some(parsed) = offered.and_then(|names| tools::parse(&outcome.text, &names)) {
            message["content"] = json!(parsed.content);
            message["tool_calls"] = tool_calls_json(&parsed.calls, &CallIds(st.clone()), false);
            finish = "tool_calls";
        }
        json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "seed": meta.seed,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": finish,
            }],
            "usage": meta.usage(outcome.output_ids.len()),
        })
    }
}

impl Endpoint for CompletionRequest {
    type Prompt = PromptInput;
    /// Nothing: the answer is the text.
    type Reply = ();
    const ID_PREFIX: &'static str = "cmpl-";
    const PROMPT_FIELD: &'static str = "prompt";

    fn common(&self) -> &CommonFields {
        &self.common
    }

    fn check(&self) -> Result<(Self::Prompt, Self::Reply, GenParams, Delivery), ServerError> {
        let (prompt, params, delivery) = self.validate()?;
        Ok((prompt, (), params, delivery))
    }

    async fn prompt_ids(st: &AppState, prompt: Self::Prompt) -> Result<Vec<u32>, ServerError> {
        match prompt {
            PromptInput::Ids(ids) => {
                let vocab = st.model.vocab_size;
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                    return Err(ServerError::invalid(
                        format!("prompt token {i} is {id}, outside the vocabulary of {vocab}"),
                        "prompt",
                    ));
                }
                Ok(ids)
            }
            PromptInput::Text(text) => {
                let tokenizer = st.model.tokenizer.clone();
                tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                    .await
                    .map_err(|e| ServerError::Internal(format!("tokenizing failed: {e}")))?
                    .map_err(|e| ServerError::Internal(format!("tokenizer: {e}")))
            }
        }
    }

    fn stream(_: &Arc<AppState>, (): Self::Reply, meta: Meta) -> Box<dyn ChunkFormat> {
        Box::new(CompletionStream { meta })
    }

    fn whole(_: &Arc<AppState>, (): Self::Reply, meta: Meta, outcome: Outcome) -> Value {
        json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "seed": meta.seed,
            "choices": [{
                "index": 0,
                "text": outcome.text,
                "logprobs": null,
                "finish_reason": finish_reason(outcome.stop),
            }],
            "usage": meta.usage(outcome.output_ids.len()),
        })
    }
}

/// Mints tool-call ids.
struct CallIds(Arc<AppState>);

fn tool_calls_json(calls: &[ToolCall], ids: &CallIds, indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": ids.0.next_id("call_"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if indexed {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

/// Waits for a job's end, ignoring its text pieces.
async fn collect(mut ticket: Ticket) -> Result<Outcome, ServerError> {
    while let Some(event) = ticket.events.recv().await {
        match event {
            Event::Text(_) => {}
            Event::Done(outcome) => return Ok(outcome),
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ServerError::Unavailable(
        "the engine thread has stopped".into(),
    ))
}

/// How one endpoint turns a job's events into stream chunks.
trait ChunkFormat: Send {
    /// Chunks sent before any text.
    fn opening(&mut self) -> Vec<Value>;
    /// Chunks for a piece of text.
    fn text(&mut self, text: String) -> Vec<Value>;
    /// Chunks for the end: the finish reason, then the usage chunk when
    /// asked for.
    fn done(&mut self, outcome: &Outcome) -> Vec<Value>;
}

/// The body of a streamed response: the job's events as SSE frames, then
/// `[DONE]`. Dropping it (the client hung up) cancels the job.
struct Chunks {
    ticket: Ticket,
    format: Box<dyn ChunkFormat>,
    pending: VecDeque<Bytes>,
    ended: bool,
}

impl Chunks {
    fn new(ticket: Ticket, mut format: Box<dyn ChunkFormat>) -> Self {
        let pending = format.opening().iter().map(sse::data).collect();
        Chunks {
            ticket,
            format,
            pending,
            ended: false,
        }
    }

    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Some(frame);
            }
            if self.ended {
                return None;
            }
            let chunks = match self.ticket.events.recv().await {
                Some(Event::Text(t)) => self.format.text(t),
                Some(Event::Done(outcome)) => {
                    self.ended = true;
                    self.format.done(&outcome)
                }
                Some(Event::Failed(e)) => {
                    self.ended = true;
                    vec![e.body()]
                }
                None => {
                    self.ended = true;
                    vec![ServerError::Unavailable("the engine thread has stopped".into()).body()]
                }
            };
            self.pending.extend(chunks.iter().map(sse::data));
            if self.ended {
                self.pending.push_back(sse::done());
            }
        }
    }
}

fn sse_response(chunks: Chunks) -> Response {
    let stream = futures_util::stream::unfold(chunks, |mut c| async move {
        c.next().await.map(|b| (Ok::<_, Infallible>(b), c))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

struct ChatStream {
    meta: Meta,
    /// Present when tools are offered: holds back tool-call text.
    tools: Option<ToolStream>,
    call_ids: CallIds,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "seed": self.meta.seed,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl ChunkFormat for ChatStream {
    fn opening(&mut self) -> Vec<Value> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None)]
    }

    fn text(&mut self, text: String) -> Vec<Value> {
        let text = match self.tools.as_mut() {
            Some(t) => t.push(&text),
            None => text,
        };
        if text.is_empty() {
            return Vec::new();
        }
        vec![self.chunk(json!({"content": text}), None)]
    }

    fn done(&mut self, outcome: &Outcome) -> Vec<Value> {
        let mut out = Vec::new();
        let mut finish = finish_reason(outcome.stop);
        match self.tools.take().map(ToolStream::finish) {
            Some(Ok(calls)) => {
                let calls = tool_calls_json(&calls, &self.call_ids, true);
                out.push(self.chunk(json!({"tool_calls": calls}), None));
                finish = "tool_calls";
            }
            Some(Err(held)) if !held.is_empty() => {
                out.push(self.chunk(json!({"content": held}), None));
            }
            _ => {}
        }
        out.push(self.chunk(json!({}), Some(finish)));
        if self.meta.include_usage {
            let mut usage = self.chunk(json!({}), None);
            usage["choices"] = json!([]);
            usage["usage"] = self.meta.usage(outcome.output_ids.len());
            out.push(usage);
        }
        out
    }
}

struct CompletionStream {
    meta: Meta,
}

impl CompletionStream {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "seed": self.meta.seed,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        });
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl ChunkFormat for CompletionStream {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn text(&mut self, text: String) -> Vec<Value> {
        vec![self.chunk(&text, None)]
    }

    fn done(&mut self, outcome: &Outcome) -> Vec<Value> {
        let mut out = vec![self.chunk("", Some(finish_reason(outcome.stop)))];
        if self.meta.include_usage {
            let mut usage = self.chunk("", None);
            usage["choices"] = json!([]);
            usage["usage"] = self.meta.usage(outcome.output_ids.len());
            out.push(usage);
        }
        out
    }
}
