//! The request bodies of `/v1/chat/completions` and `/v1/completions`:
//! parsing (a known field of the wrong type names the field; unknown fields
//! are ignored, as OpenAI's clients expect), validation, and the one mapping
//! from request parameters to the engine's [`GenerateOptions`].

use qmk_engine::{EngineError, GenerateOptions, SamplingRequest, StopMatcher};
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::Value;

use crate::ServerError;

/// Most stop strings a request may give (OpenAI allows 4; vLLM more).
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// A request body that has the shared fields ([`CommonFields`]) besides its
/// own.
pub trait WithCommon: DeserializeOwned {
    /// Where the shared fields go.
    fn common_mut(&mut self) -> &mut CommonFields;
}

/// Parses a JSON body into `T` and its shared fields: malformed JSON and a
/// known field of the wrong type are 400s, the latter naming the field.
pub fn parse_body<T: WithCommon>(body: &[u8]) -> Result<T, ServerError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ServerError::InvalidRequest {
        message: format!("the body is not valid JSON: {e}"),
        param: None,
        code: None,
    })?;
    let mut parsed: T = from_value(&value)?;
    *parsed.common_mut() = from_value(&value)?;
    Ok(parsed)
}

fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ServerError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != ".").then_some(path);
        let message = match &param {
            Some(p) => format!("invalid value for `{p}`: {inner}"),
            None => format!("invalid request body: {inner}"),
        };
        ServerError::InvalidRequest {
            message,
            param,
            code: None,
        }
    })
}

/// A sampling seed: any JSON integer in `i64` or `u64` range (OpenAI's is
/// a signed 64-bit integer); negative values keep their bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The fields both endpoints share, as sent.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    /// The model to use; must be the served one when given.
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Softmax temperature, in [0, 2]; 0 is greedy.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass, in (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k cutoff (vLLM's extension); 0 or -1 mean none.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p cutoff (vLLM's extension), in [0, 1].
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<Seed>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Number of choices; only 1 is served.
    #[serde(default)]
    pub n: Option<u64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Presence penalty, in [-2, 2].
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty, in [-2, 2].
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (vLLM's extension), > 0.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
}

/// Validated generation parameters of one request. `None` means the request
/// did not say, so the engine's (or the model's) default applies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenParams {
    /// Most tokens to generate; `None`: as many as the context holds.
    pub max_tokens: Option<usize>,
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k cutoff.
    pub top_k: Option<usize>,
    /// Min-p cutoff.
    pub min_p: Option<f32>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// Stop strings (none empty).
    pub stop: Vec<String>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f32>,
}

/// How the answer is delivered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delivery {
    /// Server-sent events.
    pub stream: bool,
    /// With `stream`, a last chunk carrying the usage counts.
    pub include_usage: bool,
}

fn check_range(
    v: Option<f32>,
    name: &str,
    ok: impl Fn(f32) -> bool,
    what: &str,
) -> Result<Option<f32>, ServerError> {
    match v {
        Some(x) if !(x.is_finite() && ok(x)) => Err(ServerError::invalid(
            format!("`{name}` is {x}; it must be {what}"),
            name,
        )),
        _ => Ok(v),
    }
}

impl CommonFields {
    /// Checks every value; `max_tokens` is the value to use for it (chat
    /// has two names for it).
    pub fn validate(&self, max_tokens: Option<u64>) -> Result<(GenParams, Delivery), ServerError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ServerError::invalid(
                    format!("`n` is {n}; this server generates one choice per request (n = 1)"),
                    "n",
                ));
            }
        }
        let max_tokens = match max_tokens {
            Some(0) => {
                return Err(ServerError::invalid(
                    "`max_tokens` must be at least 1",
                    "max_tokens",
                ))
            }
            Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
            None => None,
        };
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => None,
            Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            Some(k) => {
                return Err(ServerError::invalid(
                    format!("`top_k` is {k}; it must be positive, or 0 or -1 for no limit"),
                    "top_k",
                ))
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ServerError::invalid(
                format!(
                    "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
                    stop.len()
                ),
                "stop",
            ));
        }
        if let Some(s) = stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ServerError::invalid(
                format!(
                    "a stop string of {} bytes; each must be 1 to {MAX_STOP_BYTES} bytes",
                    s.len()
                ),
                "stop",
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ServerError::invalid(
                "`stream_options` is only allowed with `stream: true`",
                "stream_options",
            ));
        }
        let params = GenParams {
            max_tokens,
            temperature: check_range(
                self.temperature,
                "temperature",
                |t| (0.0..=2.0).contains(&t),
                "in [0, 2]",
            )?,
            top_p: check_range(self.top_p, "top_p", |p| p > 0.0 && p <= 1.0, "in (0, 1]")?,
            top_k,
            min_p: check_range(
                self.min_p,
                "min_p",
                |p| (0.0..=1.0).contains(&p),
                "in [0, 1]",
            )?,
            seed: self.seed.map(|s| s.0),
            stop,
            presence_penalty: check_range(
                self.presence_penalty,
                "presence_penalty",
                |p| (-2.0..=2.0).contains(&p),
                "in [-2, 2]",
            )?,
            frequency_penalty: check_range(
                self.frequency_penalty,
                "frequency_penalty",
                |p| (-2.0..=2.0).contains(&p),
                "in [-2, 2]",
            )?,
            repetition_penalty: check_range(
                self.repetition_penalty,
                "repetition_penalty",
                |p| p > 0.0,
                "> 0",
            )?,
        };
        Ok((
            params,
            Delivery {
                stream,
                include_usage,
            },
        ))
    }
}

/// The engine options for a request: the ONE place where request
/// parameters become engine settings, for both endpoints.
///
/// Every sampling value the request leaves out takes the model's default
/// from its `generation_config.json` ([`crate::ModelInfo::sampling`]); a
/// temperature of 0 is greedy. Without a `seed` one is drawn at random; the
/// resolved [`qmk_engine::Sampling::seed`] goes back to the client. The
/// model's end-of-turn ids stop generation, and so do the request's stop
/// strings (the returned matcher; the text ends before the first one found).
/// A value the engine refuses is a 400 naming the parameter.
pub fn generate_options(
    params: &GenParams,
    max_new_tokens: usize,
    model: &crate::ModelInfo,
) -> Result<(GenerateOptions, StopMatcher), ServerError> {
    let request = SamplingRequest {
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        repetition_penalty: params.repetition_penalty,
        presence_penalty: params.presence_penalty,
        frequency_penalty: params.frequency_penalty,
        seed: params.seed,
    };
    let refused = |e: EngineError| match e {
        EngineError::InvalidSampling { field, reason } => {
            ServerError::invalid(format!("`{field}`: {reason}"), field)
        }
        other => ServerError::Internal(other.to_string()),
    };
    let sampling = request.resolve(&model.sampling).map_err(refused)?;
    let stops = StopMatcher::new(params.stop.iter().cloned()).map_err(refused)?;
    let options = GenerateOptions {
        max_new_tokens,
        sampling,
        stop_ids: model.stop_ids.clone(),
        ignore_eos: false,
        speculation: model.speculation,
    };
    Ok((options, stops))
}

/// Checks the prompt against the KV-cache capacity and settles how many
/// tokens to generate: `max_tokens`, or all the room left when the request
/// gives none. The last generated token is never fed back, so a request
/// writes `prompt + new - 1` positions (as [`qmk_engine::Engine::check`]
/// counts them).
pub fn fit_to_context(
    prompt_len: usize,
    max_tokens: Option<usize>,
    capacity: usize,
    prompt_param: &str,
) -> Result<usize, ServerError> {
    if prompt_len == 0 {
        return Err(ServerError::invalid(
            "the prompt is empty: it encodes to no tokens",
            prompt_param,
        ));
    }
    let too_long = |asked: Option<usize>| {
        let message = match asked {
            Some(m) => format!(
                "this model's context is {capacity} tokens, but the request needs {} \
                 ({prompt_len} in the prompt, {m} in the completion); shorten the prompt or \
                 lower max_tokens",
                prompt_len.saturating_add(m).saturating_sub(1)
            ),
            None => format!(
                "this model's context is {capacity} tokens, but the prompt has {prompt_len}; \
                 shorten it"
            ),
        };
        ServerError::InvalidRequest {
            message,
            param: Some(prompt_param.to_string()),
            code: Some("context_length_exceeded"),
        }
    };
    if prompt_len > capacity {
        return Err(too_long(max_tokens));
    }
    let room = capacity - prompt_len + 1;
    match max_tokens {
        None => Ok(room),
        Some(m) if m > room => Err(too_long(Some(m))),
        Some(m) => Ok(m),
    }
}

/// A message's `content`: text, or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only `{"type": "text", "text": ...}` is served.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text` (images and audio are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A tool call of an earlier assistant turn.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallIn {
    /// The function called.
    pub function: FunctionCallIn,
}

/// The function of a tool call.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallIn {
    /// The function's name.
    pub name: String,
    /// Its arguments: a JSON text (OpenAI's form) or an object.
    #[serde(default)]
    pub arguments: Value,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (absent or null for an assistant turn with tool calls).
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallIn>>,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// The newer name of `max_tokens`; wins when both are given.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `auto` or `none`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Token log-probabilities (not served).
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// `{"type": "text"}` only.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// The fields both endpoints share (filled by [`parse_body`]).
    #[serde(skip)]
    pub common: CommonFields,
}

impl WithCommon for ChatRequest {
    fn common_mut(&mut self) -> &mut CommonFields {
        &mut self.common
    }
}

/// A validated chat request.
#[derive(Debug, Clone)]
pub struct ChatJob {
    /// The messages as the chat template sees them (roles normalised, text
    /// content, tool-call arguments as objects).
    pub messages: Vec<Value>,
    /// The tools to offer (`None` when none are given or `tool_choice` is
    /// `none`): the model's output is then parsed for tool calls.
    pub tools: Option<Vec<Value>>,
    /// Generation parameters.
    pub params: GenParams,
    /// Streaming or not.
    pub delivery: Delivery,
}

fn content_text(c: &Content, param: &str) -> Result<String, ServerError> {
    match c {
        Content::Text(t) => Ok(t.clone()),
        Content::Parts(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ServerError::invalid(
                            "a text part has no `text`",
                            format!("{param}[{j}].text"),
                        ))
                    }
                    (other, _) => {
                        return Err(ServerError::invalid(
                            format!(
                                "content parts of type `{other}` are not supported; only `text`"
                            ),
                            format!("{param}[{j}].type"),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

impl ChatRequest {
    /// Checks the request and puts the messages in the template's form.
    pub fn validate(&self) -> Result<ChatJob, ServerError> {
        if self.logprobs == Some(true) {
            return Err(ServerError::invalid(
                "`logprobs` is not supported by this server",
                "logprobs",
            ));
        }
        if let Some(f) = &self.response_format {
            if f.get("type").and_then(Value::as_str) != Some("text") {
                return Err(ServerError::invalid(
                    "only `response_format: {\"type\": \"text\"}` is supported",
                    "response_format",
                ));
            }
        }
        let max = self.max_completion_tokens.or(self.common.max_tokens);
        let (params, delivery) = self.common.validate(max).map_err(|e| match e {
            // The limit was given as max_completion_tokens: name that one.
            ServerError::InvalidRequest {
                message,
                param: Some(p),
                code,
            } if p == "max_tokens" && self.max_completion_tokens.is_some() => {
                ServerError::InvalidRequest {
                    message: message.replace("max_tokens", "max_completion_tokens"),
                    param: Some("max_completion_tokens".into()),
                    code,
                }
            }
            e => e,
        })?;
        if self.messages.is_empty() {
            return Err(ServerError::invalid(
                "`messages` is empty; give at least one message",
                "messages",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            messages.push(template_message(m, i)?);
        }
        let tools = self.tools(&self.tool_choice)?;
        Ok(ChatJob {
            messages,
            tools,
            params,
            delivery,
        })
    }

    /// The tools to offer, after checking `tools` and `tool_choice`.
    fn tools(&self, choice: &Option<Value>) -> Result<Option<Vec<Value>>, ServerError> {
        let offer = match choice {
            None | Some(Value::Null) => true,
            Some(Value::String(s)) if s == "auto" => true,
            Some(Value::String(s)) if s == "none" => false,
            Some(Value::String(s)) if s == "required" => {
                return Err(ServerError::invalid(
                    "`tool_choice: \"required\"` is not supported; use `auto` or `none`",
                    "tool_choice",
                ))
            }
            Some(Value::Object(_)) => {
                return Err(ServerError::invalid(
                    "naming a function in `tool_choice` is not supported; use `auto` or `none`",
                    "tool_choice",
                ))
            }
            Some(other) => {
                return Err(ServerError::invalid(
                    format!("`tool_choice` is {other}; it must be `auto` or `none`"),
                    "tool_choice",
                ))
            }
        };
        let Some(tools) = self.tools.as_ref().filter(|t| !t.is_empty()) else {
            return Ok(None);
        };
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ServerError::invalid(
                    "only tools of `type: \"function\"` are supported",
                    format!("tools[{i}].type"),
                ));
            }
            let name = t
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            if name.is_none_or(str::is_empty) {
                return Err(ServerError::invalid(
                    "a function tool needs a non-empty `name`",
                    format!("tools[{i}].function.name"),
                ));
            }
        }
        Ok(offer.then(|| tools.clone()))
    }
}

/// One message in the form the chat template reads.
fn template_message(m: &ChatMessage, i: usize) -> Result<Value, ServerError> {
    let param = format!("messages[{i}].content");
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(ServerError::invalid(
                format!("unknown role `{other}`; use system, developer, user, assistant or tool"),
                format!("messages[{i}].role"),
            ))
        }
    };
    let text = m
        .content
        .as_ref()
        .map(|c| content_text(c, &param))
        .transpose()?;
    let calls = m.tool_calls.as_deref().unwrap_or_default();
    if role == "assistant" && !calls.is_empty() {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                // OpenAI sends arguments as JSON text; the template writes
                // them with `tojson`, so an object keeps them JSON once.
                let args = match &c.function.arguments {
                    Value::String(s) => serde_json::from_str::<Value>(s)
                        .unwrap_or_else(|_| Value::String(s.clone())),
                    Value::Null => Value::Object(Default::default()),
                    v => v.clone(),
                };
                serde_json::json!({
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": args},
                })
            })
            .collect();
        return Ok(serde_json::json!({
            "role": role,
            "content": text,
            "tool_calls": calls,
        }));
    }
    let text = match (text, role) {
        (Some(t), _) => t,
        (None, "assistant") => String::new(),
        (None, _) => {
            return Err(ServerError::invalid(
                format!("a `{role}` message needs `content`"),
                param,
            ))
        }
    };
    Ok(serde_json::json!({"role": role, "content": text}))
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// A list of texts (one is served).
    Texts(Vec<String>),
    /// Token ids.
    Ids(Vec<u32>),
    /// A list of token-id lists (one is served).
    IdLists(Vec<Vec<u32>>),
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The raw prompt, fed without the chat template.
    pub prompt: Prompt,
    /// Echo the prompt (not served).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Log-probabilities (not served).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Text after the completion (not served).
    #[serde(default)]
    pub suffix: Option<String>,
    /// Candidates to pick from (only 1).
    #[serde(default)]
    pub best_of: Option<u64>,
    /// The fields both endpoints share (filled by [`parse_body`]).
    #[serde(skip)]
    pub common: CommonFields,
}

impl WithCommon for CompletionRequest {
    fn common_mut(&mut self) -> &mut CommonFields {
        &mut self.common
    }
}

/// The prompt of a validated completion request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

impl CompletionRequest {
    /// Checks the request.
    pub fn validate(&self) -> Result<(PromptInput, GenParams, Delivery), ServerError> {
        let unsupported = |field: &str| {
            ServerError::invalid(format!("`{field}` is not supported by this server"), field)
        };
        if self.echo == Some(true) {
            return Err(unsupported("echo"));
        }
        if self.logprobs.is_some() {
            return Err(unsupported("logprobs"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix"));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ServerError::invalid(
                "`best_of` must be 1 on this server",
                "best_of",
            ));
        }
        let (params, delivery) = self.common.validate(self.common.max_tokens)?;
        let one = |n: usize| {
            (n != 1).then(|| {
                ServerError::invalid(
                    format!("`prompt` is a list of {n} prompts; this server takes one per request"),
                    "prompt",
                )
            })
        };
        let prompt = match &self.prompt {
            Prompt::Text(t) => PromptInput::Text(t.clone()),
            Prompt::Texts(v) => match one(v.len()) {
                Some(e) => return Err(e),
                None => PromptInput::Text(v[0].clone()),
            },
            Prompt::Ids(ids) => PromptInput::Ids(ids.clone()),
            Prompt::IdLists(v) => match one(v.len()) {
                Some(e) => return Err(e),
                None => PromptInput::Ids(v[0].clone()),
            },
        };
        Ok((prompt, params, delivery))
    }
}

/// Checks that `model`, when given, names the served model.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ServerError> {
    match requested {
        Some(m) if m != served => Err(ServerError::ModelNotFound {
            requested: m.to_string(),
            served: served.to_string(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qmk_engine::SamplingDefaults;

    fn chat(body: &str) -> Result<ChatJob, ServerError> {
        parse_body::<ChatRequest>(body.as_bytes())?.validate()
    }

    fn err_param(e: ServerError) -> (u16, Option<String>, String) {
        let status = e.status().as_u16();
        let b = e.body();
        (
            status,
            b["error"]["param"].as_str().map(String::from),
            b["error"]["message"].as_str().unwrap().to_string(),
        )
    }

    #[test]
    fn a_full_chat_request_parses_and_unknown_fields_are_ignored() {
        let job = chat(
            r#"{"model": "m", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
              "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9,
              "seed": -3, "stop": "\n\n", "n": 1, "stream": true,
              "stream_options": {"include_usage": true}, "presence_penalty": 0.1,
              "frequency_penalty": -0.1, "user": "someone", "some_future_field": {"a": [1]},
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
              "tool_choice": "auto", "parallel_tool_calls": true}"#,
        )
        .unwrap();
        assert_eq!(job.params.max_tokens, Some(7));
        assert_eq!(job.params.temperature, Some(0.5));
        assert_eq!(job.params.seed, Some((-3i64) as u64));
        assert_eq!(job.params.stop, ["\n\n"]);
        assert_eq!(job.params.presence_penalty, Some(0.1));
        assert!(job.delivery.stream && job.delivery.include_usage);
        assert_eq!(job.messages[0]["role"], "system");
        assert_eq!(job.messages[1]["content"], "ab");
        // Arguments become an object so the template writes them once.
        assert_eq!(
            job.messages[2]["tool_calls"][0]["function"]["arguments"]["x"],
            1
        );
        assert_eq!(job.messages[3]["role"], "tool");
        assert_eq!(job.tools.as_ref().unwrap().len(), 1);
    }

    #[test]
    fn wrong_types_and_malformed_json_are_400_naming_the_field() {
        let (s, p, m) = err_param(
            chat(r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#)
                .unwrap_err(),
        );
        assert_eq!((s, p.as_deref()), (400, Some("temperature")));
        assert!(m.contains("temperature"), "{m}");
        let (s, p, _) =
            err_param(chat(r#"{"messages": [{"role": 5, "content": "x"}]}"#).unwrap_err());
        assert_eq!((s, p.as_deref()), (400, Some("messages[0].role")));
        let (s, p, _) = err_param(chat(r#"{"messages": "hi"}"#).unwrap_err());
        assert_eq!((s, p.as_deref()), (400, Some("messages")));
        let (s, p, _) = err_param(
            chat(r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}"#)
                .unwrap_err(),
        );
        assert_eq!((s, p.as_deref()), (400, Some("max_tokens")));
        for bad in [
            "",
            "{",
            "{\"messages\": [}",
            "[1, 2]",
            "null",
            "{\"messages\": []} trailing",
            "\u{0}",
        ] {
            let e = chat(bad).unwrap_err();
            assert_eq!(e.status().as_u16(), 400, "{bad:?}: {e}");
        }
        // A missing required field.
        let (s, _, m) = err_param(chat(r#"{"model": "m"}"#).unwrap_err());
        assert_eq!(s, 400);
        assert!(m.contains("messages"), "{m}");
    }

    #[test]
    fn out_of_range_and_unsupported_values_are_400() {
        let cases = [
            (r#""n": 2"#, "n"),
            (r#""temperature": 2.5"#, "temperature"),
            (r#""temperature": -0.1"#, "temperature"),
            (r#""top_p": 0"#, "top_p"),
            (r#""top_p": 1.01"#, "top_p"),
            (r#""presence_penalty": 3"#, "presence_penalty"),
            (r#""frequency_penalty": -2.5"#, "frequency_penalty"),
            (r#""min_p": 1.5"#, "min_p"),
            (r#""top_k": -2"#, "top_k"),
            (r#""repetition_penalty": 0"#, "repetition_penalty"),
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_completion_tokens": 0"#, "max_completion_tokens"),
            (r#""stop": ["a", ""]"#, "stop"),
            (r#""stop": 5"#, "stop"),
            (
                r#""stream_options": {"include_usage": true}"#,
                "stream_options",
            ),
            (r#""tool_choice": "required""#, "tool_choice"),
            (
                r#""tool_choice": {"type": "function", "function": {"name": "f"}}"#,
                "tool_choice",
            ),
            (r#""tool_choice": 3"#, "tool_choice"),
            (r#""tools": [{"type": "retrieval"}]"#, "tools[0].type"),
            (
                r#""tools": [{"type": "function", "function": {"name": ""}}]"#,
                "tools[0].function.name",
            ),
            (r#""logprobs": true"#, "logprobs"),
            (
                r#""response_format": {"type": "json_object"}"#,
                "response_format",
            ),
            (r#""seed": 1.5"#, "seed"),
            (r#""seed": 18446744073709551616"#, "seed"),
        ];
        for (field, param) in cases {
            let body = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {field}}}"#);
            let (s, p, m) = err_param(chat(&body).unwrap_err());
            assert_eq!((s, p.as_deref()), (400, Some(param)), "{field}: {m}");
        }
        let many: Vec<String> = (0..=MAX_STOP_STRINGS)
            .map(|i| format!("\"s{i}\""))
            .collect();
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "x"}}], "stop": [{}]}}"#,
            many.join(",")
        );
        assert_eq!(
            err_param(chat(&body).unwrap_err()).1.as_deref(),
            Some("stop")
        );
        let bad_messages = [
            (r#"[]"#, "messages"),
            (r#"[{"role": "robot", "content": "x"}]"#, "messages[0].role"),
            (r#"[{"role": "user"}]"#, "messages[0].content"),
            (
                r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]"#,
                "messages[0].content[0].type",
            ),
        ];
        for (messages, param) in bad_messages {
            let body = format!(r#"{{"messages": {messages}}}"#);
            let (s, p, m) = err_param(chat(&body).unwrap_err());
            assert_eq!((s, p.as_deref()), (400, Some(param)), "{messages}: {m}");
        }
    }

    #[test]
    fn tool_choice_none_offers_no_tools_and_nulls_mean_unset() {
        let job = chat(
            r#"{"messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
                "temperature": null, "stop": null, "n": null, "seed": 18446744073709551615}"#,
        )
        .unwrap();
        assert!(job.tools.is_none());
        assert_eq!(job.params.temperature, None);
        assert_eq!(job.params.seed, Some(u64::MAX));
        assert!(job.params.stop.is_empty());
        assert!(!job.delivery.stream);
    }

    #[test]
    fn completion_prompts_and_unsupported_fields() {
        let parse = |b: &str| parse_body::<CompletionRequest>(b.as_bytes())?.validate();
        let (p, _, _) = parse(r#"{"prompt": "hi"}"#).unwrap();
        assert_eq!(p, PromptInput::Text("hi".into()));
        let (p, _, _) = parse(r#"{"prompt": ["hi"]}"#).unwrap();
        assert_eq!(p, PromptInput::Text("hi".into()));
        let (p, _, _) = parse(r#"{"prompt": [1, 2, 3]}"#).unwrap();
        assert_eq!(p, PromptInput::Ids(vec![1, 2, 3]));
        let (p, _, _) = parse(r#"{"prompt": [[4]]}"#).unwrap();
        assert_eq!(p, PromptInput::Ids(vec![4]));
        for (body, param) in [
            (r#"{"prompt": ["a", "b"]}"#, "prompt"),
            (r#"{"prompt": [[1], [2]]}"#, "prompt"),
            (r#"{"prompt": [-1]}"#, "prompt"),
            (r#"{"prompt": 5}"#, "prompt"),
            (r#"{"prompt": "a", "echo": true}"#, "echo"),
            (r#"{"prompt": "a", "logprobs": 2}"#, "logprobs"),
            (r#"{"prompt": "a", "suffix": "z"}"#, "suffix"),
            (r#"{"prompt": "a", "best_of": 3}"#, "best_of"),
            (r#"{"prompt": "a", "n": 4}"#, "n"),
        ] {
            let (s, p, m) = err_param(parse(body).unwrap_err());
            assert_eq!((s, p.as_deref()), (400, Some(param)), "{body}: {m}");
        }
    }

    #[test]
    fn the_context_check_counts_what_the_engine_writes() {
        // 6 prompt + 4 new - 1 = 9 positions: fits in 9, not in 8.
        assert_eq!(fit_to_context(6, Some(4), 9, "prompt").unwrap(), 4);
        let e = fit_to_context(6, Some(4), 8, "prompt").unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        // No max_tokens: all the room left.
        assert_eq!(fit_to_context(6, None, 8, "prompt").unwrap(), 3);
        assert!(fit_to_context(9, None, 8, "messages").is_err());
        assert!(fit_to_context(0, None, 8, "prompt").is_err());
        assert!(fit_to_context(1, Some(usize::MAX), 8, "prompt").is_err());
    }

    fn model_info(sampling: SamplingDefaults) -> crate::ModelInfo {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/qwen-tokenizer");
        crate::ModelInfo {
            name: "q".into(),
            tokenizer: qmk_model::tokenizer::Tokenizer::from_dir(&dir).unwrap(),
            template: None,
            stop_ids: vec![7, 8],
            vocab_size: 151_936,
            sampling,
            speculation: qmk_engine::SpeculativeOptions::default(),
        }
    }

    #[test]
    fn options_take_the_request_values_then_the_model_defaults() {
        // Qwen2.5 instruct's generation_config.json values.
        let qwen = SamplingDefaults {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            repetition_penalty: 1.05,
            ..SamplingDefaults::GREEDY
        };
        let m = model_info(qwen);
        let p = GenParams {
            temperature: Some(0.5),
            top_p: Some(0.5),
            min_p: Some(0.1),
            presence_penalty: Some(0.25),
            frequency_penalty: Some(-0.5),
            seed: Some(9),
            stop: vec!["END".into()],
            ..GenParams::default()
        };
        let (o, stops) = generate_options(&p, 12, &m).unwrap();
        assert_eq!(o.max_new_tokens, 12);
        let s = o.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.min_p, s.seed),
            (0.5, 0.5, 0.1, 9)
        );
        assert_eq!((s.presence_penalty, s.frequency_penalty), (0.25, -0.5));
        // Unset: the model's.
        assert_eq!((s.top_k, s.repetition_penalty), (20, 1.05));
        assert_eq!(stops.stops(), ["END"]);
        assert_eq!(o.stop_ids, [7, 8]);
        assert!(!o.ignore_eos);
        // Nothing given: the model's sampling, a drawn seed; temperature 0
        // is plain greedy (none of the model's penalties).
        let (a, _) = generate_options(&GenParams::default(), 3, &m).unwrap();
        let (b, _) = generate_options(&GenParams::default(), 3, &m).unwrap();
        assert_eq!(a.sampling.temperature, 0.7);
        assert_ne!(a.sampling.seed, b.sampling.seed, "a fresh seed per request");
        let greedy = GenParams {
            temperature: Some(0.0),
            ..GenParams::default()
        };
        let (g, _) = generate_options(&greedy, 3, &m).unwrap();
        assert!(g.sampling.is_greedy());
        assert_eq!(g.sampling.repetition_penalty, 1.0);
    }

    #[test]
    fn options_the_engine_refuses_name_the_parameter() {
        let m = model_info(SamplingDefaults::GREEDY);
        let too_many = GenParams {
            stop: (0..17).map(|i| format!("s{i}")).collect(),
            ..GenParams::default()
        };
        let e = generate_options(&too_many, 3, &m).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(e.to_string().contains("stop"), "{e}");
        let long = GenParams {
            stop: vec!["x".repeat(300)],
            ..GenParams::default()
        };
        let e = generate_options(&long, 3, &m).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
    }

    #[test]
    fn model_names_must_match_when_given() {
        assert!(check_model(None, "q").is_ok());
        assert!(check_model(Some("q"), "q").is_ok());
        assert_eq!(
            check_model(Some("gpt-4o"), "q")
                .unwrap_err()
                .status()
                .as_u16(),
            404
        );
    }
}
