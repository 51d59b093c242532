//! An OpenAI-compatible HTTP server over one qwen-mk engine (`qwen-mk
//! serve`): `POST /v1/chat/completions` (chat template, tools, streaming),
//! `POST /v1/completions` (raw prompt), `GET /v1/models`, `GET /health`.
//!
//! One engine serves one request at a time on its own thread, fed by a
//! bounded queue (see [`worker`]); the HTTP side (axum on tokio) parses and
//! checks each request, renders and tokenizes the prompt, checks it against
//! the context, and queues it, all before the engine sees it. Errors come
//! in OpenAI's JSON shape with their HTTP status ([`ServerError`]).
//!
//! ```no_run
//! # use std::sync::Arc;
//! # fn demo(weights: Arc<qmk_model::Weights>, dir: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
//! use qmk_engine::{CpuBackend, Engine};
//! use qmk_server::{ModelInfo, Server, ServerConfig};
//!
//! let model = ModelInfo {
//!     name: "qwen".into(),
//!     tokenizer: qmk_model::tokenizer::Tokenizer::from_dir(dir)?,
//!     template: Some(Arc::new(qmk_model::chat::ChatTemplate::from_dir(dir)?)),
//!     stop_ids: vec![151645, 151643],
//!     vocab_size: weights.config.vocab_size,
//!     sampling: qmk_engine::SamplingDefaults::GREEDY,
//!     speculation: qmk_engine::SpeculativeOptions::default(),
//! };
//! let vocab = model.vocab_size;
//! let server = Server::start(model, ServerConfig::default(), move || {
//!     Ok(Engine::new(CpuBackend::new(weights, 4096)?, vocab))
//! })?;
//! server.serve("127.0.0.1:8000", |addr| println!("listening on http://{addr}"))?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod app;
mod error;
mod log;
pub mod request;
mod sse;
pub mod tools;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;

use qmk_engine::{Backend, Engine};
use qmk_model::chat::ChatTemplate;
use qmk_model::tokenizer::Tokenizer;

pub use error::{BoxError, ServerError};
pub use log::Log;

/// Largest request body accepted by default: far more than any context
/// holds as text (128k tokens are under 1 MB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// Requests that may wait besides the one running, by default.
pub const DEFAULT_MAX_QUEUE: usize = 16;

/// What the server needs to know of the model besides the engine.
pub struct ModelInfo {
    /// The name clients use (`model` in requests, `/v1/models`).
    pub name: String,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template; without one only `/v1/completions` works.
    pub template: Option<Arc<ChatTemplate>>,
    /// End-of-turn / end-of-text ids: generation stops after one.
    pub stop_ids: Vec<u32>,
    /// The model's vocabulary size (prompt token ids must be below it).
    pub vocab_size: usize,
    /// Sampling values a request leaves out (the model's
    /// `generation_config.json`; greedy without one).
    pub sampling: qmk_engine::SamplingDefaults,
    /// How every request speculates ([`qmk_engine::speculative`]; by
    /// default greedy requests do, sampled ones run plain steps).
    pub speculation: qmk_engine::SpeculativeOptions,
}

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Required bearer key of every `/v1` request, when set.
    pub api_key: Option<String>,
    /// Requests that may wait while one runs; more are answered 429.
    pub max_queue: usize,
    /// Largest request body; larger ones are answered 413.
    pub max_body_bytes: usize,
    /// No per-request log lines (engine failures are still logged).
    pub quiet: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            max_queue: DEFAULT_MAX_QUEUE,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            quiet: false,
        }
    }
}

/// A started engine and the application around it.
pub struct Server {
    state: Arc<app::AppState>,
}

impl Server {
    /// Starts the engine thread, where `open` builds the engine (so a GPU
    /// context belongs to that thread), and returns once it is ready.
    pub fn start<B, F>(
        model: ModelInfo,
        config: ServerConfig,
        open: F,
    ) -> Result<Server, ServerError>
    where
        B: Backend,
        F: FnOnce() -> Result<Engine<B>, BoxError> + Send + 'static,
    {
        let log = Log::new(config.quiet);
        let worker = worker::Worker::spawn(open, model.tokenizer.clone(), config.max_queue, log)?;
        let state = app::AppState::new(
            model,
            config.api_key.as_deref(),
            worker,
            log,
            config.max_body_bytes,
        );
        Ok(Server {
            state: Arc::new(state),
        })
    }

    /// Positions the engine's KV cache holds: the longest prompt plus
    /// completion a request may ask for.
    pub fn capacity(&self) -> usize {
        self.state.worker.capacity()
    }

    /// The application, for serving or for calling in tests.
    pub fn router(&self) -> axum::Router {
        app::router(self.state.clone())
    }

    /// Listens on `addr` (`host:port`; port 0 picks a free one), calls
    /// `on_listening` with the address bound, and serves until the process
    /// ends.
    pub fn serve(
        self,
        addr: &str,
        on_listening: impl FnOnce(SocketAddr),
    ) -> Result<(), ServerError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("qmk-http")
            .build()?;
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: addr.to_string(),
                    source,
                })?;
            on_listening(listener.local_addr()?);
            axum::serve(listener, self.router()).await?;
            Ok(())
        })
    }
}
