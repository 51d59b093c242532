//! Server-sent events as OpenAI streams them: one `data: <json>` event per
//! chunk, each ended by a blank line, and `data: [DONE]` last.

use axum::body::Bytes;
use serde_json::Value;

/// One event carrying a JSON chunk. JSON text has no raw line breaks (they
/// are escaped inside strings), so one `data:` line holds it.
pub fn data(chunk: &Value) -> Bytes {
    Bytes::from(format!("data: {chunk}\n\n"))
}

/// The event that ends every stream.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// Splits a stream body into its events' `data` payloads, checking the
/// framing: every event is one `data: ` line followed by a blank line.
#[cfg(test)]
pub(crate) fn parse_events(body: &str) -> Result<Vec<String>, String> {
    let Some(body) = body.strip_suffix("\n\n") else {
        return Err("the stream does not end with a blank line".into());
    };
    body.split("\n\n")
        .map(|event| match event.strip_prefix("data: ") {
            Some(payload) if !payload.contains('\n') => Ok(payload.to_string()),
            _ => Err(format!("not a one-line data event: {event:?}")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_single_data_lines_ending_in_done() {
        let chunk = serde_json::json!({"delta": {"content": "two\nlines \"quoted\""}});
        let mut body = String::from_utf8(data(&chunk).to_vec()).unwrap();
        assert_eq!(body.matches('\n').count(), 2);
        body.push_str(std::str::from_utf8(&done()).unwrap());
        let events = parse_events(&body).unwrap();
        assert_eq!(events.len(), 2);
        let back: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(back, chunk);
        assert_eq!(events[1], "[DONE]");
        assert!(parse_events("data: x\n").is_err());
        assert!(parse_events("event: x\n\n").is_err());
    }
}
