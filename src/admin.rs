//! The operator listener: `/healthz` (the process is alive), `/metrics`
//! (Prometheus text), and a small JSON API over the journal and the outbox.
//! It binds to loopback by default.
//!
//! | method and path | what it does |
//! |---|---|
//! | `GET /healthz` | `ok` while the process runs |
//! | `GET /readyz` | 200 when every channel account receives updates, else 503; JSON per account |
//! | `GET /v1/attachments/{account}?reference=R` | an attachment's bytes, fetched from the platform (size-capped) |
//! | `GET /metrics` | counters, and outbox gauges read through indexes |
//! | `GET /v1/inbound?disposition=D&limit=N` | journal rows, newest first |
//! | `GET /v1/outbox?state=S&conversation=C&limit=N` | outbox items, newest first |
//! | `POST /v1/outbox/{id}/resolve` `{"action": "as-sent" \| "resend" \| "drop"}` | settle a `held` item |
//! | `POST /v1/schedules` (JSON as `schedule add`) | add a schedule |
//! | `GET /v1/schedules?account=NAME&chat_id=C&state=S&limit=N` | schedules, newest first |
//! | `GET /v1/schedules/{id}` | a schedule and its recent occurrences |
//! | `POST /v1/schedules/{id}/pause`, `/resume`, `/cancel` | change its state |

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::clock::SharedClock;
use crate::observe::Observer;
use crate::store::{DispatchState, Disposition, OutboxFilter, Resolution, SharedStore};

/// The content type of the OpenMetrics text `prometheus-client` writes;
/// Prometheus scrapes it natively.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone)]
pub struct AdminState {
    pub observer: Arc<Observer>,
    pub store: SharedStore,
    pub clock: SharedClock,
    pub config: Arc<crate::config::Config>,
    /// Woken when a schedule is added.
    pub scheduler_wake: Arc<tokio::sync::Notify>,
    /// `admin.token`, when set.
    pub token: Option<String>,
    /// The runtimes, for readiness.
    pub runtimes: Vec<Arc<dyn crate::runtime::Runtime>>,
    /// Channel adapters by configured account name (attachment downloads).
    pub adapters: std::collections::HashMap<String, Arc<dyn switchboard_channel::ChannelAdapter>>,
}

pub fn router(state: AdminState) -> Router {
    let token = state.token.clone();
    let guarded = Router::new()
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/attachments/{account}", get(attachment))
        .route("/v1/inbound", get(inbound))
        .route("/v1/outbox", get(outbox))
        .route("/v1/outbox/{id}/resolve", post(resolve))
        .route("/v1/schedules", post(schedule_add).get(schedule_list))
        .route("/v1/schedules/{id}", get(schedule_show))
        .route("/v1/schedules/{id}/{verb}", post(schedule_transition))
        .with_state(state)
        .layer(axum::middleware::from_fn(move |request, next| {
            let token = token.clone();
            async move { require_token(token.as_deref(), request, next).await }
        }));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(guarded)
}

/// With `admin.token` set, every route but `/healthz` needs
/// `Authorization: Bearer TOKEN` (compared in constant time).
async fn require_token(
    token: Option<&str>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = token else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if bool::from(subtle::ConstantTimeEq::ct_eq(
        given.as_bytes(),
        token.as_bytes(),
    )) {
        next.run(request).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "this admin API needs Authorization: Bearer <admin.token>\n",
        )
            .into_response()
    }
}

#[derive(Deserialize)]
struct AttachmentQuery {
    reference: String,
}

/// Attachments reach runtimes as references; this resolves one on demand,
/// refusing files over `admin.max_attachment_bytes`. Nothing is stored.
async fn attachment(
    State(state): State<AdminState>,
    Path(account): Path<String>,
    Query(q): Query<AttachmentQuery>,
) -> Response {
    use switchboard_channel::FetchError;
    let Some(adapter) = state.adapters.get(&account) else {
        return problem(
            StatusCode::NOT_FOUND,
            format!("no channel account {account:?}"),
        );
    };
    let limit = state.config.admin.max_attachment_bytes;
    match adapter.fetch_attachment(&q.reference, limit).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response(),
        Err(e @ FetchError::TooLarge { .. }) => problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{e}; raise admin.max_attachment_bytes to allow it"),
        ),
        Err(e @ FetchError::NotFound(_)) => problem(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ FetchError::Unsupported) => problem(StatusCode::NOT_IMPLEMENTED, e.to_string()),
        Err(e @ FetchError::Failed(_)) => problem(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

/// Ready when the store answers, every channel account receives updates
/// and every runtime can take work; 503 with the reasons otherwise.
async fn readyz(State(state): State<AdminState>) -> Response {
    let channels = state.observer.channel_states();
    let store = match state.store.ping().await {
        Ok(()) => json!({"state": "up"}),
        Err(e) => json!({"state": "down", "detail": e.to_string()}),
    };
    let mut runtimes = serde_json::Map::new();
    for runtime in &state.runtimes {
        let health = match runtime.health().await {
            Ok(()) => json!({"state": "up"}),
            Err(e) => json!({"state": "down", "detail": e}),
        };
        runtimes.insert(runtime.name().to_owned(), health);
    }
    let ready = store["state"] == "up"
        && channels.values().all(|c| c.state == "up")
        && runtimes.values().all(|r| r["state"] == "up");
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"ready": ready, "store": store, "channels": channels, "runtimes": runtimes});
    (status, Json(body)).into_response()
}

fn problem(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "error": { "message": message.into() } })),
    )
        .into_response()
}

async fn metrics(State(state): State<AdminState>) -> Response {
    // Gauges come from the store at scrape time, through indexes; a store
    // that cannot answer leaves them out rather than failing the scrape.
    match state.store.outbox_stats().await {
        Ok(stats) => state
            .observer
            .set_outbox_gauges(&stats, state.clock.now_ms()),
        Err(e) => tracing::warn!(error = %e, "could not read outbox figures for /metrics"),
    }
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.observer.encode_metrics(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
    disposition: Option<String>,
    conversation: Option<i64>,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    50
}

async fn inbound(State(state): State<AdminState>, Query(q): Query<ListQuery>) -> Response {
    let disposition = match q.disposition.as_deref().map(|d| (d, Disposition::parse(d))) {
        None => None,
        Some((_, Some(d))) => Some(d),
        Some((d, None)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                format!("unknown disposition {d:?}"),
            );
        }
    };
    match state
        .store
        .journal_list(disposition, q.limit.min(1000))
        .await
    {
        Ok(rows) => Json(json!({ "inbound": rows })).into_response(),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn outbox(State(state): State<AdminState>, Query(q): Query<ListQuery>) -> Response {
    let dispatch_state = match q.state.as_deref().map(|s| (s, DispatchState::parse(s))) {
        None => None,
        Some((_, Some(s))) => Some(s),
        Some((s, None)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                format!("unknown dispatch state {s:?}"),
            );
        }
    };
    let filter = OutboxFilter {
        state: dispatch_state,
        conversation_id: q.conversation,
        limit: q.limit.min(1000),
    };
    match state.store.outbox_list(&filter).await {
        Ok(items) => Json(json!({ "items": items })).into_response(),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

#[derive(Deserialize)]
struct ResolveBody {
    action: String,
}

/// Parse an operator's resolution (`as-sent`, `resend`, `drop`).
pub fn parse_resolution(action: &str) -> Option<Resolution> {
    match action {
        "as-sent" => Some(Resolution::AsSent),
        "resend" => Some(Resolution::Resend),
        "drop" => Some(Resolution::Drop),
        _ => None,
    }
}

async fn resolve(
    State(state): State<AdminState>,
    Path(id): Path<i64>,
    body: Result<Json<ResolveBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Ok(Json(body)) = body else {
        return problem(
            StatusCode::BAD_REQUEST,
            r#"send {"action": "as-sent" | "resend" | "drop"}"#,
        );
    };
    let Some(resolution) = parse_resolution(&body.action) else {
        return problem(
            StatusCode::BAD_REQUEST,
            format!(
                "unknown action {:?}; use as-sent, resend or drop",
                body.action
            ),
        );
    };
    match state
        .store
        .outbox_resolve(id, resolution, state.clock.now_ms())
        .await
    {
        Ok(true) => {
            tracing::info!(item = id, action = %body.action, "an operator resolved a held item");
            Json(json!({ "resolved": true })).into_response()
        }
        Ok(false) => problem(
            StatusCode::CONFLICT,
            format!("outbox item {id} is not held"),
        ),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

fn schedule_problem(e: crate::schedule::ops::OpError) -> Response {
    use crate::schedule::ops::OpError;
    match e {
        OpError::Invalid(why) => problem(StatusCode::BAD_REQUEST, why),
        OpError::NotFound(id) => problem(StatusCode::NOT_FOUND, format!("no schedule {id}")),
        OpError::Store(e) => problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn schedule_add(
    State(state): State<AdminState>,
    body: Result<Json<crate::schedule::ops::AddSchedule>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(add) = match body {
        Ok(b) => b,
        Err(e) => return problem(StatusCode::BAD_REQUEST, format!("not a schedule: {e}")),
    };
    match crate::schedule::ops::add(
        &state.store,
        &state.config,
        state.clock.now_ms(),
        &add,
        "api",
    )
    .await
    {
        Ok(schedule) => {
            state.scheduler_wake.notify_one();
            (StatusCode::CREATED, Json(json!({ "schedule": schedule }))).into_response()
        }
        Err(e) => schedule_problem(e),
    }
}

#[derive(Deserialize)]
struct ScheduleQuery {
    account: Option<String>,
    chat_id: Option<String>,
    state: Option<String>,
    #[serde(default = "default_limit")]
    limit: usize,
}

async fn schedule_list(
    State(state): State<AdminState>,
    Query(q): Query<ScheduleQuery>,
) -> Response {
    let schedule_state = match q
        .state
        .as_deref()
        .map(|s| (s, crate::store::ScheduleState::parse(s)))
    {
        None => None,
        Some((_, Some(s))) => Some(s),
        Some((s, None)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                format!("unknown schedule state {s:?}"),
            );
        }
    };
    let account = match q.account {
        Some(name) => match state.store.channel_account(&name).await {
            Ok(Some((identity, _))) => Some(identity),
            Ok(None) => {
                return problem(
                    StatusCode::NOT_FOUND,
                    format!("no channel account named {name:?}"),
                );
            }
            Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        },
        None => None,
    };
    let filter = crate::store::ScheduleFilter {
        account,
        chat_id: q.chat_id,
        state: schedule_state,
        limit: q.limit.min(1000),
    };
    match state.store.schedule_list(&filter).await {
        Ok(rows) => Json(json!({ "schedules": rows })).into_response(),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn schedule_show(State(state): State<AdminState>, Path(id): Path<i64>) -> Response {
    match crate::schedule::ops::show(&state.store, id).await {
        Ok(detail) => Json(detail).into_response(),
        Err(e) => schedule_problem(e),
    }
}

async fn schedule_transition(
    State(state): State<AdminState>,
    Path((id, verb)): Path<(i64, String)>,
) -> Response {
    match crate::schedule::ops::transition(&state.store, state.clock.now_ms(), id, &verb).await {
        Ok(schedule) => {
            state.scheduler_wake.notify_one();
            Json(json!({ "schedule": schedule })).into_response()
        }
        Err(e) => schedule_problem(e),
    }
}
