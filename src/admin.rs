//! The operator listener: `/healthz` (the process is alive), `/metrics`
//! (Prometheus text), and a small JSON API over the journal and the outbox.
//! It binds to loopback by default.
//!
//! | method and path | what it does |
//! |---|---|
//! | `GET /healthz` | `ok` while the process runs |
//! | `GET /metrics` | counters, and outbox gauges read through indexes |
//! | `GET /v1/inbound?disposition=D&limit=N` | journal rows, newest first |
//! | `GET /v1/outbox?state=S&conversation=C&limit=N` | outbox items, newest first |
//! | `POST /v1/outbox/{id}/resolve` `{"action": "as-sent" \| "resend" \| "drop"}` | settle a `held` item |

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
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/v1/inbound", get(inbound))
        .route("/v1/outbox", get(outbox))
        .route("/v1/outbox/{id}/resolve", post(resolve))
        .with_state(state)
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
