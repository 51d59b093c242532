//! The engine's own thread and its queue.
//!
//! One thread owns the engine for the server's life (GPU contexts are bound
//! to the thread that made them, so the engine is also opened there) and
//! runs one request at a time: batch 1 is what the megakernel is for.
//! Requests wait in a bounded FIFO; a full one is refused at once. Each job
//! carries a cancellation flag, set when its client goes away, which the
//! engine's per-token callback reads, so an abandoned generation ends within
//! one step. A backend error is sticky: the server turns unhealthy.

use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qmk_engine::{
    Backend, Engine, EngineError, GenerateOptions, SpeculateMode, SpeculativeStats, StopMatcher,
    StopReason, TextStream,
};
use qmk_model::tokenizer::Tokenizer;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::log::Log;
use crate::{BoxError, ServerError};

/// Set when the job's client has gone; read by the engine after each token.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Asks the job to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether the job was asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Sets the flag when dropped: a response future or body that is dropped
/// (the client hung up) cancels its job.
#[derive(Debug)]
pub struct CancelOnDrop(pub Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// One generation request.
pub struct Job {
    /// The request id (`chatcmpl-...`), for the log.
    pub id: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// What to generate.
    pub options: GenerateOptions,
    /// The request's stop strings (the reply ends before the first).
    pub stops: StopMatcher,
    /// The client's cancellation flag.
    pub cancel: Cancel,
    /// Where the job's events go.
    pub events: UnboundedSender<Event>,
    /// When it was queued.
    pub queued_at: Instant,
}

/// What a job reports, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// Newly final text of the reply (special tokens left out).
    Text(String),
    /// The generation ended.
    Done(Outcome),
    /// It could not run, or failed.
    Failed(ServerError),
}

/// A finished generation.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (a stop id included).
    pub output_ids: Vec<u32>,
    /// The reply: every text piece sent, concatenated (special tokens and
    /// a stop string left out).
    pub text: String,
    /// Why it ended.
    pub stop: StopReason,
    /// Time waiting in the queue.
    pub queued: Duration,
    /// Time from the engine's start to the first token.
    pub first_token: Duration,
    /// Decode rate after the first token.
    pub tok_per_s: f64,
    /// What speculation did.
    pub speculation: SpeculativeStats,
}

/// Whether the engine still works; the first sticky error, once one came.
#[derive(Debug, Default)]
pub struct Health(Mutex<Option<String>>);

impl Health {
    /// The error that made the engine unusable, if any.
    pub fn failure(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn fail(&self, why: String) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(why);
    }
}

/// The handle the HTTP side holds: the queue's sending end.
pub struct Worker {
    queue: SyncSender<Job>,
    max_queue: usize,
    capacity: usize,
    health: Arc<Health>,
}

impl Worker {
    /// Starts the engine thread: `open` builds the engine there; this
    /// returns once it has (or failed to). `max_queue` jobs may wait
    /// besides the one running.
    pub fn spawn<B, F>(
        open: F,
        tokenizer: Tokenizer,
        max_queue: usize,
        log: Log,
    ) -> Result<Worker, ServerError>
    where
        B: Backend,
        F: FnOnce() -> Result<Engine<B>, BoxError> + Send + 'static,
    {
        let (queue, jobs) = sync_channel::<Job>(max_queue);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<usize, BoxError>>();
        let health = Arc::new(Health::default());
        let thread_health = health.clone();
        std::thread::Builder::new()
            .name("qmk-engine".into())
            .spawn(move || {
                let mut engine = match open() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(engine.backend().capacity()));
                drop(ready_tx);
                serve_jobs(&mut engine, &tokenizer, &thread_health, &log, jobs);
            })?;
        let capacity = ready_rx
            .recv()
            .map_err(|_| ServerError::Startup("the engine thread ended while opening".into()))?
            .map_err(ServerError::Startup)?;
        Ok(Worker {
            queue,
            max_queue,
            capacity,
            health,
        })
    }

    /// Positions the engine's KV cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The engine's health.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Queues a job, or refuses it at once when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), ServerError> {
        if let Some(why) = self.health.failure() {
            return Err(ServerError::Unavailable(why));
        }
        self.queue.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => ServerError::QueueFull {
                waiting: self.max_queue,
            },
            TrySendError::Disconnected(_) => {
                ServerError::Unavailable("the engine thread has stopped".into())
            }
        })
    }
}

/// A job's events and the guard that cancels it when dropped.
pub struct Ticket {
    /// The job's events.
    pub events: UnboundedReceiver<Event>,
    /// Cancels the job when the response is dropped.
    pub guard: CancelOnDrop,
}

impl Ticket {
    /// A new job for `prompt_ids` and its ticket.
    pub fn new(
        id: String,
        prompt_ids: Vec<u32>,
        options: GenerateOptions,
        stops: StopMatcher,
    ) -> (Job, Ticket) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Cancel::default();
        let job = Job {
            id,
            prompt_ids,
            options,
            stops,
            cancel: cancel.clone(),
            events: tx,
            queued_at: Instant::now(),
        };
        (
            job,
            Ticket {
                events: rx,
                guard: CancelOnDrop(cancel),
            },
        )
    }
}

fn serve_jobs<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: &Tokenizer,
    health: &Health,
    log: &Log,
    jobs: Receiver<Job>,
) {
    // Ends when the server drops the queue.
    for job in jobs {
        if job.cancel.is_cancelled() || job.events.is_closed() {
            log.line(format!("{}: cancelled while queued", job.id));
            continue;
        }
        if let Some(why) = health.failure() {
            let _ = job
                .events
                .send(Event::Failed(ServerError::Unavailable(why)));
            continue;
        }
        let id = job.id.clone();
        let events = job.events.clone();
        // A panic is a bug, but it must not take the server down: the job
        // fails and, since the engine's state is unknown, so does health.
        let event = match catch_unwind(AssertUnwindSafe(|| run(engine, tokenizer, job))) {
            Ok(Ok(outcome)) => {
                log.line(outcome_line(&id, &outcome));
                Event::Done(outcome)
            }
            Ok(Err(e)) => {
                if let ServerError::Unavailable(why) = &e {
                    health.fail(why.clone());
                }
                log.always(format!("{id}: {e}"));
                Event::Failed(e)
            }
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                let why = format!("the engine panicked: {why}");
                health.fail(why.clone());
                log.always(format!("{id}: {why}"));
                Event::Failed(ServerError::Internal(why))
            }
        };
        let _ = events.send(event);
    }
}

fn run<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: &Tokenizer,
    job: Job,
) -> Result<Outcome, ServerError> {
    let queued = job.queued_at.elapsed();
    let mut text = TextStream::new(tokenizer, job.stops);
    // Called once per generated id, so a client that has gone stops the
    // run within one step even while no text is final.
    let generation = engine.generate_text(&job.prompt_ids, &job.options, &mut text, |delta| {
        if job.cancel.is_cancelled() {
            return ControlFlow::Break(());
        }
        if !delta.is_empty() && job.events.send(Event::Text(delta.to_string())).is_err() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    });
    let generation = generation.map_err(|e| match e {
        EngineError::Backend { .. } => ServerError::Unavailable(qmk_engine::error_chain(&e)),
        other => ServerError::Internal(other.to_string()),
    })?;
    let text = text.text().to_string();
    Ok(Outcome {
        prompt_tokens: generation.prompt_ids.len(),
        tok_per_s: generation.decode_tok_per_s(),
        output_ids: generation.output_ids,
        text,
        stop: generation.stop,
        queued,
        first_token: generation.prefill,
        speculation: generation.speculation,
    })
}

/// The per-request log line.
fn outcome_line(id: &str, o: &Outcome) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let end = match o.stop {
        StopReason::Eos => "stop",
        StopReason::StopString => "stop string",
        StopReason::Length => "length",
        StopReason::Caller => "cancelled",
    };
    let s = &o.speculation;
    let speculated = if s.mode == SpeculateMode::Off {
        String::new()
    } else {
        format!(
            "; speculation {}: {} of {} guesses accepted, {:.2} tokens/step",
            s.mode.name(),
            s.accepted,
            s.proposed,
            s.tokens_per_step()
        )
    };
    format!(
        "{id}: prompt {} tokens, completion {} tokens ({end}); queued {:.1} ms, time to first token {:.1} ms, decode {:.2} tok/s{speculated}",
        o.prompt_tokens,
        o.output_ids.len(),
        ms(o.queued),
        ms(o.first_token),
        o.tok_per_s
    )
}
