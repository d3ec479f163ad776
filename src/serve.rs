//! `switchboard runtime serve`: the built-in runtime over the runtime
//! protocol (docs/runtime-protocol.md), so the protocol has a working
//! server, Switchboard instances can be chained, and the `http` connector is
//! tested against a real implementation.
//!
//! The served runtime keeps its runs in its own store, as it does inside a
//! daemon. Its answers leave as events, so its runs write no reply items.
//! Durable events are the runs' terminal records (`run_events`); deltas are
//! the runtime's transient stream. A client's conversation ids are mapped
//! to conversations of this store (`account = "served"`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::{SharedClock, SystemClock};
use crate::config::{Config, RuntimeConfig};
use crate::observe::Observer;
use crate::outbox::shape::Shaper;
use crate::runtime::local::{Deps, LocalRuntime};
use crate::runtime::{Input, Runtime, Stop, Submission, SubmitError};
use crate::store::sqlite::OpenMode;
use crate::store::{RunRow, RunState, SharedStore};
use crate::surface::{InputPolicy, SurfaceKind};

/// The account this store's served conversations are keyed under.
const CLIENT: &str = "served";

#[derive(Clone)]
struct Served {
    runtime: Arc<LocalRuntime>,
    store: SharedStore,
    clock: SharedClock,
    token: Option<String>,
    /// Client conversation keys of local conversations seen so far.
    keys: Arc<Mutex<HashMap<i64, String>>>,
    stop: CancellationToken,
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let retryable = matches!(code, "busy" | "unavailable" | "internal" | "queue_full");
    (
        status,
        Json(json!({"error": {"code": code, "message": message.into(), "retryable": retryable}})),
    )
        .into_response()
}

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    runtime: Arc<LocalRuntime>,
    store: SharedStore,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Open the store, build the runtime named by `[serve]`, recover its
    /// runs and serve.
    pub async fn start(config: Config) -> anyhow::Result<Server> {
        let serve = config
            .serve
            .clone()
            .ok_or_else(|| anyhow::anyhow!("the config has no [serve] section"))?;
        let Some(RuntimeConfig::Local(local)) = config.runtimes.get(&serve.runtime) else {
            anyhow::bail!("serve.runtime must name a built-in runtime");
        };
        let store = crate::store::open(&config.store, OpenMode::Daemon).await?;
        let clock: SharedClock = Arc::new(SystemClock);
        let runtime = Arc::new(
            LocalRuntime::new(
                &serve.runtime,
                local,
                Deps {
                    store: store.clone(),
                    batch_size: config.store.batch_size,
                    messages: config.messages.clone(),
                    shaper: Shaper::detached(),
                    clock: clock.clone(),
                    observer: Arc::new(Observer::new()),
                    outbox_wake: Arc::new(Notify::new()),
                },
            )
            .map_err(anyhow::Error::msg)?,
        );
        let resumed = runtime.recover().await.map_err(anyhow::Error::msg)?;
        if resumed > 0 {
            tracing::info!(runs = resumed, "resumed runs a previous process left");
        }
        let stop = CancellationToken::new();
        let state = Served {
            runtime: runtime.clone(),
            store: store.clone(),
            clock,
            token: serve.resolve_token().map_err(anyhow::Error::msg)?,
            keys: Arc::default(),
            stop: stop.clone(),
        };
        let app = Router::new()
            .route("/v1/submissions", post(submissions))
            .route("/v1/events", get(events))
            .route("/v1/runs/{run_id}", get(run))
            .route("/v1/runs/{run_id}/interrupt", post(interrupt))
            .route(
                "/v1/conversations/{conversation_id}/stop",
                post(stop_conversation),
            )
            .route("/v1/health", get(health))
            .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
            .with_state(state);
        let listen = crate::config::parse_listen(&serve.listen).map_err(anyhow::Error::msg)?;
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let graceful = stop.clone();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { graceful.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "the runtime server stopped");
            }
        });
        tracing::info!(%addr, runtime = %serve.runtime, "serving the runtime protocol");
        Ok(Server {
            addr,
            runtime,
            store,
            stop,
            task,
        })
    }

    /// Stop serving: runs in flight get the configured grace period.
    pub async fn shutdown(self, grace: Duration, force: Duration) {
        self.stop.cancel();
        let report = self.runtime.close(grace, force).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
        self.store.close().await;
        tracing::info!(
            settled = report.settled,
            remaining = report.remaining,
            "runtime server stopped"
        );
    }
}

fn authorized(state: &Served, headers: &HeaderMap) -> Option<Response> {
    let token = state.token.as_deref()?;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if bool::from(subtle::ConstantTimeEq::ct_eq(
        given.as_bytes(),
        token.as_bytes(),
    )) {
        None
    } else {
        Some(error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        ))
    }
}

impl Served {
    async fn conversation(&self, key: &str, surface: SurfaceKind) -> Result<i64, String> {
        let id = self
            .store
            .conversation_for_key(CLIENT, key, surface, self.clock.now_ms())
            .await
            .map_err(|e| e.to_string())?;
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, key.to_owned());
        Ok(id)
    }

    async fn key_of(&self, conversation_id: i64) -> String {
        if let Some(key) = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&conversation_id)
        {
            return key.clone();
        }
        let key = self
            .store
            .conversation_key(conversation_id)
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| conversation_id.to_string());
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(conversation_id, key.clone());
        key
    }

    async fn run_json(&self, run: &RunRow) -> Value {
        let terminal = !matches!(
            run.state,
            RunState::Queued | RunState::Running | RunState::InterruptRequested
        );
        let mut out = json!({
            "run_id": run.id.to_string(),
            "conversation_id": self.key_of(run.conversation_id).await,
            "state": run.state.as_str(),
            "answered_by": run.absorbed_by.map(|id| id.to_string()),
        });
        if terminal {
            out["reason"] = json!(protocol_reason(run.state, run.reason.as_deref()));
            out["answer"] = json!(answer_of(run.state, run.answer.as_deref()));
            out["attachments"] = json!([]);
            out["event_id"] = json!(self.store.run_terminal_event(run.id).await.ok().flatten());
        }
        out
    }
}

/// The protocol's reasons: `timeout` and `shutdown` are standard; others
/// pass through.
fn protocol_reason(state: RunState, reason: Option<&str>) -> Option<String> {
    let reason = reason?;
    if state == RunState::Failed
        && (reason.starts_with("model call timed out") || reason.starts_with("the run took longer"))
    {
        return Some("timeout".into());
    }
    Some(reason.to_owned())
}

/// Only completed and interrupted runs have an answer to show.
fn answer_of(state: RunState, answer: Option<&str>) -> Option<String> {
    match state {
        RunState::Completed | RunState::Interrupted => Some(answer.unwrap_or_default().to_owned()),
        _ => None,
    }
}

async fn submissions(
    State(state): State<Served>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the body is not JSON",
        );
    };
    let Some(items) = body["submissions"].as_array() else {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "submissions: an array is required",
        );
    };
    if items.is_empty() || items.len() > 512 {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "submissions: between 1 and 512 are allowed",
        );
    }
    let mut batch = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match submission(&state, item).await {
            Ok(s) => batch.push(s),
            Err(why) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("submissions[{i}].{why}"),
                );
            }
        }
    }
    let results = state.runtime.submit(batch).await;
    let mut admissions = Vec::with_capacity(results.len());
    for result in results {
        admissions.push(match result {
            Ok(admission) => {
                let run = match admission.run_id.parse::<i64>() {
                    Ok(id) => state.store.run_get(id).await.ok().flatten(),
                    Err(_) => None,
                };
                json!({
                    "run_id": admission.run_id,
                    "new": admission.new,
                    "state": run.as_ref().map_or("queued", |r| r.state.as_str()),
                    "answered_by": run.and_then(|r| r.absorbed_by).map(|id| id.to_string()),
                })
            }
            Err(SubmitError::Refused(m)) => {
                json!({"error": {"code": "queue_full", "message": m, "retryable": true}})
            }
            Err(SubmitError::Rejected(m)) => {
                json!({"error": {"code": "rejected", "message": m, "retryable": false}})
            }
            Err(SubmitError::Unavailable(m)) => {
                json!({"error": {"code": "unavailable", "message": m, "retryable": true}})
            }
        });
    }
    Json(json!({"admissions": admissions})).into_response()
}

async fn submission(state: &Served, item: &Value) -> Result<Submission, String> {
    let text = |v: &Value, field: &str| -> Result<String, String> {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{field}: a string is required"))
    };
    let key = text(&item["idempotency_key"], "idempotency_key")?;
    if key.is_empty() || key.len() > 200 {
        return Err("idempotency_key: 1 to 200 characters".into());
    }
    let conversation = text(&item["conversation_id"], "conversation_id")?;
    if conversation.is_empty() {
        return Err("conversation_id: must not be empty".into());
    }
    let context = &item["context"];
    let surface = context["surface"]
        .as_str()
        .and_then(SurfaceKind::parse)
        .unwrap_or(SurfaceKind::Webhook);
    let policy = match item["input_policy"].as_str().map(InputPolicy::parse) {
        Some(Some(InputPolicy::Auto)) | Some(None) | None => {
            return Err(
                "input_policy: one of queue, inject, interrupt, interrupt-next, supersede".into(),
            );
        }
        Some(Some(p)) => p,
    };
    let input = &item["input"];
    let attachments = match &input["attachments"] {
        Value::Null => Vec::new(),
        v => serde_json::from_value(v.clone()).map_err(|e| format!("input.attachments: {e}"))?,
    };
    let conversation_id = state.conversation(&conversation, surface).await?;
    Ok(Submission {
        idempotency_key: key,
        conversation_id,
        inbound_id: None,
        account: context["account"].as_str().unwrap_or(CLIENT).to_owned(),
        chat_id: context["chat_id"]
            .as_str()
            .unwrap_or(&conversation)
            .to_owned(),
        thread_id: context["thread_id"].as_str().map(str::to_owned),
        surface,
        reply_to: None,
        input: Input {
            text: input["text"].as_str().unwrap_or_default().to_owned(),
            attachments,
            sender_id: input["sender"]["id"].as_str().map(str::to_owned),
            sender_name: input["sender"]["name"].as_str().map(str::to_owned),
        },
        policy,
        coalesce_pending: item["coalesce_pending"].as_bool().unwrap_or(false),
        max_queued_inputs: item["max_queued_inputs"]
            .as_u64()
            .map_or(crate::surface::DEFAULT_MAX_QUEUED_INPUTS, |n| {
                n.max(1) as usize
            }),
        soft_interrupt: item["soft_interrupt"].as_bool().unwrap_or(false),
    })
}

async fn run(
    State(state): State<Served>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    let found = match run_id.parse::<i64>() {
        Ok(id) => state.store.run_get(id).await,
        Err(_) => Ok(None),
    };
    match found {
        Ok(Some(run)) => Json(state.run_json(&run).await).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no run {run_id}"),
        ),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    }
}

#[derive(Deserialize)]
struct InterruptBody {
    mode: String,
    #[serde(default)]
    reason: Option<String>,
}

async fn interrupt(
    State(state): State<Served>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    let Ok(request) = serde_json::from_slice::<InterruptBody>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "mode: \"interrupt\" or \"supersede\" is required",
        );
    };
    let end_as = match request.mode.as_str() {
        "interrupt" => RunState::Interrupted,
        "supersede" => RunState::Superseded,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "mode: \"interrupt\" or \"supersede\"",
            );
        }
    };
    let Ok(id) = run_id.parse::<i64>() else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no run {run_id}"),
        );
    };
    let reason = request
        .reason
        .unwrap_or_else(|| "interrupted by the client".into());
    match state.runtime.interrupt_run(id, end_as, &reason).await {
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no run {run_id}"),
        ),
        Ok(Some(s @ (RunState::InterruptRequested | RunState::Cancelled))) => (
            StatusCode::ACCEPTED,
            Json(json!({"run_id": run_id, "state": s.as_str()})),
        )
            .into_response(),
        Ok(Some(s)) => error(
            StatusCode::CONFLICT,
            "conflict",
            format!("run {run_id} is already {s}"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e),
    }
}

async fn stop_conversation(
    State(state): State<Served>,
    headers: HeaderMap,
    Path(key): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    let reason = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["reason"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "/stop".into());
    let conversation_id = match state.conversation(&key, SurfaceKind::Webhook).await {
        Ok(id) => id,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e),
    };
    match state
        .runtime
        .stop(Stop {
            conversation_id,
            reason,
            notice: None,
        })
        .await
    {
        Ok(report) => {
            Json(json!({"interrupted": report.interrupted, "cancelled": report.cancelled}))
                .into_response()
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            e.to_string(),
        ),
    }
}

async fn health(State(state): State<Served>, headers: HeaderMap) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    if state.stop.is_cancelled() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "stopping");
    }
    Json(json!({"status": "ok"})).into_response()
}

#[derive(Deserialize)]
struct EventsQuery {
    #[serde(default)]
    after: i64,
}

/// The run.finished line of a terminal event.
async fn finished_line(state: &Served, event: &crate::store::RunEventRow) -> Value {
    let payload: Value = serde_json::from_str(&event.payload).unwrap_or_default();
    json!({
        "type": "run.finished",
        "event_id": event.id,
        "run_id": event.run_id.to_string(),
        "conversation_id": state.key_of(event.conversation_id).await,
        "state": event.state.as_str(),
        "reason": protocol_reason(event.state, payload["reason"].as_str()),
        "answer": answer_of(event.state, payload["answer"].as_str()),
        "attachments": [],
        "answered_by": payload["answered_by"].as_i64().map(|id| id.to_string()),
        "at": event.created_at,
    })
}

async fn events(
    State(state): State<Served>,
    headers: HeaderMap,
    Query(query): Query<EventsQuery>,
) -> Response {
    if let Some(denied) = authorized(&state, &headers) {
        return denied;
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(256);
    let mut deltas = state.runtime.deltas();
    tokio::spawn(async move {
        let send = |value: Value| {
            let mut line = value.to_string();
            line.push('\n');
            tx.send(Ok(axum::body::Bytes::from(line)))
        };
        let mut cursor = query.after;
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        let mut heartbeat = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = state.stop.cancelled() => return,
                delta = deltas.recv() => match delta {
                    Ok(delta) => {
                        let line = json!({
                            "type": "run.delta",
                            "run_id": delta.run_id,
                            "conversation_id": state.key_of(delta.conversation_id).await,
                            "epoch": delta.epoch.max(1),
                            "seq": delta.sequence,
                            "text": delta.text,
                        });
                        if send(line).await.is_err() {
                            return;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => return,
                },
                _ = poll.tick() => {
                    loop {
                        let Ok(page) = state.store.run_events_after(cursor, 500).await else {
                            break;
                        };
                        for event in &page {
                            cursor = event.id;
                            if send(finished_line(&state, event).await).await.is_err() {
                                return;
                            }
                        }
                        if page.len() < 500 {
                            break;
                        }
                    }
                }
                _ = heartbeat.tick() => {
                    if send(json!({"type": "heartbeat", "at": state.clock.now_ms()})).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}
