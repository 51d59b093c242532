//! Tool calls in Qwen2.5's output format: each call is a JSON object
//! `{"name": ..., "arguments": {...}}` between `<tool_call>` and
//! `</tool_call>` (the format the model's chat template teaches it). Text
//! before the first call is the message's content; an output whose calls do
//! not all parse is plain content, as vLLM's Hermes parser treats it.
//!
//! Small models often drop the tags and reply with the bare object (the
//! 0.5B test model does, `tests/data/tool_calls/real_05b.txt`): a whole
//! reply that is one such object naming an offered tool is a call too.

use serde_json::Value;

/// Opens a call.
pub const OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text (OpenAI's form).
    pub arguments: String,
}

/// A reply split into content and tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// Text before the first call, when it is not blank.
    pub content: Option<String>,
    /// The calls, in order (never empty).
    pub calls: Vec<ToolCall>,
}

/// The names of the offered tools (`tools[i].function.name`).
pub fn names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t.get("function")?.get("name")?.as_str())
        .map(String::from)
        .collect()
}

/// Parses `text` for tool calls; `None` when it holds none, or any of them
/// is not a JSON object with a string `name`. A last call cut off before
/// its closing tag still counts when its JSON is whole. Without tags, the
/// whole text counts as one call when it is such an object and names one of
/// `offered`.
pub fn parse(text: &str, offered: &[String]) -> Option<Parsed> {
    let Some(first) = text.find(OPEN) else {
        let c = call(text)?;
        return offered.contains(&c.name).then(|| Parsed {
            content: None,
            calls: vec![c],
        });
    };
    let content = Some(text[..first].trim())
        .filter(|c| !c.is_empty())
        .map(String::from);
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(OPEN) {
        let body = &rest[start + OPEN.len()..];
        let (json, next) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call(json)?);
        rest = next;
    }
    Some(Parsed { content, calls })
}

fn call(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Already JSON text (some fine-tunes write it so).
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Streams a reply's text while tools are offered: text passes through
/// until `<tool_call>` starts, after which everything is held for
/// [`ToolStream::finish`]. The end of the text that could still become the
/// tag is held back too, so a tag split across tokens never leaks out as
/// content; a reply that opens with `{` (a bare call, maybe) is held whole.
#[derive(Debug, Default)]
pub struct ToolStream {
    offered: Vec<String>,
    held: String,
    /// The reply's first non-blank character has been seen.
    started: bool,
    in_call: bool,
}

impl ToolStream {
    /// A stream for a reply that may call the `offered` tools.
    pub fn new(offered: Vec<String>) -> Self {
        ToolStream {
            offered,
            ..ToolStream::default()
        }
    }

    /// Takes newly decoded text; returns the part that is content for sure.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if !self.started {
            let t = self.held.trim_start();
            if t.is_empty() {
                return String::new();
            }
            self.started = true;
            if t.starts_with('{') {
                self.in_call = true;
                return String::new();
            }
        }
        if let Some(at) = self.held.find(OPEN) {
            self.in_call = true;
            let out = self.held[..at].to_string();
            self.held.drain(..at);
            return out;
        }
        let keep = partial_suffix(&self.held, OPEN);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The end of the reply: the calls, when the held text parses as calls,
    /// else the held text as content.
    pub fn finish(self) -> Result<Vec<ToolCall>, String> {
        if self.in_call {
            if let Some(p) = parse(&self.held, &self.offered) {
                return Ok(p.calls);
            }
        }
        Err(self.held)
    }
}

/// Length of the longest proper prefix of `tag` that `text` ends with.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.is_char_boundary(text.len().saturating_sub(n)) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies in the form Qwen2.5 instruct models write when offered a
    /// weather tool (tests/data/tool_calls; `real_05b.txt` is the 0.5B
    /// test model's own reply): `name.txt` is the decoded reply.
    fn recorded(name: &str) -> String {
        let path = format!(
            "{}/tests/data/tool_calls/{name}.txt",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn weather() -> Vec<String> {
        vec!["get_current_weather".to_string()]
    }

    #[test]
    fn recorded_replies_parse_into_calls() {
        let parse = |t: &str| parse(t, &weather());
        let p = parse(&recorded("single")).unwrap();
        assert_eq!(p.content, None);
        assert_eq!(
            p.calls,
            [ToolCall {
                name: "get_current_weather".into(),
                arguments: r#"{"location":"Paris, France","unit":"celsius"}"#.into()
            }]
        );
        let p = parse(&recorded("parallel")).unwrap();
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].name, "get_current_weather");
        assert!(p.calls[1].arguments.contains("Tokyo"));
        let p = parse(&recorded("with_preamble")).unwrap();
        assert_eq!(
            p.content.as_deref(),
            Some("Let me look up the weather in Berlin for you.")
        );
        assert_eq!(p.calls.len(), 1);
        let args: Value = serde_json::from_str(&p.calls[0].arguments).unwrap();
        assert_eq!(args["location"], "Berlin");
        // Cut off before the closing tag (the end-of-turn came first).
        let p = parse(&recorded("unterminated")).unwrap();
        assert_eq!(p.calls[0].name, "get_current_weather");
        // Plain answers and broken JSON are content.
        assert_eq!(parse(&recorded("plain")), None);
        assert_eq!(parse(&recorded("broken_json")), None);
        // The 0.5B test model's reply: the bare object, no tags.
        let p = parse(&recorded("real_05b")).unwrap();
        assert_eq!(p.content, None);
        assert_eq!(
            p.calls,
            [ToolCall {
                name: "get_current_weather".into(),
                arguments: r#"{"location":"Paris","unit":"celsius"}"#.into()
            }]
        );
        // A bare object naming a tool not offered is content.
        assert_eq!(super::parse(&recorded("real_05b"), &[]), None);
        assert_eq!(
            super::parse("{\"name\": \"other\", \"arguments\": {}}", &weather()),
            None
        );
    }

    #[test]
    fn odd_shapes() {
        let parse = |t: &str| parse(t, &weather());
        assert_eq!(parse("<tool_call>{\"arguments\": {}}</tool_call>"), None);
        assert_eq!(parse("<tool_call>[1]</tool_call>"), None);
        assert_eq!(parse("<tool_call></tool_call>"), None);
        let p = parse("<tool_call>{\"name\": \"f\"}</tool_call>").unwrap();
        assert_eq!(p.calls[0].arguments, "{}");
        let p = parse("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\":1}\"}</tool_call>")
            .unwrap();
        assert_eq!(p.calls[0].arguments, "{\"a\":1}");
        // One good call and one bad: all content.
        assert_eq!(
            parse("<tool_call>{\"name\": \"f\"}</tool_call><tool_call>oops</tool_call>"),
            None
        );
    }

    #[test]
    fn streaming_holds_back_a_split_tag_and_yields_the_calls() {
        let reply = recorded("with_preamble");
        // Feed it in 3-byte pieces (on char boundaries), as tokens would.
        let mut s = ToolStream::new(weather());
        let mut content = String::new();
        let mut rest = reply.as_str();
        while !rest.is_empty() {
            let mut n = 3.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            content.push_str(&s.push(&rest[..n]));
            assert!(!content.contains('<'), "{content:?}");
            rest = &rest[n..];
        }
        assert_eq!(
            content.trim(),
            "Let me look up the weather in Berlin for you."
        );
        let calls = s.finish().unwrap();
        assert_eq!(calls, parse(&reply, &weather()).unwrap().calls);

        // A bare call is held whole, then yields the call.
        let mut s = ToolStream::new(weather());
        let reply = recorded("real_05b");
        let (a, b) = reply.split_at(10);
        assert_eq!(s.push(" \n"), "");
        assert_eq!(s.push(a), "");
        assert_eq!(s.push(b), "");
        assert_eq!(s.finish().unwrap()[0].name, "get_current_weather");
        // A reply that opens with `{` but is no call comes out at the end.
        let mut s = ToolStream::new(weather());
        assert_eq!(s.push("{braces} are"), "");
        assert_eq!(s.push(" fun"), "");
        assert_eq!(s.finish(), Err("{braces} are fun".to_string()));

        // Text with a `<` that turns out not to be the tag comes through.
        let mut s = ToolStream::new(weather());
        let mut out = s.push("a <tool");
        assert_eq!(out, "a ");
        out.push_str(&s.push("box> b"));
        assert_eq!(out, "a <toolbox> b");
        assert_eq!(s.finish(), Err(String::new()));

        // A broken call comes back as content at the end.
        let mut s = ToolStream::new(weather());
        assert_eq!(s.push("x<tool_call>{oops"), "x");
        assert_eq!(s.finish(), Err("<tool_call>{oops".to_string()));
    }

    #[test]
    fn partial_suffix_respects_char_boundaries() {
        assert_eq!(partial_suffix("abc<tool_c", OPEN), 7);
        assert_eq!(partial_suffix("abc", OPEN), 0);
        assert_eq!(partial_suffix("é<", OPEN), 1);
        assert_eq!(partial_suffix("<tool_call", OPEN), 10);
    }
}
