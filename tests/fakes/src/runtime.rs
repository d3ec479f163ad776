//! A loopback fake of an agent runtime speaking docs/runtime-protocol.md,
//! with faults on demand: the event stream dropped mid-run, durable events
//! repeated, a `run.finished` that never appears on any stream (a durable
//! gap only a re-read finds), and restarts (every connection cut, requests
//! refused for a while, durable state kept).
//!
//! Runs answer `echo: <text>` after a configurable delay, one at a time per
//! conversation, in admission order (the `queue` policy; other policies are
//! tested against `switchboard runtime serve`). Event ids grow by 10, so
//! they are not contiguous.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

#[derive(Clone, Debug)]
struct Run {
    conversation: String,
    text: String,
    state: String,
    event_id: Option<i64>,
}

#[derive(Default)]
struct St {
    runs: Vec<Run>,
    keys: HashMap<String, usize>,
    /// Durable `run.finished` events: (event id, run index).
    events: Vec<(i64, usize)>,
    /// Event ids never streamed (the durable gap).
    hidden: Vec<i64>,
    next_event: i64,
    /// When each conversation's last run finishes (its successor waits).
    busy_until: HashMap<String, tokio::time::Instant>,
}

struct Shared {
    st: Mutex<St>,
    changed: Notify,
    delay: Mutex<Duration>,
    down: AtomicBool,
    /// Streams opened since start (for tests).
    streams: AtomicUsize,
    /// Requests to GET /v1/runs/{id}.
    reads: AtomicUsize,
    /// Faults.
    drop_after: Mutex<Option<usize>>,
    repeat: AtomicBool,
    hide_next: AtomicBool,
    /// Bumped by restart(): streams of an older generation end.
    generation: AtomicUsize,
}

/// The fake runtime.
#[derive(Clone)]
pub struct FakeRuntime {
    shared: Arc<Shared>,
    url: String,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"code": code, "message": message, "retryable": status.is_server_error()}})),
    )
        .into_response()
}

impl FakeRuntime {
    /// Binds 127.0.0.1:0 and serves on the current tokio runtime.
    pub async fn start() -> FakeRuntime {
        let shared = Arc::new(Shared {
            st: Mutex::new(St {
                next_event: 100,
                ..St::default()
            }),
            changed: Notify::new(),
            delay: Mutex::new(Duration::from_millis(50)),
            down: AtomicBool::new(false),
            streams: AtomicUsize::new(0),
            reads: AtomicUsize::new(0),
            drop_after: Mutex::new(None),
            repeat: AtomicBool::new(false),
            hide_next: AtomicBool::new(false),
            generation: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/v1/submissions", post(submissions))
            .route("/v1/events", get(events))
            .route("/v1/runs/{id}", get(read_run))
            .route(
                "/v1/runs/{id}/interrupt",
                post(|| async {
                    error(
                        StatusCode::CONFLICT,
                        "conflict",
                        "runs of this fake cannot be interrupted",
                    )
                }),
            )
            .route(
                "/v1/conversations/{id}/stop",
                post(|| async { axum::Json(json!({"interrupted": null, "cancelled": 0})) }),
            )
            .route("/v1/health", get(health))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        FakeRuntime { shared, url }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// How long a run takes.
    pub fn set_delay(&self, delay: Duration) {
        *self.shared.delay.lock().unwrap() = delay;
    }

    /// The next event stream ends after sending this many lines.
    pub fn drop_stream_after(&self, lines: usize) {
        *self.shared.drop_after.lock().unwrap() = Some(lines);
    }

    /// Send every durable event twice.
    pub fn repeat_events(&self, on: bool) {
        self.shared.repeat.store(on, Ordering::SeqCst);
    }

    /// The next `run.finished` is never streamed (only `GET /v1/runs/…`
    /// shows it).
    pub fn hide_next_finished(&self) {
        self.shared.hide_next.store(true, Ordering::SeqCst);
    }

    /// A restart: every stream ends, requests get 503 for `down_for`, and
    /// everything durable is kept.
    pub async fn restart(&self, down_for: Duration) {
        self.shared.down.store(true, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        self.shared.changed.notify_waiters();
        tokio::time::sleep(down_for).await;
        self.shared.down.store(false, Ordering::SeqCst);
    }

    /// Event streams opened so far.
    pub fn streams_opened(&self) -> usize {
        self.shared.streams.load(Ordering::SeqCst)
    }

    /// `GET /v1/runs/…` requests so far.
    pub fn run_reads(&self) -> usize {
        self.shared.reads.load(Ordering::SeqCst)
    }

    /// Runs admitted (distinct idempotency keys).
    pub fn runs(&self) -> usize {
        self.shared.st.lock().unwrap().runs.len()
    }

    /// Event ids that were hidden from every stream.
    pub fn hidden_events(&self) -> Vec<i64> {
        self.shared.st.lock().unwrap().hidden.clone()
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if shared.down.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "restarting");
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn submissions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    if shared.down.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "restarting");
    }
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "bad_request", "not JSON");
    };
    let delay = *shared.delay.lock().unwrap();
    let mut admissions = Vec::new();
    for item in body["submissions"].as_array().cloned().unwrap_or_default() {
        let key = item["idempotency_key"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let conversation = item["conversation_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let mut st = shared.st.lock().unwrap();
        if let Some(&index) = st.keys.get(&key) {
            let run = &st.runs[index];
            admissions.push(json!({"run_id": index.to_string(), "new": false, "state": run.state}));
            continue;
        }
        let index = st.runs.len();
        st.runs.push(Run {
            conversation: conversation.clone(),
            text: item["input"]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            state: "queued".into(),
            event_id: None,
        });
        st.keys.insert(key, index);
        let now = tokio::time::Instant::now();
        let start = st
            .busy_until
            .get(&conversation)
            .copied()
            .unwrap_or(now)
            .max(now);
        let done = start + delay;
        st.busy_until.insert(conversation, done);
        drop(st);
        admissions.push(json!({"run_id": index.to_string(), "new": true, "state": "queued"}));
        let shared = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(done).await;
            let mut st = shared.st.lock().unwrap();
            st.next_event += 10;
            let id = st.next_event;
            st.runs[index].state = "completed".into();
            st.runs[index].event_id = Some(id);
            st.events.push((id, index));
            if shared.hide_next.swap(false, Ordering::SeqCst) {
                st.hidden.push(id);
            }
            drop(st);
            shared.changed.notify_waiters();
        });
    }
    axum::Json(json!({"admissions": admissions})).into_response()
}

fn run_json(index: usize, run: &Run) -> Value {
    let done = run.state == "completed";
    json!({
        "run_id": index.to_string(),
        "conversation_id": run.conversation,
        "state": run.state,
        "reason": null,
        "answer": done.then(|| format!("echo: {}", run.text)),
        "event_id": run.event_id,
        "answered_by": null,
    })
}

async fn read_run(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if shared.down.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "restarting");
    }
    shared.reads.fetch_add(1, Ordering::SeqCst);
    let st = shared.st.lock().unwrap();
    match id
        .parse::<usize>()
        .ok()
        .and_then(|i| st.runs.get(i).map(|r| (i, r)))
    {
        Some((i, run)) => axum::Json(run_json(i, run)).into_response(),
        None => error(StatusCode::NOT_FOUND, "not_found", "no such run"),
    }
}

#[derive(serde::Deserialize)]
struct After {
    #[serde(default)]
    after: i64,
}

async fn events(State(shared): State<Arc<Shared>>, Query(after): Query<After>) -> Response {
    if shared.down.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "restarting");
    }
    shared.streams.fetch_add(1, Ordering::SeqCst);
    let generation = shared.generation.load(Ordering::SeqCst);
    let limit = shared.drop_after.lock().unwrap().take();
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let mut sent = 0usize;
        let mut cursor = after.after;
        let mut heartbeat = tokio::time::interval(Duration::from_millis(500));
        loop {
            let batch: Vec<Value> = {
                let st = shared.st.lock().unwrap();
                st.events
                    .iter()
                    .filter(|(id, _)| *id > cursor && !st.hidden.contains(id))
                    .map(|(id, index)| {
                        let mut event = run_json(*index, &st.runs[*index]);
                        event["type"] = json!("run.finished");
                        event["event_id"] = json!(id);
                        event
                    })
                    .collect()
            };
            for event in batch {
                cursor = event["event_id"].as_i64().unwrap_or(cursor);
                let copies = if shared.repeat.load(Ordering::SeqCst) {
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    if limit.is_some_and(|l| sent >= l) {
                        return;
                    }
                    let line = format!("{event}\n");
                    if tx.send(Ok(Bytes::from(line))).await.is_err() {
                        return;
                    }
                    sent += 1;
                }
            }
            let changed = shared.changed.notified();
            tokio::select! {
                _ = changed => {}
                _ = heartbeat.tick() => {
                    if tx.send(Ok(Bytes::from("{\"type\":\"heartbeat\"}\n"))).await.is_err() {
                        return;
                    }
                }
            }
            if shared.generation.load(Ordering::SeqCst) != generation {
                return;
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}
