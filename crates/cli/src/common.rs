//! What `generate` and `chat` share: arguments, finding and loading a model,
//! choosing a backend, sampling options and the stats line.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::builder::TypedValueParser;
use clap::{Args, ValueEnum};
use qmk_engine::draft::{DraftModel, ModelVocab};
use qmk_engine::{
    Backend, BackendKind, Engine, EngineError, GenerateOptions, Generation, SamplingDefaults,
    SamplingRequest, SpeculateMode, SpeculativeOptions, SpeculativeStats, StopMatcher,
};
use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::config::GenerationConfig;
use qmk_model::tokenizer::Tokenizer;
use qmk_model::{Config, Weights};

use crate::backend::AnyBackend;
use crate::gpu::{self, GpuError};
use crate::hub;
use crate::output::usage;
use crate::ui::Ui;

/// Most KV-cache positions a flag may ask for: positions are 32-bit in the
/// kernel. The memory check refuses far fewer on any real machine, before
/// anything is allocated.
pub const MAX_POSITIONS: i64 = u32::MAX as i64;

/// Most entries `--top-logprobs` may ask for at each generated position (as
/// many as OpenAI's API gives): the records grow with it times the tokens.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Longest text read from stdin at once (the `--prompt -` prompt, one chat
/// message): far more than any context holds (128k tokens are under 1 MB).
pub const MAX_STDIN_BYTES: u64 = 64 << 20;

/// The parser of a whole-number flag value in `range`: anything else (a
/// negative number, one past the range however long, not a number) is a
/// usage error that names the flag and the range. Flags using it also set
/// `allow_negative_numbers`, so `-3` reaches it instead of reading as a flag.
pub fn whole<T>(range: RangeInclusive<i64>) -> impl TypedValueParser<Value = T>
where
    T: TryFrom<i64> + Clone + Send + Sync + 'static,
{
    move |s: &str| -> std::result::Result<T, String> {
        let (lo, hi) = (*range.start(), *range.end());
        let digits = s.strip_prefix('-').unwrap_or(s);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("`{s}` is not a whole number in {lo}..={hi}"));
        }
        // Too long for i64 is out of range too.
        let v = s.parse::<i64>().ok().filter(|v| range.contains(v));
        v.and_then(|v| T::try_from(v).ok())
            .ok_or_else(|| format!("{s} is not in {lo}..={hi}"))
    }
}

/// The parser of a real-number flag value `check` accepts; `what` says
/// which values those are.
fn real(what: &'static str, check: fn(f32) -> bool) -> impl TypedValueParser<Value = f32> {
    move |s: &str| -> std::result::Result<f32, String> {
        match s.trim().parse::<f32>() {
            Ok(v) if check(v) => Ok(v),
            _ => Err(format!("{s} is not {what}")),
        }
    }
}

/// The parser of `--revision`: a branch, tag or commit name that stays a
/// plain name under the cache's `refs/` (checked before anything is read).
fn revision(s: &str) -> std::result::Result<String, String> {
    match hub::revision_problem(s) {
        None => Ok(s.to_string()),
        Some(why) => Err(format!("not a branch, tag or commit: {why}")),
    }
}

/// Which model to run.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Hugging Face model id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or a local
    /// model directory (config.json, tokenizer.json, *.safetensors).
    #[arg(long, short = 'm', value_name = "HUB_ID|DIR")]
    pub model: String,

    /// Branch, tag or commit of a Hub model.
    #[arg(long, default_value = "main", value_parser = revision)]
    pub revision: String,
}

/// `--backend` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// A GPU backend when a CUDA device is present, else the CPU reference.
    Auto,
    /// The megakernel through cudarc.
    Cudarc,
    /// The megakernel through cust (needs the `cust` build feature).
    Cust,
    /// The CPU reference (slow; no GPU needed).
    Cpu,
}

/// How to run.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Which backend runs the decode step.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,

    /// KV-cache capacity in positions (prompt plus generated tokens), at
    /// most the model's maximum context. Default on a GPU: the largest that
    /// fits its free memory, up to that maximum; on the CPU: what the
    /// request needs (generate) or min(maximum, 8192) (chat, serve).
    #[arg(long, value_name = "POSITIONS", allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_POSITIONS))]
    pub context: Option<usize>,

    /// GPU backends: load this cubin (from `qwen-mk compile`) instead of
    /// compiling the megakernel with NVRTC.
    #[arg(long, value_name = "FILE")]
    pub cubin: Option<PathBuf>,

    /// GPU backends: prompt positions per launch of the tensor-core prefill
    /// kernel (clamped to the context).
    #[arg(long, value_name = "POSITIONS", default_value_t = qmk_gpu::DEFAULT_PREFILL_CHUNK,
          allow_negative_numbers = true, value_parser = whole::<u32>(1..=MAX_POSITIONS))]
    pub prefill_chunk: u32,

    /// GPU backends: feed the prompt one decode step per token instead of
    /// the tensor-core prefill kernel.
    #[arg(long)]
    pub no_batched_prefill: bool,

    /// Tensor parallelism: split the model over N GPUs (devices 0 .. N-1,
    /// one megakernel launch each per step; the model's KV heads must divide
    /// by N). On the CPU backend: the reference split the same way.
    #[arg(long, value_name = "N", default_value_t = 1, allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=qmk_kernels::TP_MAX_RANKS as i64))]
    pub tp: usize,

    /// With --tp: run every rank on GPU 0, each on its share of the SMs
    /// (checks the group on a machine with one GPU; no faster than one GPU).
    #[arg(long, requires = "tp")]
    pub tp_co_resident: bool,

    /// No progress bars, notes or stats on stderr (errors still show).
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Sampling and stopping. The sampling values left unset come from the
/// model's `generation_config.json` (see [`SamplingArgs::options`]).
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Upper bound on generated tokens (cut to what fits the context).
    #[arg(long, default_value_t = 256, value_name = "N", allow_negative_numbers = true,
          value_parser = whole::<usize>(1..=MAX_POSITIONS))]
    pub max_new_tokens: usize,

    /// Softmax temperature, finite and >= 0; 0 is greedy decoding (the
    /// argmax of the logits). Default: the model's generation_config.json
    /// (greedy when it does not sample or is missing).
    #[arg(long, value_name = "T", allow_negative_numbers = true,
          value_parser = real("a finite number >= 0", |t| t.is_finite() && t >= 0.0))]
    pub temperature: Option<f32>,

    /// Sample only among the K most likely tokens (0: no limit). Default:
    /// the model's.
    #[arg(long, value_name = "K", allow_negative_numbers = true,
          value_parser = whole::<usize>(0..=u32::MAX as i64))]
    pub top_k: Option<usize>,

    /// Sample only from the smallest set of tokens whose probability reaches
    /// P, in (0, 1]. Default: the model's.
    #[arg(long, allow_negative_numbers = true, value_name = "P",
          value_parser = real("in (0, 1]", |p| p > 0.0 && p <= 1.0))]
    pub top_p: Option<f32>,

    /// Drop tokens less likely than P times the most likely one, in [0, 1]
    /// (0: off). Default: the model's.
    #[arg(long, allow_negative_numbers = true, value_name = "P",
          value_parser = real("in [0, 1]", |p| (0.0..=1.0).contains(&p)))]
    pub min_p: Option<f32>,

    /// Divide positive and multiply negative logits of every token already
    /// in the prompt or the reply by R, finite and > 0 (1: off). Default:
    /// the model's when sampling, 1 with --temperature 0.
    #[arg(long, allow_negative_numbers = true, value_name = "R",
          value_parser = real("a finite number > 0", |r| r.is_finite() && r > 0.0))]
    pub repetition_penalty: Option<f32>,

    /// Subtract X from the logit of every token generated so far, in
    /// [-2, 2] (0: off).
    #[arg(long, allow_negative_numbers = true, value_name = "X",
          value_parser = real("in [-2, 2]", |x| (-2.0..=2.0).contains(&x)))]
    pub presence_penalty: Option<f32>,

    /// Subtract X times its count from the logit of every token generated
    /// so far, in [-2, 2] (0: off).
    #[arg(long, allow_negative_numbers = true, value_name = "X",
          value_parser = real("in [-2, 2]", |x| (-2.0..=2.0).contains(&x)))]
    pub frequency_penalty: Option<f32>,

    /// Seed for sampling: the same seed gives the same tokens. Default: a
    /// random seed, reported (`--json`, the stats line) so the run can be
    /// repeated.
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,

    /// End the reply where the text contains S (not shown, not kept);
    /// repeatable, at most 16, each 1 to 256 bytes.
    #[arg(long, value_name = "S", value_parser = stop_string)]
    pub stop: Vec<String>,

    /// Keep generating past the model's end-of-turn / end-of-text tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// `--speculate` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculateChoice {
    /// Greedy decoding speculates (with --draft-model when given, else
    /// prompt lookup) while acceptance pays; sampling runs plain steps.
    Auto,
    /// Prompt lookup: guesses copied from the prompt and the output so far.
    Ngram,
    /// Guesses from --draft-model.
    Draft,
    /// No speculation.
    Off,
}

impl SpeculateChoice {
    /// The engine's mode.
    pub fn mode(self) -> SpeculateMode {
        match self {
            SpeculateChoice::Auto => SpeculateMode::Auto,
            SpeculateChoice::Ngram => SpeculateMode::Ngram,
            SpeculateChoice::Draft => SpeculateMode::Draft,
            SpeculateChoice::Off => SpeculateMode::Off,
        }
    }
}

/// Speculative decoding: guesses checked several at a time in one step of
/// the model. Greedy output is the same with or without it; sampled output
/// has the same distribution, but a fixed --seed gives other tokens.
#[derive(Debug, Clone, Args)]
pub struct SpeculateArgs {
    /// Where guesses come from: auto (the default: greedy decoding
    /// speculates with --draft-model when given, else with prompt lookup,
    /// and runs plain steps while the guesses are too often wrong to pay;
    /// sampling runs plain), ngram (prompt lookup), draft (--draft-model),
    /// off.
    #[arg(long, value_enum, default_value_t = SpeculateChoice::Auto)]
    pub speculate: SpeculateChoice,

    /// A smaller model of the same vocabulary that drafts the guesses (e.g.
    /// Qwen/Qwen2.5-0.5B-Instruct for a larger Qwen2.5): Hub id or local
    /// directory, as --model.
    #[arg(long, value_name = "HUB_ID|DIR")]
    pub draft_model: Option<String>,

    /// Branch, tag or commit of a Hub --draft-model.
    #[arg(long, default_value = "main", value_parser = revision, requires = "draft_model")]
    pub draft_revision: String,

    /// Verify the most guesses (7) at every step, however often they are
    /// wrong, instead of weighing acceptance against cost: for
    /// measurements and tests.
    #[arg(long)]
    pub speculate_always: bool,
}

impl SpeculateArgs {
    /// Checks the flags against each other before anything is loaded.
    pub fn check(&self) -> Result<()> {
        if self.speculate == SpeculateChoice::Draft && self.draft_model.is_none() {
            return Err(usage("--speculate draft needs --draft-model"));
        }
        if self.draft_model.is_some()
            && matches!(
                self.speculate,
                SpeculateChoice::Ngram | SpeculateChoice::Off
            )
        {
            return Err(usage(format!(
                "--draft-model is unused with --speculate {}",
                if self.speculate == SpeculateChoice::Ngram {
                    "ngram"
                } else {
                    "off"
                }
            )));
        }
        Ok(())
    }

    /// The engine's speculation options.
    pub fn options(&self) -> SpeculativeOptions {
        SpeculativeOptions {
            mode: self.speculate.mode(),
            adaptive: !self.speculate_always,
            ..SpeculativeOptions::default()
        }
    }

    /// Opens the draft model, when one is given, next to `target`: its
    /// files, its vocabulary checked against the target's, its weights on
    /// the same kind of backend with a KV cache of `capacity` positions.
    pub fn open_draft(
        &self,
        target: &Model,
        on: &Target,
        run: &RunArgs,
        capacity: usize,
        ui: &Ui,
    ) -> Result<Option<DraftModel<AnyBackend>>> {
        let Some(spec) = &self.draft_model else {
            return Ok(None);
        };
        let args = ModelArgs {
            model: spec.clone(),
            revision: self.draft_revision.clone(),
        };
        let draft = Model::open(&args, ui).context("--draft-model")?;
        fn vocab(m: &Model) -> ModelVocab<'_> {
            ModelVocab {
                name: &m.name,
                tokenizer: &m.tokenizer,
                rows: m.config.vocab_size,
            }
        }
        // Refused before any weights are read.
        qmk_engine::draft::check_vocabularies(vocab(&draft), vocab(target))
            .map_err(engine_error)?;
        let cost = qmk_engine::draft::relative_cost(&draft.config, &target.config)
            .map_err(engine_error)?;
        // The draft runs on one GPU whatever the target's group.
        let run = RunArgs {
            context: Some(capacity),
            tp: 1,
            tp_co_resident: false,
            ..run.clone()
        };
        let backend =
            open_backend(&draft, on.clone(), &run, capacity, ui).context("--draft-model")?;
        let model =
            DraftModel::new(backend, vocab(&draft), vocab(target), cost).map_err(engine_error)?;
        ui.note(format!(
            "drafting with {} (a guess costs {:.3} of a step of {})",
            draft.name, cost, target.name
        ));
        Ok(Some(model))
    }
}

/// Sets the draft model of `engine`, if there is one.
pub fn with_draft(
    mut engine: Engine<AnyBackend>,
    draft: Option<DraftModel<AnyBackend>>,
) -> Engine<AnyBackend> {
    engine.set_drafter(draft.map(|d| Box::new(d) as Box<dyn qmk_engine::draft::Drafter + Send>));
    engine
}

/// The parser of `--stop`: non-empty and at most the engine's length.
fn stop_string(s: &str) -> std::result::Result<String, String> {
    if s.is_empty() {
        return Err("an empty stop string never ends anything".into());
    }
    if s.len() > qmk_engine::text::MAX_STOP_BYTES {
        return Err(format!(
            "a stop string of {} bytes is longer than {}",
            s.len(),
            qmk_engine::text::MAX_STOP_BYTES
        ));
    }
    Ok(s.to_string())
}

impl SamplingArgs {
    /// The flags as a request: the values given, the rest left to the
    /// model's defaults.
    pub fn request(&self) -> SamplingRequest {
        SamplingRequest {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        }
    }

    /// Checks the values before anything is downloaded or loaded: each flag
    /// on its own (its parser), the stop strings, and the set against
    /// greedy defaults.
    pub fn check(&self) -> Result<()> {
        if self.stop.len() > qmk_engine::text::MAX_STOP_STRINGS {
            return Err(usage(format!(
                "--stop: {} stop strings, at most {}",
                self.stop.len(),
                qmk_engine::text::MAX_STOP_STRINGS
            )));
        }
        self.stop_matcher()?;
        self.request()
            .resolve(&SamplingDefaults::GREEDY)
            .map_err(engine_error)?;
        Ok(())
    }

    /// A matcher for the `--stop` strings.
    pub fn stop_matcher(&self) -> Result<StopMatcher> {
        StopMatcher::new(self.stop.iter().cloned()).map_err(engine_error)
    }

    /// The generation options for `model`: the sampling flags given, else
    /// the model's `generation_config.json` values, else greedy (see
    /// [`SamplingRequest::resolve`]); an unset seed is drawn at random.
    pub fn options(&self, model: &Model) -> Result<GenerateOptions> {
        let defaults = SamplingDefaults::from_generation_config(&model.generation);
        Ok(GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: self.request().resolve(&defaults).map_err(engine_error)?,
            stop_ids: model.stop_ids(),
            ignore_eos: self.ignore_eos,
            speculation: SpeculativeOptions::default(),
        })
    }
}

/// A model's files, loaded except for the weights.
pub struct Model {
    /// `--model` as given.
    pub name: String,
    pub dir: PathBuf,
    pub config: Config,
    pub generation: GenerationConfig,
    pub tokenizer: Tokenizer,
}

impl Model {
    /// Finds the model (local directory or Hub download, checked) and loads
    /// its config, generation config and tokenizer.
    pub fn open(args: &ModelArgs, ui: &Ui) -> Result<Model> {
        let dir = locate(&args.model, &args.revision, ui)?;
        let config = Config::from_file(&dir.join("config.json"))?;
        let generation = GenerationConfig::from_dir_or_config(&dir, &config)?;
        let tokenizer = Tokenizer::from_dir(&dir)?;
        Ok(Model {
            name: args.model.clone(),
            dir,
            config,
            generation,
            tokenizer,
        })
    }

    /// The chat template shipped with the model.
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        ChatTemplate::from_dir(&self.dir).with_context(|| {
            format!(
                "model `{}` has no usable chat template (use --raw to feed the prompt as-is)",
                self.name
            )
        })
    }

    /// End-of-turn / end-of-text ids: generation_config.json, else config.json.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids = self.generation.eos_token_id.clone();
        if ids.is_empty() {
            ids = self.config.eos_token_ids();
        }
        ids
    }

    /// Renders a conversation and tokenizes it (no special tokens added: the
    /// template carries them).
    /// A template that renders nothing (or only blanks) is an error naming
    /// it, not an empty prompt.
    pub fn encode_chat(&self, template: &ChatTemplate, messages: &[Message]) -> Result<Vec<u32>> {
        let text = template.render(messages, true)?;
        if text.trim().is_empty() {
            bail!(
                "{}: chat template: rendered an empty prompt{} for {} message(s)",
                template.origin(),
                if text.is_empty() {
                    ""
                } else {
                    " (only blanks)"
                },
                messages.len()
            );
        }
        Ok(self.tokenizer.encode(&text)?)
    }

    /// Opens the checkpoint for streaming (every tensor checked, nothing
    /// read), with a spinner.
    pub fn weight_source(&self, ui: &Ui) -> Result<qmk_model::CheckpointSource> {
        let bar = ui.spinner(format!("checking the weights in {}", self.dir.display()));
        let s = qmk_model::CheckpointSource::open(&self.dir);
        bar.finish_and_clear();
        Ok(s?)
    }

    /// Loads the weights (bf16, stacked), with a spinner.
    pub fn load_weights(&self, ui: &Ui) -> Result<Arc<Weights>> {
        let bar = ui.spinner(format!("loading weights from {}", self.dir.display()));
        let w = qmk_model::checkpoint::load_weights(&self.dir);
        bar.finish_and_clear();
        Ok(Arc::new(w?))
    }
}

/// A local model directory, or the snapshot directory of a Hub download.
pub fn locate(spec: &str, revision: &str, ui: &Ui) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            bail!("model directory {} has no config.json", path.display());
        }
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        bail!("--model {spec}: not a directory (pass the model's directory, not a file)");
    }
    let local_looking = spec.starts_with(['.', '/', '~']) || spec.contains('\\');
    if local_looking || !hub::looks_like_repo_id(spec) {
        bail!("--model {spec}: no such directory, and not a Hugging Face model id (owner/name)");
    }
    hub::fetch_model(spec, revision, ui)
}

/// The model's longest context and the config field it comes from:
/// `max_position_embeddings`, or with YaRN the scaled context.
pub fn model_context(config: &Config) -> (usize, &'static str) {
    let max = config.max_context();
    if max == config.max_position_embeddings {
        (max, "max_position_embeddings")
    } else {
        (
            max,
            "YaRN context (factor x original_max_position_embeddings)",
        )
    }
}

/// Default KV-cache capacity of a long-lived session (`chat`, `serve`),
/// capped by the model's own limit.
pub const SESSION_CONTEXT: usize = 8192;

/// The KV-cache capacity of a session that serves many prompts: `--context`
/// (at most the model's maximum), else the model's maximum up to
/// [`SESSION_CONTEXT`]. A GPU backend without `--context` may take more.
pub fn session_context(config: &Config, context: Option<usize>) -> Result<usize> {
    let (model_max, max_name) = model_context(config);
    match context {
        Some(c) if c > model_max => {
            bail!("--context {c} exceeds the model's {max_name} ({model_max})")
        }
        Some(c) => Ok(c),
        None => Ok(model_max.min(SESSION_CONTEXT)),
    }
}

/// Checks a prompt's length against the model and the requested context,
/// and settles the KV capacity and the number of new tokens. Returns
/// (capacity, max_new_tokens).
pub fn plan_context(
    config: &Config,
    prompt_len: usize,
    max_new: usize,
    context: Option<usize>,
    ui: &Ui,
) -> Result<(usize, usize)> {
    let (model_max, max_name) = model_context(config);
    if let Some(c) = context {
        if c > model_max {
            bail!("--context {c} exceeds the model's {max_name} ({model_max})");
        }
    }
    let limit = context.unwrap_or(model_max);
    if prompt_len > limit {
        let what = if context.is_some() {
            format!("the context (--context {limit})")
        } else {
            format!("the model's context ({max_name} = {limit})")
        };
        bail!("prompt too long: {prompt_len} tokens do not fit in {what}");
    }
    // The last generated token is never fed back: prompt + new - 1 positions.
    let room = limit - prompt_len + 1;
    let new = if max_new > room {
        ui.note(format!(
            "note: only {room} new tokens fit after the {prompt_len}-token prompt (context {limit}); generating at most {room}"
        ));
        room
    } else {
        max_new
    };
    let capacity = context.unwrap_or(prompt_len + new - 1);
    Ok((capacity.max(1), new))
}

/// New tokens a `prompt_len`-token request for `max_new` gets in a KV
/// cache of `capacity` positions (the last generated token is never fed
/// back); a prompt that does not fit is an error.
pub fn fit_request(prompt_len: usize, max_new: usize, capacity: usize, ui: &Ui) -> Result<usize> {
    if prompt_len > capacity {
        bail!(
            "prompt too long: {prompt_len} tokens do not fit in the {capacity}-position context \
             that fits the device"
        );
    }
    let room = capacity - prompt_len + 1;
    if max_new > room {
        ui.note(format!(
            "note: only {room} new tokens fit after the {prompt_len}-token prompt (context \
             {capacity}); generating at most {room}"
        ));
        return Ok(room);
    }
    Ok(max_new)
}

/// Estimated host memory of the CPU backend: bf16 weights, an f32 KV cache
/// and the rotary tables.
pub fn cpu_bytes(config: &Config, capacity: usize) -> (u128, u128) {
    let weights = qmk_model::inventory::weight_bytes(config)
        .map(|b| b.total.0 as u128)
        .unwrap_or(0);
    let per_pos = config.num_hidden_layers as u128 * config.kv_dim() as u128 * 2 * 4
        + config.head_dim() as u128 * 4;
    (weights, per_pos * capacity as u128)
}

/// Available host memory from /proc/meminfo, when known.
pub fn available_memory() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

const GIB: f64 = (1u64 << 30) as f64;

/// Checks the CPU backend fits in host memory before allocating anything.
pub fn check_cpu_memory(config: &Config, capacity: usize) -> Result<()> {
    let (w, kv) = cpu_bytes(config, capacity);
    if let Some(avail) = available_memory() {
        if w + kv > avail {
            bail!(
                "out of memory: the cpu backend needs about {:.2} GiB (weights {:.2} GiB + KV cache {:.2} GiB for {capacity} positions) but only {:.2} GiB is available; lower --context",
                (w + kv) as f64 / GIB,
                w as f64 / GIB,
                kv as f64 / GIB,
                avail as f64 / GIB
            );
        }
    }
    Ok(())
}

/// The backend `choice` resolves to here, before weights are loaded: a GPU
/// (with its description) or the CPU. Explicit GPU choices fail without one.
#[derive(Clone)]
pub enum Target {
    Cpu,
    Gpu(BackendKind, gpu::GpuInfo),
}

pub fn choose_target(choice: BackendChoice, ui: &Ui) -> Result<Target> {
    match choice {
        BackendChoice::Cpu => Ok(Target::Cpu),
        BackendChoice::Auto => match gpu::probe() {
            Ok(info) => Ok(Target::Gpu(BackendKind::Cudarc, info)),
            Err(e) => {
                ui.note(format!("{e}; using the CPU reference backend (slow)"));
                Ok(Target::Cpu)
            }
        },
        BackendChoice::Cudarc | BackendChoice::Cust => {
            let kind = if choice == BackendChoice::Cudarc {
                BackendKind::Cudarc
            } else {
                BackendKind::Cust
            };
            if kind == BackendKind::Cust && !cfg!(feature = "cust") {
                return Err(GpuError::NoCustFeature.into());
            }
            let info = gpu::probe().map_err(|e| anyhow!("--backend {}: {e}", kind.name()))?;
            Ok(Target::Gpu(kind, info))
        }
    }
}

/// Builds the backend for `target` with a KV cache of `capacity`
/// positions. A GPU backend streams the weights from the checkpoint's files
/// to the device (host memory stays at a few pinned buffers); without
/// `--context` it takes the largest context the device's free memory holds,
/// up to the model's maximum, and says so in one line (`capacity`, what the
/// request needs, is then only the minimum checked up front). The CPU
/// backend loads the weights into host memory. With `--backend auto`, a GPU
/// backend that cannot start (other than for lack of memory) falls back to
/// the CPU, saying so.
pub fn open_backend(
    model: &Model,
    target: Target,
    run: &RunArgs,
    capacity: usize,
    ui: &Ui,
) -> Result<AnyBackend> {
    let auto = run.backend == BackendChoice::Auto;
    if let Some(c) = &run.cubin {
        if !c.is_file() {
            bail!("--cubin {}: no such file", c.display());
        }
    }
    let (kind, info) = match target {
        Target::Cpu => {
            check_cpu_memory(&model.config, capacity)?;
            return cpu_backend(model.load_weights(ui)?, capacity, run.tp);
        }
        Target::Gpu(kind, info) => (kind, info),
    };
    if run.tp > 1 {
        return open_group(model, kind, &info, run, capacity, ui);
    }
    // Before reading anything: a model that cannot fit is refused here.
    let chunk = (!run.no_batched_prefill).then_some(run.prefill_chunk);
    gpu::check_fits(&model.config, capacity, chunk, &info)
        .map_err(|e| anyhow!("--backend {}: {e}", kind.name()))?;
    let source = model.weight_source(ui)?;
    let fit = run.context.is_none();
    let max = model.config.max_context();
    let asked = if fit { max.max(capacity) } else { capacity };
    let gpu_backend = gpu::open(
        kind,
        &info,
        &source,
        asked,
        fit,
        run.cubin.as_deref(),
        chunk,
        None,
        ui,
    );
    drop(source);
    match gpu_backend {
        Ok(b) => {
            ui.note(format!(
                "using the {} backend on {}",
                kind.name(),
                info.name
            ));
            if fit {
                ui.note(format!(
                    "context: {} positions, the largest that fits the free memory of {} (model \
                     maximum {max}; --context sets it)",
                    b.capacity(),
                    info.name
                ));
            }
            Ok(b)
        }
        Err(e @ GpuError::OutOfMemory { .. }) => Err(anyhow!("--backend {}: {e}", kind.name())),
        Err(e) if auto => {
            ui.note(format!(
                "the {} backend cannot run on {} ({e}); using the CPU reference backend (slow)",
                kind.name(),
                info.name
            ));
            check_cpu_memory(&model.config, capacity)?;
            cpu_backend(model.load_weights(ui)?, capacity, 1)
        }
        Err(e) => Err(anyhow!("--backend {}: {e}", kind.name())),
    }
}

/// `--tp N` on GPUs: the model split over N ranks (N GPUs, or co-resident on
/// one), refused with the reason when the machine or the model cannot take
/// it; never a silent fallback to fewer GPUs.
fn open_group(
    model: &Model,
    kind: BackendKind,
    info: &gpu::GpuInfo,
    run: &RunArgs,
    capacity: usize,
    ui: &Ui,
) -> Result<AnyBackend> {
    let flag = format!("--tp {}", run.tp);
    gpu::check_fits_tp(&model.config, capacity, run.tp, run.tp_co_resident, info)
        .map_err(|e| anyhow!("{flag}: {e}"))?;
    let source = model.weight_source(ui)?;
    let fit = run.context.is_none();
    let max = model.config.max_context();
    let asked = if fit { max.max(capacity) } else { capacity };
    let tp = qmk_gpu::TpOptions {
        co_resident: run.tp_co_resident,
        ..qmk_gpu::TpOptions::new(run.tp)
    };
    let b = gpu::open(
        kind,
        info,
        &source,
        asked,
        fit,
        run.cubin.as_deref(),
        None,
        Some(&tp),
        ui,
    )
    .map_err(|e| anyhow!("{flag} (--backend {}): {e}", kind.name()))?;
    ui.note(format!(
        "using the {} backend over {} ranks ({}), context {} positions",
        kind.name(),
        run.tp,
        if run.tp_co_resident {
            format!("co-resident on {}", info.name)
        } else {
            format!("GPUs 0..{}", run.tp - 1)
        },
        b.capacity()
    ));
    Ok(b)
}

fn cpu_backend(weights: Arc<Weights>, capacity: usize, tp: usize) -> Result<AnyBackend> {
    if tp > 1 {
        let b = qmk_engine::CpuTpBackend::new(weights, tp, capacity)
            .with_context(|| format!("--tp {tp}: cannot split the model"))?;
        return Ok(AnyBackend::new(b));
    }
    let b =
        qmk_engine::CpuBackend::new(weights, capacity).context("cannot start the cpu backend")?;
    Ok(AnyBackend::new(b))
}

/// An engine error as one readable line (a backend error's causes joined
/// once, not repeated).
pub fn engine_error(e: EngineError) -> anyhow::Error {
    match e {
        EngineError::Backend { backend, source } => {
            anyhow!(
                "{backend} backend: {}",
                qmk_engine::error_chain(source.as_ref())
            )
        }
        other => anyhow!("{other}"),
    }
}

/// What speculation did, for `--json`.
pub fn speculation_json(s: &SpeculativeStats) -> serde_json::Value {
    serde_json::json!({
        "mode": s.mode.name(),
        "proposed": s.proposed,
        "accepted": s.accepted,
        "acceptance": s.acceptance(),
        "steps": s.steps,
        "verify_steps": s.verifies,
        "tokens_per_step": s.tokens_per_step(),
    })
}

/// The closing stats line; `seed` when the tokens were sampled (so the
/// run can be repeated with `--seed`).
pub fn stats_line(g: &Generation, backend: &str, seed: Option<u64>) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let prefill_rate = if g.prefill.is_zero() {
        0.0
    } else {
        g.prompt_ids.len() as f64 / g.prefill.as_secs_f64()
    };
    let sampled = seed.map_or(String::new(), |s| format!("; sampled with --seed {s}"));
    let s = &g.speculation;
    let speculated = if s.mode == SpeculateMode::Off {
        String::new()
    } else {
        format!(
            "; speculation {}: {} of {} guesses accepted, {:.2} tokens/step over {} steps ({} verifies)",
            s.mode.name(),
            s.accepted,
            s.proposed,
            s.tokens_per_step(),
            s.steps,
            s.verifies
        )
    };
    format!(
        "[{backend}] prompt {} tokens, prefill {:.1} ms ({:.1} tok/s); generated {} tokens, decode {:.2} tok/s{speculated}{sampled}",
        g.prompt_ids.len(),
        ms(g.prefill),
        prefill_rate,
        g.output_ids.len(),
        g.decode_tok_per_s()
    )
}
