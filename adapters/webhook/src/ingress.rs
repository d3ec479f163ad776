//! `POST /v1/channels/{account}/updates`: parse, authenticate, hand to the
//! core, and answer `202` only once the update is journaled.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq;
use switchboard_channel::{
    AcceptStatus, ChatKind, Content, Envelope, IngressError, IngressSink, InputPolicy, Sender,
};

/// The header that carries the account's shared secret, when one is set.
pub const SECRET_HEADER: &str = "x-switchboard-secret";

/// What the ingress side needs to know about one webhook channel account.
#[derive(Clone)]
pub struct IngressAccount {
    /// When set, requests must carry it in `X-Switchboard-Secret`.
    pub secret: Option<String>,
}

struct AppState {
    accounts: HashMap<String, IngressAccount>,
    sink: Arc<dyn IngressSink>,
}

/// The routes of the webhook channel, to be mounted on the daemon's public
/// listener. `body_limit` is in bytes (1 MiB by default in config).
pub fn router(
    accounts: HashMap<String, IngressAccount>,
    sink: Arc<dyn IngressSink>,
    body_limit: usize,
) -> Router {
    let state = Arc::new(AppState { accounts, sink });
    Router::new()
        .route("/v1/channels/{account}/updates", post(post_update))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// A string or a number on the wire; stored as a string. Platforms and
/// client libraries disagree on which one an id is, and both are fine.
#[derive(Deserialize)]
#[serde(untagged)]
enum Id {
    Str(String),
    Int(i64),
}

impl Id {
    fn into_string(self) -> String {
        match self {
            Id::Str(s) => s,
            Id::Int(i) => i.to_string(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireChat {
    id: Id,
    #[serde(default = "default_chat_kind")]
    kind: String,
}

fn default_chat_kind() -> String {
    "private".to_owned()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireSender {
    id: Id,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    is_bot: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireUpdate {
    update_id: Id,
    chat: WireChat,
    #[serde(default)]
    sender: Option<WireSender>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    thread_id: Option<Id>,
    #[serde(default)]
    message_id: Option<Id>,
    /// Overrides the surface's input policy for this input.
    #[serde(default)]
    input_policy: Option<InputPolicy>,
    /// In a group chat: whether the bot was addressed (mentioned, replied
    /// to). Defaults to true.
    #[serde(default = "default_true")]
    mentions_bot: bool,
}

fn default_true() -> bool {
    true
}

/// A refusal with a stable code and a sentence that names the problem and
/// the fix.
struct Problem {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Problem {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Problem {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "code": self.code, "message": self.message } });
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        response
    }
}

async fn post_update(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(&state, &account, &headers, body).await {
        Ok(response) => response,
        Err(problem) => {
            // Unavailability is not the client's fault and is logged by the
            // core; everything else is a refusal an operator should see.
            if problem.status != StatusCode::SERVICE_UNAVAILABLE
                && problem.status != StatusCode::INTERNAL_SERVER_ERROR
            {
                state
                    .sink
                    .record_rejection(&account, problem.code, &problem.message);
            }
            problem.into_response()
        }
    }
}

async fn handle(
    state: &AppState,
    account: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let Some(settings) = state.accounts.get(account) else {
        return Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown_account",
            format!(
                "no webhook channel account named {account:?} is configured; \
                 post to /v1/channels/NAME/updates with NAME from [channels.NAME]"
            ),
        ));
    };
    if let Some(secret) = &settings.secret {
        let given = headers
            .get(SECRET_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if !bool::from(given.ct_eq(secret.as_bytes())) {
            return Err(Problem::new(
                StatusCode::UNAUTHORIZED,
                "bad_secret",
                "missing or wrong X-Switchboard-Secret header; send the account's configured secret",
            ));
        }
    }
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "request body is larger than the limit ({rejection}); \
                     send less text or raise server.body_limit"
                ),
            )
        } else {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "unreadable_body",
                format!("could not read the request body: {rejection}"),
            )
        }
    })?;
    let envelope = parse_update(account, &body)?;
    match state.sink.accept(envelope).await {
        Ok(accepted) => {
            let status = match accepted.status {
                AcceptStatus::Accepted => "accepted",
                AcceptStatus::Duplicate => "duplicate",
            };
            let body = json!({
                "status": status,
                "inbound_id": accepted.inbound_id,
                "conversation_id": accepted.conversation_id,
            });
            Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
        }
        Err(IngressError::Unavailable(why)) => Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("{why}; retry after a few seconds"),
        )),
        Err(IngressError::UnknownAccount(name)) => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown_account",
            format!("no channel account named {name:?} is running"),
        )),
        Err(IngressError::Invalid(why)) => {
            Err(Problem::new(StatusCode::BAD_REQUEST, "invalid_update", why))
        }
        Err(IngressError::Store(why)) => Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_error",
            format!("the update was not stored ({why}); retrying is safe"),
        )),
    }
}

fn parse_update(account: &str, body: &[u8]) -> Result<Envelope, Problem> {
    let update: WireUpdate = serde_json::from_slice(body).map_err(|e| {
        let code = if e.is_data() {
            "invalid_update"
        } else {
            "malformed_json"
        };
        Problem::new(
            StatusCode::BAD_REQUEST,
            code,
            format!(
                "the body is not a valid update ({e}); expected JSON like \
                 {{\"update_id\": \"1\", \"chat\": {{\"id\": \"42\", \"kind\": \"private\"}}, \"text\": \"hi\"}}"
            ),
        )
    })?;
    let update_key = update.update_id.into_string();
    if update_key.is_empty() || update_key.len() > 256 {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_update",
            "update_id must be 1 to 256 characters long",
        ));
    }
    let chat_id = update.chat.id.into_string();
    if chat_id.is_empty() || chat_id.len() > 256 {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_update",
            "chat.id must be 1 to 256 characters long",
        ));
    }
    let chat_kind = ChatKind::parse(&update.chat.kind).ok_or_else(|| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_update",
            format!(
                "chat.kind {:?} is not known; use \"private\" or \"group\"",
                update.chat.kind
            ),
        )
    })?;
    let content = match update.text {
        Some(text) => Content::Message {
            text,
            attachments: Vec::new(),
        },
        // An update without text is still journaled so its sender can see
        // what happened to it; the core records it as ignored.
        None => Content::Unsupported {
            kind: "no_text".to_owned(),
            reason: "the update has no text field".to_owned(),
        },
    };
    Ok(Envelope {
        account: account.to_owned(),
        update_key,
        chat_id,
        chat_kind,
        thread_id: update
            .thread_id
            .map(Id::into_string)
            .filter(|t| !t.is_empty()),
        space: None,
        sender: update.sender.map(|s| Sender {
            id: s.id.into_string(),
            name: s.name,
            is_bot: s.is_bot,
        }),
        message_id: update.message_id.map(Id::into_string),
        content,
        input_policy: update.input_policy,
        addressed: chat_kind == ChatKind::Private || update.mentions_bot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_strings_are_both_ids() {
        let env = parse_update(
            "main",
            br#"{"update_id": 7, "chat": {"id": -100123, "kind": "group"}, "text": "hi", "thread_id": 5}"#,
        )
        .ok()
        .unwrap();
        assert_eq!(env.update_key, "7");
        assert_eq!(env.chat_id, "-100123");
        assert_eq!(env.chat_kind, ChatKind::Group);
        assert_eq!(env.thread_id.as_deref(), Some("5"));
    }

    #[test]
    fn missing_chat_names_the_field() {
        let problem = parse_update("main", br#"{"update_id": "1", "text": "hi"}"#)
            .err()
            .unwrap();
        assert_eq!(problem.code, "invalid_update");
        assert!(problem.message.contains("chat"), "{}", problem.message);
    }

    #[test]
    fn unknown_chat_kind_is_refused() {
        let problem = parse_update(
            "main",
            br#"{"update_id": "1", "chat": {"id": "1", "kind": "channel"}, "text": "hi"}"#,
        )
        .err()
        .unwrap();
        assert!(problem.message.contains("channel"), "{}", problem.message);
    }

    #[test]
    fn malformed_json_is_malformed() {
        let problem = parse_update("main", b"{not json").err().unwrap();
        assert_eq!(problem.code, "malformed_json");
    }
}
