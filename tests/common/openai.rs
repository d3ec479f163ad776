//! A loopback fake of an OpenAI-compatible chat-completions server that
//! speaks the real streaming wire format (server-sent events, `data: {...}`
//! chunks with `choices[0].delta.content`, `data: [DONE]`), and misbehaves
//! on request: status codes, an error object mid-stream, a dropped stream.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// What the fake does with one request.
#[derive(Debug, Clone)]
pub enum Script {
    /// Stream these pieces, then finish normally.
    Stream(Vec<String>),
    /// Answer with this status (and Retry-After seconds when given).
    Status(u16, Option<&'static str>),
    /// Stream these pieces, then an error object inside the stream.
    StreamThenError(Vec<String>),
    /// Stream these pieces, then drop the connection without finishing.
    StreamThenDrop(Vec<String>),
}

#[derive(Default)]
struct FakeState {
    script: VecDeque<Script>,
    requests: Vec<(HeaderMap, Value)>,
}

#[derive(Clone)]
pub struct FakeOpenAi {
    pub addr: SocketAddr,
    state: Arc<Mutex<FakeState>>,
}

impl FakeOpenAi {
    pub async fn start() -> FakeOpenAi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(FakeState::default()));
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(complete))
            .with_state(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeOpenAi { addr, state }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The next requests get these answers, in order; after them, every
    /// request is answered `fake: <last user message>`.
    pub fn script(&self, steps: Vec<Script>) {
        self.state.lock().unwrap().script.extend(steps);
    }

    pub fn requests(&self) -> Vec<(HeaderMap, Value)> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn chunk(content: &str) -> String {
    let event = json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]
    });
    format!("data: {event}\n\n")
}

fn finish() -> String {
    let event = json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    });
    format!("data: {event}\n\ndata: [DONE]\n\n")
}

fn sse(parts: Vec<Result<String, std::io::Error>>) -> Response {
    let stream = futures::stream::iter(parts.into_iter().map(|p| p.map(Bytes::from)));
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, w) in text.split(' ').enumerate() {
        out.push(if i == 0 {
            w.to_owned()
        } else {
            format!(" {w}")
        });
    }
    out
}

async fn complete(
    State(state): State<Arc<Mutex<FakeState>>>,
    headers: HeaderMap,
    body: axum::Json<Value>,
) -> Response {
    let body = body.0;
    let last_user = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned();
    let step = {
        let mut s = state.lock().unwrap();
        s.requests.push((headers, body.clone()));
        s.script.pop_front()
    };
    let step = step.unwrap_or_else(|| Script::Stream(words(&format!("fake: {last_user}"))));
    match step {
        Script::Stream(pieces) => {
            let mut parts: Vec<Result<String, std::io::Error>> =
                pieces.iter().map(|p| Ok(chunk(p))).collect();
            parts.push(Ok(finish()));
            sse(parts)
        }
        Script::Status(code, retry_after) => {
            let mut response = (
                StatusCode::from_u16(code).unwrap(),
                axum::Json(
                    json!({"error": {"message": format!("fake says {code}"), "type": "fake"}}),
                ),
            )
                .into_response();
            if let Some(after) = retry_after {
                response
                    .headers_mut()
                    .insert("retry-after", after.parse().unwrap());
            }
            response
        }
        Script::StreamThenError(pieces) => {
            let mut parts: Vec<Result<String, std::io::Error>> =
                pieces.iter().map(|p| Ok(chunk(p))).collect();
            parts.push(Ok(format!("data: {}\n\n", json!({"error": {"message": "the model crashed mid-stream", "type": "server_error"}}))));
            sse(parts)
        }
        Script::StreamThenDrop(pieces) => {
            let mut parts: Vec<Result<String, std::io::Error>> =
                pieces.iter().map(|p| Ok(chunk(p))).collect();
            parts.push(Err(std::io::Error::other("connection dropped")));
            sse(parts)
        }
    }
}
