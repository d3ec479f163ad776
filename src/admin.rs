//! The operator listener: `/healthz` (the process is alive) and `/metrics`
//! (Prometheus text). It binds to loopback by default.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::observe::Observer;

/// The content type of the OpenMetrics text `prometheus-client` writes;
/// Prometheus scrapes it natively.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn router(observer: Arc<Observer>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .with_state(observer)
}

async fn metrics(State(observer): State<Arc<Observer>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        observer.encode_metrics(),
    )
}
