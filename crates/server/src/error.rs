//! The server's one error type: every failure a client can see, with its
//! HTTP status and OpenAI's error shape, plus the server's own start-up
//! failures.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// A boxed error from the code that opens the engine.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong, as a client or the operator sees it.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The request is malformed or asks for something unsupported (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, in words.
        message: String,
        /// The request field at fault (`messages[1].content`), if one is.
        param: Option<String>,
        /// A machine-readable code (`context_length_exceeded`), if any.
        code: Option<&'static str>,
    },
    /// No bearer key, or the wrong one (401).
    #[error("Incorrect API key provided: send `Authorization: Bearer <key>` with the key the server was started with (--api-key)")]
    Unauthorized,
    /// The request names a model this server does not serve (404).
    #[error("The model `{requested}` does not exist or you do not have access to it (this server serves `{served}`).")]
    ModelNotFound {
        /// The name in the request.
        requested: String,
        /// The one model served.
        served: String,
    },
    /// No such endpoint (404).
    #[error("no endpoint {method} {path}")]
    NoRoute {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The endpoint exists but not for this method (405).
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The body is larger than the server accepts (413).
    #[error("the request body is larger than {limit} bytes")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request queue is full (429).
    #[error("the server is busy: {waiting} requests are already waiting; retry later")]
    QueueFull {
        /// The queue's capacity (`--max-queue`).
        waiting: usize,
    },
    /// The engine failed for good, or has stopped (503).
    #[error("the engine is unavailable: {0}")]
    Unavailable(String),
    /// A failure inside the server that is no fault of the request (500).
    #[error("internal error: {0}")]
    Internal(String),
    /// The engine could not be opened.
    #[error("cannot start the engine: {0}")]
    Startup(#[source] BoxError),
    /// The listening socket could not be opened.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Running the HTTP server failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

impl ServerError {
    /// A 400 naming the field at fault.
    pub fn invalid(message: impl Into<String>, param: impl Into<String>) -> Self {
        ServerError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ServerError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ServerError::Unauthorized => StatusCode::UNAUTHORIZED,
            ServerError::ModelNotFound { .. } | ServerError::NoRoute { .. } => {
                StatusCode::NOT_FOUND
            }
            ServerError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ServerError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ServerError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ServerError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ServerError::Internal(_)
            | ServerError::Startup(_)
            | ServerError::Bind { .. }
            | ServerError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` field for this error (OpenAI's own API answers 401
    /// and 404 with `invalid_request_error` too).
    fn kind(&self) -> &'static str {
        match self.status().as_u16() {
            429 => "rate_limit_error",
            503 => "service_unavailable",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's `code` field for this error.
    fn code(&self) -> Option<&'static str> {
        match self {
            ServerError::InvalidRequest { code, .. } => *code,
            ServerError::Unauthorized => Some("invalid_api_key"),
            ServerError::ModelNotFound { .. } => Some("model_not_found"),
            ServerError::PayloadTooLarge { .. } => Some("request_too_large"),
            ServerError::QueueFull { .. } => Some("queue_full"),
            _ => None,
        }
    }

    /// The body OpenAI's API sends with an error:
    /// `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            ServerError::InvalidRequest { param, .. } => param.clone(),
            _ => None,
        };
        serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": param,
                "code": self.code(),
            }
        })
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        (self.status(), Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_openai_shape_and_status() {
        let e = ServerError::invalid("temperature must be in [0, 2]", "temperature");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "temperature");
        assert!(b["error"]["code"].is_null());
        assert_eq!(b["error"]["message"], "temperature must be in [0, 2]");

        let e = ServerError::ModelNotFound {
            requested: "gpt-4".into(),
            served: "qwen".into(),
        };
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(e.body()["error"]["code"], "model_not_found");
        assert_eq!(ServerError::Unauthorized.status().as_u16(), 401);
        assert_eq!(
            ServerError::Unauthorized.body()["error"]["code"],
            "invalid_api_key"
        );
        assert_eq!(ServerError::QueueFull { waiting: 3 }.status().as_u16(), 429);
        assert_eq!(
            ServerError::PayloadTooLarge { limit: 9 }.status().as_u16(),
            413
        );
        assert_eq!(ServerError::Unavailable("x".into()).status().as_u16(), 503);
        for e in [
            ServerError::Unauthorized,
            ServerError::Internal("boom".into()),
        ] {
            let b = e.body();
            let obj = b["error"].as_object().unwrap();
            let mut keys: Vec<_> = obj.keys().cloned().collect();
            keys.sort();
            assert_eq!(keys, ["code", "message", "param", "type"]);
        }
    }
}
