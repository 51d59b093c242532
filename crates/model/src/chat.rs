//! Chat template: the Jinja template shipped with a checkpoint, rendered with
//! minijinja the way transformers' `apply_chat_template` renders it.
//!
//! What transformers does, and so what this does:
//! 1. The template comes from `chat_template.jinja` if that file exists, else
//!    `chat_template.json` (`{"chat_template": ...}`), else the
//!    `chat_template` field of `tokenizer_config.json`, which is a string or a
//!    list of `{name, template}` (the one named `default` is used).
//! 2. Jinja runs with `trim_blocks` and `lstrip_blocks` on, the loop-controls
//!    extension, and no trailing-newline keeping.
//! 3. The context holds `messages`, `tools` (none), `add_generation_prompt`,
//!    and the special tokens of `tokenizer_config.json` (`bos_token`,
//!    `eos_token`, ...) as strings.
//! 4. Templates may call `raise_exception(msg)`, `strftime_now(fmt)`, Python
//!    string/dict/list methods (`.strip()`, `.items()`, ...), and `tojson`,
//!    which follows Python's `json.dumps` (`", "` and `": "` separators, no
//!    HTML escaping, non-ASCII kept), not minijinja's built-in.
//!
//! The rendered text is then tokenized *without* adding special tokens.
//!
//! Templates come from the internet, so rendering is bounded (a limit hit is
//! [`ModelError::TemplateLimit`]):
//! 5. at most [`RENDER_FUEL`] minijinja instructions (a `for` over 10^9
//!    items, nested loops);
//! 6. at most [`RECURSION_LIMIT`] nested macro calls / includes;
//! 7. at most [`MAX_RENDER_BYTES`] of output;
//! 8. no single filter or method call allocates without bound: `indent` and
//!    `tojson(indent=...)` widths at most [`MAX_INDENT`]; sequence filters
//!    (`list`, `map`, `join`, `sort`, `tojson`, ...) given at most
//!    [`MAX_FILTER_ITEMS`] items (`['x'] * 10**12` is lazy until then);
//!    `slice` / `batch` counts at most that; `format` widths at most
//!    [`MAX_FORMAT_WIDTH`]; `replace` results at most [`MAX_RENDER_BYTES`].
//!    minijinja itself refuses a `string * n` longer than 10^8 bytes and a
//!    `range` of more than 10^5 items;
//!    `{{ value }}` writes a value only if it holds at most
//!    [`MAX_FILTER_ITEMS`] items, nested ones included;
//! 9. a panic inside the template engine becomes an error;
//! 10. the operators that build values (`~`, string `+` and `* n`, a
//!     materialised sequence `+`) allocate at most
//!     [`OPERATOR_BUDGET_BYTES`] in all during one render, and a sequence
//!     built by `*` or `+` claims at most [`MAX_SEQUENCE_ITEMS`] items
//!     (`{% set ns.s = ns.s ~ ns.s %}` in a loop, `['x'] * 10**12`): hooks
//!     added by the vendored, patched minijinja (vendor/README.md).
//!
//! Still unbounded: memory kept by values that filters build (each is
//! capped as above, but a loop can keep many of them in a list), and the
//! time of `in` / `==` / comparisons walking up to [`MAX_SEQUENCE_ITEMS`]
//! items in one instruction. See docs/hardening.md.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or whatever the template knows).
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl Message {
    /// A turn of any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
    /// A system turn.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A user turn.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An assistant turn.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled chat template plus the special-token strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template text, as found.
    source: String,
    /// Where it came from, for error messages.
    origin: String,
    /// `bos_token`, `eos_token`, ... from `tokenizer_config.json`.
    special_tokens: BTreeMap<String, String>,
    /// Instructions one render may execute ([`RENDER_FUEL`]).
    fuel: u64,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

/// minijinja instructions one render may execute. Qwen2.5's template spends
/// about a hundred per message, so this covers conversations far longer
/// than any context (the tests render 20,001 messages), and stops a runaway
/// loop within about half a second of CPU.
pub const RENDER_FUEL: u64 = 10_000_000;
/// Deepest nesting of macro calls (and other recursion) in a render.
pub const RECURSION_LIMIT: usize = 100;
/// Largest rendered prompt, in bytes (a 128k-token prompt is under 1 MB).
pub const MAX_RENDER_BYTES: usize = 64 << 20;
/// Largest indent width `indent` and `tojson` accept.
pub const MAX_INDENT: usize = 256;
/// Most items a filter may be given (a `[x] * 10**12` sequence costs nothing
/// until a filter materialises it), and the largest `slice` / `batch` count.
pub const MAX_FILTER_ITEMS: usize = 1_000_000;
/// Largest width or precision in a `format` string (`'%099999999999d'`
/// would allocate 100 GB in one instruction).
pub const MAX_FORMAT_WIDTH: usize = 4096;
/// Bytes the value-building operators (`~`, string `+`, `* n`, sequence
/// concatenation) may allocate in all during one render: four times the
/// output cap, so any template that could produce an acceptable prompt fits.
pub const OPERATOR_BUDGET_BYTES: usize = 4 * MAX_RENDER_BYTES;
/// Most items a sequence built by `*` or `+` may claim (patched minijinja).
pub const MAX_SEQUENCE_ITEMS: usize = minijinja::value::MAX_SEQUENCE_ITEMS;

/// Sets this thread's operator budget for one render and restores the
/// previous one on drop (also when the render panics: the guard lives
/// outside the panic catch).
struct OperatorBudget(Option<usize>);

impl OperatorBudget {
    fn set(bytes: usize) -> Self {
        OperatorBudget(minijinja::value::set_operator_budget(Some(bytes)))
    }
}

impl Drop for OperatorBudget {
    fn drop(&mut self) {
        minijinja::value::set_operator_budget(self.0);
    }
}

impl ChatTemplate {
    /// Finds the template in a model directory (see the module docs for the
    /// order) and reads the special tokens from `tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = if config_path.exists() {
            let text = read(&config_path)?;
            Some(
                serde_json::from_str(&text)
                    .map_err(|e| template_err(&config_path, format!("invalid JSON: {e}")))?,
            )
        } else {
            None
        };

        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        let (source, origin) = if jinja_path.exists() {
            (read(&jinja_path)?, jinja_path)
        } else if json_path.exists() {
            let v: serde_json::Value = serde_json::from_str(&read(&json_path)?)
                .map_err(|e| template_err(&json_path, format!("invalid JSON: {e}")))?;
            let t = v
                .get("chat_template")
                .ok_or_else(|| template_err(&json_path, "no `chat_template` field".to_string()))?;
            (pick_template(t, &json_path)?, json_path)
        } else {
            let t = config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
                .ok_or_else(|| {
                    template_err(
                        dir,
                        "no chat template: none of chat_template.jinja, chat_template.json, \
                         or a `chat_template` field in tokenizer_config.json"
                            .to_string(),
                    )
                })?;
            (pick_template(t, &config_path)?, config_path)
        };

        let special_tokens = config.as_ref().map(special_tokens).unwrap_or_default();
        Self::new(source, origin.display().to_string(), special_tokens)
    }

    /// Compiles a template given as text; `origin` names it in errors.
    pub fn new(
        source: impl Into<String>,
        origin: impl Into<String>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ModelError> {
        let source = source.into();
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(|state, value, method, args| {
            if method == "format" || method == "replace" || method == "join" {
                check_call(method, Some(value).into_iter().chain(args))?;
            }
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("indent", indent);
        guard_builtin_filters(&mut env);
        // `{{ value }}` writes every item of a (lazy, maybe 10^12-item)
        // sequence, ignoring the output cap's error: check its size first.
        env.set_formatter(|out, state, value| {
            check_items("output", value, &mut { MAX_FILTER_ITEMS })?;
            minijinja::escape_formatter(out, state, value)
        });
        env.set_fuel(Some(RENDER_FUEL));
        env.set_recursion_limit(RECURSION_LIMIT);
        catch_engine_panic(&origin, "does not compile", || {
            env.add_template_owned(TEMPLATE_NAME, source.clone())
                .map_err(|e| ModelError::ChatTemplate {
                    origin: origin.clone(),
                    message: format!("does not compile: {}", jinja_line(&e)),
                })
        })?;
        Ok(Self {
            env,
            source,
            origin,
            special_tokens,
            fuel: RENDER_FUEL,
        })
    }

    /// Sets the instruction budget of each render (default [`RENDER_FUEL`]);
    /// the fuzz target uses a small one so that runaway templates end fast
    /// under sanitizers.
    #[doc(hidden)]
    pub fn with_fuel(mut self, fuel: u64) -> Self {
        self.env.set_fuel(Some(fuel));
        self.fuel = fuel;
        self
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends with
    /// the assistant header so the model's reply comes next.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_with(messages, None::<&()>, add_generation_prompt)
    }

    /// Like `render`, for any serializable message list (tool calls and other
    /// extra fields) and an optional tool list.
    pub fn render_with<M: Serialize + ?Sized, T: Serialize + ?Sized>(
        &self,
        messages: &M,
        tools: Option<&T>,
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let mut ctx: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| self.err(e))?;
        // minijinja can panic on hostile input (overflowing length
        // arithmetic of a repeated sequence, or of the source excerpt in an
        // error's debug info, with overflow checks on): an error too. The
        // error is formatted inside the catch for that reason.
        let _budget = OperatorBudget::set(OPERATOR_BUDGET_BYTES);
        catch_engine_panic(&self.origin, "render failed", || {
            let mut out = CappedWriter::default();
            match tmpl.render_captured_to(Value::from(ctx), &mut out) {
                Ok(_) => String::from_utf8(out.buf).map_err(|e| ModelError::ChatTemplate {
                    origin: self.origin.clone(),
                    message: format!("rendered text is not UTF-8: {e}"),
                }),
                Err(_) if out.full => Err(self.limit("rendered bytes", MAX_RENDER_BYTES as u64)),
                Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                    Err(self.limit("instructions executed", self.fuel))
                }
                Err(e)
                    if e.kind() == ErrorKind::InvalidOperation
                        && e.detail() == Some("recursion limit exceeded") =>
                {
                    Err(self.limit("recursion depth", RECURSION_LIMIT as u64))
                }
                // The patched operators' two limits (vendor/README.md).
                Err(e)
                    if e.kind() == ErrorKind::InvalidOperation
                        && e.detail().is_some_and(|d| d.contains("memory budget")) =>
                {
                    Err(self.limit("operator bytes", OPERATOR_BUDGET_BYTES as u64))
                }
                Err(e)
                    if e.kind() == ErrorKind::InvalidOperation
                        && e.detail().is_some_and(|d| {
                            d.contains("items") && d.contains("would have more than")
                        }) =>
                {
                    Err(self.limit("sequence items", MAX_SEQUENCE_ITEMS as u64))
                }
                Err(e) => Err(self.err(e)),
            }
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Special-token strings offered to the template (`eos_token`, ...).
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    fn limit(&self, what: &'static str, limit: u64) -> ModelError {
        ModelError::TemplateLimit {
            origin: self.origin.clone(),
            what,
            limit,
        }
    }

    fn err(&self, e: JinjaError) -> ModelError {
        ModelError::ChatTemplate {
            origin: self.origin.clone(),
            message: format!("render failed: {}", jinja_line(&e)),
        }
    }

    /// Where the template came from (a file, or the name given to
    /// [`ChatTemplate::new`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

/// A template engine error as one line: `kind at line N: detail`, then its
/// causes. minijinja's own display names the template by its internal name
/// (`in chat:3`) and, in the alternate form, adds a source excerpt over
/// several lines; the line here is the template's own (the file's, for a
/// `.jinja` file). Line breaks inside a detail (a `raise_exception` message)
/// become spaces.
fn jinja_line(e: &JinjaError) -> String {
    let mut line = e.kind().to_string();
    if let Some(n) = e.line().filter(|&n| n > 0) {
        line.push_str(&format!(" at line {n}"));
    }
    if let Some(d) = e.detail() {
        line.push_str(": ");
        line.push_str(d);
    }
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = match c.downcast_ref::<JinjaError>() {
            Some(j) => jinja_line(j),
            None => c.to_string(),
        };
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
        if c.is::<JinjaError>() {
            // jinja_line of a nested engine error already walked its causes.
            break;
        }
    }
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Runs `f`, turning a panic inside it (minijinja's, on hostile input) into
/// a [`ModelError::ChatTemplate`] that says `what` failed.
fn catch_engine_panic<T>(
    origin: &str,
    what: &str,
    f: impl FnOnce() -> Result<T, ModelError>,
) -> Result<T, ModelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(ModelError::ChatTemplate {
            origin: origin.to_string(),
            message: format!("{what}: the template engine panicked: {message}"),
        })
    })
}

/// Collects rendered output, refusing to grow past [`MAX_RENDER_BYTES`].
#[derive(Default)]
struct CappedWriter {
    buf: Vec<u8>,
    /// Set when a write was refused; the render then fails.
    full: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(bytes.len()) > MAX_RENDER_BYTES {
            self.full = true;
            return Err(std::io::Error::other("rendered output too large"));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// minijinja's built-in filters that materialise or walk a whole sequence
/// (or allocate a caller-given count, or format), each wrapped to check its
/// arguments with [`check_call`] first.
fn guard_builtin_filters(env: &mut Environment<'static>) {
    use minijinja::filters as f;
    let builtins: [(&'static str, Value); 24] = [
        ("dictsort", Value::from_function(f::dictsort)),
        ("items", Value::from_function(f::items)),
        ("reverse", Value::from_function(f::reverse)),
        ("join", Value::from_function(f::join)),
        ("replace", Value::from_function(f::replace)),
        ("sum", Value::from_function(f::sum)),
        ("last", Value::from_function(f::last)),
        ("min", Value::from_function(f::min)),
        ("max", Value::from_function(f::max)),
        ("sort", Value::from_function(f::sort)),
        ("list", Value::from_function(f::list)),
        ("string", Value::from_function(f::string)),
        ("slice", Value::from_function(f::slice)),
        ("batch", Value::from_function(f::batch)),
        ("select", Value::from_function(f::select)),
        ("selectattr", Value::from_function(f::selectattr)),
        ("reject", Value::from_function(f::reject)),
        ("rejectattr", Value::from_function(f::rejectattr)),
        ("map", Value::from_function(f::map)),
        ("groupby", Value::from_function(f::groupby)),
        ("unique", Value::from_function(f::unique)),
        ("pprint", Value::from_function(f::pprint)),
        ("format", Value::from_function(f::format)),
        ("lines", Value::from_function(f::lines)),
    ];
    for (name, builtin) in builtins {
        env.add_filter(
            name,
            move |state: &minijinja::State, args: minijinja::value::Rest<Value>| {
                check_call(name, args.iter())?;
                builtin.call(state, &args)
            },
        );
    }
}

/// Refuses a filter or method call whose arguments would make minijinja
/// allocate without bound in one instruction: more than
/// [`MAX_FILTER_ITEMS`] items, a `slice` / `batch` count past it, a
/// `format` width past [`MAX_FORMAT_WIDTH`], a `replace` whose result would
/// pass [`MAX_RENDER_BYTES`].
fn check_call<'a>(name: &str, args: impl Iterator<Item = &'a Value>) -> Result<(), JinjaError> {
    let refuse = |what: String| Err(JinjaError::new(ErrorKind::InvalidOperation, what));
    let args: Vec<&Value> = args.collect();
    for v in &args {
        if matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map
        ) {
            if let Some(n) = v.len().filter(|&n| n > MAX_FILTER_ITEMS) {
                return refuse(format!(
                    "`{name}` given {n} items (at most {MAX_FILTER_ITEMS})"
                ));
            }
        }
    }
    match name {
        "slice" | "batch" => {
            if let Some(n) = args.get(1).and_then(|v| v.as_usize()) {
                if n > MAX_FILTER_ITEMS {
                    return refuse(format!("`{name}` count {n} exceeds {MAX_FILTER_ITEMS}"));
                }
            }
        }
        "format" => {
            let fmt = args.first().and_then(|v| v.as_str()).unwrap_or("");
            // Any number in the format string bounds width and precision.
            for digits in fmt.split(|c: char| !c.is_ascii_digit()) {
                let too_wide = !digits.is_empty()
                    && (digits.len() > 9
                        || digits.parse::<usize>().unwrap_or(0) > MAX_FORMAT_WIDTH);
                if too_wide {
                    return refuse(format!("format width {digits} exceeds {MAX_FORMAT_WIDTH}"));
                }
            }
        }
        "replace" => {
            let len = |i: usize| args.get(i).and_then(|v| v.as_str()).map_or(0, str::len);
            let (text, from, to) = (len(0), len(1), len(2));
            // At most text/from matches (text + 1 insertions for an empty
            // pattern), each adding `to` bytes.
            let matches = text.checked_div(from).unwrap_or(text + 1);
            let worst = matches.saturating_mul(to).saturating_add(text);
            if worst > MAX_RENDER_BYTES {
                return refuse(format!(
                    "`replace` could produce {worst} bytes (at most {MAX_RENDER_BYTES})"
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Refuses `value` if it holds more than `budget` sequence / map items in
/// all, nested ones included; visits at most `budget` items.
fn check_items(what: &str, value: &Value, budget: &mut usize) -> Result<(), JinjaError> {
    if !matches!(
        value.kind(),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map
    ) {
        return Ok(());
    }
    let refuse = || {
        Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("`{what}` of more than {MAX_FILTER_ITEMS} items"),
        ))
    };
    if value.len().is_some_and(|n| n > *budget) {
        return refuse();
    }
    let Ok(items) = value.try_iter() else {
        return Ok(());
    };
    let is_map = value.kind() == ValueKind::Map;
    for item in items {
        if *budget == 0 {
            return refuse();
        }
        *budget -= 1;
        let item = if is_map {
            value.get_item(&item).unwrap_or_default()
        } else {
            item
        };
        check_items(what, &item, budget)?;
    }
    Ok(())
}

/// An indent width from a template, refused past [`MAX_INDENT`].
fn indent_width(n: usize) -> Result<usize, JinjaError> {
    if n > MAX_INDENT {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("indent width {n} exceeds {MAX_INDENT}"),
        ));
    }
    Ok(n)
}

/// minijinja's `indent(width=4, first=false, blank=false)`, with the width
/// bounded (minijinja's own allocates `width` spaces unchecked).
fn indent(
    value: String,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<String, JinjaError> {
    let width = match width {
        Some(w) => w,
        None => kwargs.get::<Option<usize>>("width")?.unwrap_or(4),
    };
    let first = match first {
        Some(f) => f,
        None => kwargs.get::<Option<bool>>("first")?.unwrap_or(false),
    };
    let blank = match blank {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("blank")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    // The rest is minijinja 2.24's `indent`, verbatim in effect.
    let strip = |s: &str| -> usize {
        let s = s.strip_suffix('\n').unwrap_or(s);
        s.strip_suffix('\r').unwrap_or(s).len()
    };
    let pad = " ".repeat(indent_width(width)?);
    let input = &value[..strip(&value)];
    let mut out = String::with_capacity(input.len());
    let mut lines = input.split('\n');
    if !first {
        out.push_str(lines.next().unwrap_or(""));
        out.push('\n');
    }
    for line in lines {
        if !line.is_empty() || blank {
            out.push_str(&pad);
        }
        out.push_str(line);
        out.push('\n');
    }
    out.truncate(strip(&out));
    Ok(out)
}

fn read(path: &Path) -> Result<String, ModelError> {
    let bytes = crate::small_file::read_small_bytes(path, crate::SMALL_FILE_CAP)
        .map_err(|e| template_err(path, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|_| template_err(path, "cannot read: not UTF-8 text".into()))
}

fn template_err(path: &Path, message: String) -> ModelError {
    ModelError::ChatTemplate {
        origin: path.display().to_string(),
        message,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which
/// transformers uses the one named `default`.
fn pick_template(v: &serde_json::Value, path: &Path) -> Result<String, ModelError> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                template_err(
                    path,
                    "`chat_template` list has no entry named `default`".to_string(),
                )
            }),
        _ => Err(template_err(
            path,
            "`chat_template` is neither a string nor a list of {name, template}".to_string(),
        )),
    }
}

/// `*_token` fields of tokenizer_config.json, each a string or an AddedToken
/// object `{"content": ...}`; null ones are left out (undefined in Jinja).
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(obj) = config.as_object() {
        for (k, v) in obj {
            if !k.ends_with("_token") {
                continue;
            }
            let s = match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string),
                _ => None,
            };
            if let Some(s) = s {
                out.insert(k.clone(), s);
            }
        }
    }
    out
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC time formatted with the common
/// strftime codes (templates use it for a "today is" line).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(secs, &format)
}

fn strftime_utc(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let rem = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &y.to_string(),
            Some('m') => out += &format!("{m:02}"),
            Some('d') => out += &format!("{d:02}"),
            Some('-') => match chars.next() {
                Some('d') => out += &d.to_string(),
                Some('m') => out += &m.to_string(),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o)
                }
                None => out.push_str("%-"),
            },
            Some('B') => out += MONTHS[(m - 1) as usize],
            Some('b') => out += &MONTHS[(m - 1) as usize][..3],
            Some('A') => out += DAYS[weekday],
            Some('a') => out += &DAYS[weekday][..3],
            Some('H') => out += &format!("{:02}", rem / 3600),
            Some('M') => out += &format!("{:02}", rem / 60 % 60),
            Some('S') => out += &format!("{:02}", rem % 60),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o)
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, JinjaError> {
    check_call("tojson", std::iter::once(value))?;
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(indent_width(n.max(0) as usize)?)),
            None => {
                let s = v.as_str().unwrap_or("");
                indent_width(s.len())?;
                Some(s.to_string())
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    // Python's defaults: (", ", ": ") compact, (",", ": ") when indenting.
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            (
                a.as_str().unwrap_or(",").to_string(),
                b.as_str().unwrap_or(":").to_string(),
            )
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let opts = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    let mut out = String::new();
    opts.write(value, 0, &mut out)?;
    Ok(out)
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), JinjaError> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    let f: f64 = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&py_float(f));
                }
            }
            ValueKind::String => self.write_str(v.as_str().unwrap_or(""), out),
            ValueKind::Map => {
                check_call("tojson", std::iter::once(v))?;
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let items = keys
                    .into_iter()
                    .map(|k| {
                        let val = v.get_item(&k)?;
                        Ok((k, val))
                    })
                    .collect::<Result<Vec<_>, JinjaError>>()?;
                self.write_container('{', '}', items.len(), depth, out, |i, d, out| {
                    let (k, val) = &items[i];
                    match k.as_str() {
                        Some(s) => self.write_str(s, out),
                        None => self.write_str(&k.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(val, d, out)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                check_call("tojson", std::iter::once(v))?;
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_container('[', ']', items.len(), depth, out, |i, d, out| {
                    self.write(&items[i], d, out)
                })?;
            }
            _ => self.write_str(&v.to_string(), out),
        }
        Ok(())
    }

    fn write_container(
        &self,
        open: char,
        close: char,
        n: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, usize, &mut String) -> Result<(), JinjaError>,
    ) -> Result<(), JinjaError> {
        out.push(open);
        if n == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(depth + 1));
            }
            item(i, depth + 1, out)?;
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
        out.push(close);
        Ok(())
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` for the common cases: always a decimal point or an
/// exponent, `NaN`/`Infinity` as `json.dumps` writes them.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Python: 1e+16, 1.5e-05.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_json(template: &str, ctx: serde_json::Value) -> String {
        let t = ChatTemplate::new(template, "test", BTreeMap::new()).unwrap();
        let tmpl = t.env.get_template(TEMPLATE_NAME).unwrap();
        tmpl.render(Value::from_serialize(&ctx)).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let ctx = serde_json::json!({"x": {"a": [1, 2.5, "é<>&'\"\n"], "b": null, "c": true}});
        assert_eq!(
            render_json("{{ x | tojson }}", ctx.clone()),
            r#"{"a": [1, 2.5, "é<>&'\"\n"], "b": null, "c": true}"#
        );
        assert_eq!(
            render_json("{{ x.a | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  \"é<>&'\\\"\\n\"\n]"
        );
        assert_eq!(
            render_json("{{ x.a | tojson(ensure_ascii=true) }}", ctx),
            r#"[1, 2.5, "\u00e9<>&'\"\n"]"#
        );
    }

    #[test]
    fn py_float_forms() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1.5e-5), "1.5e-05");
    }

    #[test]
    fn raise_exception_is_an_error_naming_the_message() {
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role') }}",
            "t",
            BTreeMap::new(),
        )
        .unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }

    #[test]
    fn template_errors_are_one_line_with_the_template_line() {
        // minijinja's alternate display spans several lines (a source
        // excerpt) and names the template by its internal name.
        let e = ChatTemplate::new(
            "a\nb\n{% if %}\nc",
            "/m/chat_template.jinja",
            BTreeMap::new(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "/m/chat_template.jinja: chat template: does not compile: syntax error at line 3: \
             unexpected end of block"
        );
        let t = ChatTemplate::new(
            "x\n{{ raise_exception('no\\n  system role') }}",
            "t",
            BTreeMap::new(),
        )
        .unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert_eq!(
            e,
            "t: chat template: render failed: invalid operation at line 2: no system role"
        );
        let e = t.render(&[], false).unwrap_err();
        assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e:?}");
        assert_eq!(t.origin(), "t");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, "t", BTreeMap::new()).unwrap();
        let out = t
            .render(&[Message::user(" a "), Message::assistant("b")], false)
            .unwrap();
        assert_eq!(out, "[a]\n");
    }

    #[test]
    fn strftime_basics() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc(t, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(
            strftime_utc(t, "%d %B %Y, %A"),
            "29 February 2024, Thursday"
        );
        assert_eq!(strftime_utc(t, "%-d %b"), "29 Feb");
    }

    #[test]
    fn template_list_picks_default() {
        let v = serde_json::json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(pick_template(&v, Path::new("x")).unwrap(), "D");
    }
}
