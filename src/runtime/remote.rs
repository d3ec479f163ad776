//! The `http` runtime connector: a runtime of someone else's, over the
//! protocol in docs/runtime-protocol.md.
//!
//! - Submissions carry the journal's idempotency keys, so a retry after a
//!   timeout (or a restart) gets the same run back; each admitted run is
//!   recorded as *awaited*, with where its answer goes.
//! - One event stream per runtime, resumed from a cursor in the store. A
//!   `run.finished` of an awaited run becomes reply items keyed by its event
//!   id, written in the transaction that marks the run finished and
//!   advances the cursor: a repeated event changes nothing, a crash loses
//!   nothing. After every (re)connect the awaited runs are re-read, since
//!   durable event ids may have gaps the client cannot see.
//! - Transient deltas feed streaming previews only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use switchboard_channel::AttachmentRef;
use tokio::sync::{Notify, broadcast};
use tokio_util::sync::CancellationToken;

use super::{
    Admission, CloseReport, Route, RunDelta, Runtime, Stop, StopReport, Submission, SubmitError,
};
use crate::clock::SharedClock;
use crate::config::{HttpRuntimeConfig, Messages};
use crate::keys;
use crate::observe::SharedObserver;
use crate::outbox::shape::Shaper;
use crate::store::{NewOutboxItem, NewReply, RemoteRun, SharedStore};

/// A stream quiet for this long is dead (servers send heartbeats at least
/// every 15 s).
const STREAM_IDLE: Duration = Duration::from_secs(45);

/// Everything the connector needs from the daemon.
pub struct RemoteDeps {
    pub store: SharedStore,
    pub shaper: Shaper,
    pub messages: Messages,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    pub outbox_wake: Arc<Notify>,
}

struct Inner {
    name: String,
    base: String,
    token: Option<String>,
    /// Submissions, run reads, stops: bounded by `request_timeout_secs`.
    client: reqwest::Client,
    /// The event stream: no overall timeout.
    stream_client: reqwest::Client,
    deps: RemoteDeps,
    deltas: broadcast::Sender<RunDelta>,
    /// The stream is connected.
    connected: AtomicBool,
    last_error: Mutex<String>,
    /// Routes of awaited runs seen by deltas, and the latest (epoch, seq)
    /// shown for each.
    routes: Mutex<HashMap<String, Shown>>,
    stop: CancellationToken,
    started: AtomicBool,
}

/// A run whose deltas are shown: its route and conversation, and the latest
/// `(epoch, seq)` shown.
type Shown = (Arc<Route>, i64, u32, u64);

/// The connector.
pub struct RemoteRuntime {
    inner: Arc<Inner>,
}

/// What a failed call means for the caller.
#[derive(Debug)]
enum CallError {
    /// Not now: try again later with the same keys.
    Unavailable(String),
    /// The runtime answered with an error body.
    Status(u16, String, String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unavailable(e) => f.write_str(e),
            CallError::Status(status, code, message) => write!(f, "{status} {code}: {message}"),
        }
    }
}

impl RemoteRuntime {
    pub fn new(
        name: &str,
        config: &HttpRuntimeConfig,
        deps: RemoteDeps,
    ) -> Result<RemoteRuntime, String> {
        let token = config
            .resolve_token()
            .map_err(|e| format!("runtimes.{name}.token_file: {e}"))?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(config.request_timeout_secs))
            .build()
            .map_err(|e| format!("building the HTTP client of runtimes.{name}: {e}"))?;
        let stream_client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("building the HTTP client of runtimes.{name}: {e}"))?;
        let (deltas, _) = broadcast::channel(1024);
        Ok(RemoteRuntime {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                base: config.base_url.trim_end_matches('/').to_owned(),
                token,
                client,
                stream_client,
                deps,
                deltas,
                connected: AtomicBool::new(false),
                last_error: Mutex::new("not connected yet".into()),
                routes: Mutex::new(HashMap::new()),
                stop: CancellationToken::new(),
                started: AtomicBool::new(false),
            }),
        })
    }
}

impl Inner {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut request = self.client.request(method, format!("{}{path}", self.base));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        request
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, CallError> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| CallError::Unavailable(format!("{path}: {e}")))?;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if (200..300).contains(&status) {
            return Ok(body);
        }
        let code = body["error"]["code"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned();
        let message = body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        match status {
            400 | 404 | 409 => Err(CallError::Status(status, code, message)),
            _ => Err(CallError::Unavailable(format!(
                "{path}: HTTP {status} {code}: {message}"
            ))),
        }
    }

    fn run_key(&self, run_id: &str) -> String {
        keys::remote_run_key(&self.name, run_id)
    }

    /// The reply items of a finished run, by its terminal state.
    fn replies(&self, run: &RemoteRun, event: &Value, event_id: i64) -> Vec<NewReply> {
        let shaper = &self.deps.shaper;
        let messages = &self.deps.messages;
        let key = self.run_key(&run.run_id);
        let answer = event["answer"].as_str().unwrap_or_default();
        let attachments: Vec<AttachmentRef> =
            serde_json::from_value(event["attachments"].clone()).unwrap_or_default();
        match event["state"].as_str().unwrap_or_default() {
            "completed" => {
                shaper.answer_with(&run.account, &key, answer, attachments, Some(event_id))
            }
            "interrupted" if !answer.is_empty() => shaper.answer_with(
                &run.account,
                &key,
                &format!("{answer}\n\n{}", messages.interrupted_marker),
                attachments,
                Some(event_id),
            ),
            // Nothing was said: the /stop confirmation says it, if one follows.
            "interrupted" if run.end_notice.is_some() => Vec::new(),
            "interrupted" => shaper.answer_with(
                &run.account,
                &key,
                &messages.interrupted_marker,
                Vec::new(),
                Some(event_id),
            ),
            "superseded" => vec![shaper.discard_for(&key, &messages.discarded_marker)],
            "failed" => {
                let text = if event["reason"].as_str() == Some("timeout") {
                    &messages.run_timeout
                } else {
                    &messages.run_failed
                };
                vec![shaper.run_notice_for(&key, "failure", text)]
            }
            // absorbed, cancelled: another run's answer, or none.
            _ => Vec::new(),
        }
    }

    /// A `run.finished` (from the stream, or a re-read run). Replies of a
    /// conversation leave in the order its runs finished at the runtime
    /// (event id order): when other runs of the conversation are still
    /// awaited, they are read first, and any that finished earlier (its
    /// event lost in a gap) is written first.
    async fn finished(&self, event: &Value) -> Result<(), String> {
        let Some(event_id) = event["event_id"].as_i64() else {
            return Err(format!("a run.finished without event_id: {event}"));
        };
        let run_id = event["run_id"].as_str().unwrap_or_default();
        let store = &self.deps.store;
        if let Some(run) = store
            .remote_get(&self.name, run_id)
            .await
            .map_err(|e| e.to_string())?
            .filter(|r| r.awaited)
        {
            let others = store
                .remote_awaited_of(&self.name, run.conversation_id)
                .await
                .map_err(|e| e.to_string())?;
            let mut earlier = Vec::new();
            // Only runs admitted before this one can have finished before
            // it unseen (in the common case, a queue, there are none).
            for other in others
                .iter()
                .filter(|o| o.run_id != run_id && o.created_at <= run.created_at)
            {
                let path = format!("/v1/runs/{}", urlencode(&other.run_id));
                if let Ok(mut read) = self.call(reqwest::Method::GET, &path, None).await
                    && read["event_id"].as_i64().is_some_and(|id| id < event_id)
                {
                    read["type"] = json!("run.finished");
                    earlier.push(read);
                }
            }
            earlier.sort_by_key(|e| e["event_id"].as_i64());
            for read in &earlier {
                self.write_finished(read).await?;
            }
        }
        self.write_finished(event).await
    }

    /// Write one finished run's replies (or only move the cursor).
    async fn write_finished(&self, event: &Value) -> Result<(), String> {
        let Some(event_id) = event["event_id"].as_i64() else {
            return Err(format!("a run.finished without event_id: {event}"));
        };
        let run_id = event["run_id"].as_str().unwrap_or_default();
        let store = &self.deps.store;
        let run = store
            .remote_get(&self.name, run_id)
            .await
            .map_err(|e| e.to_string())?;
        let Some(run) = run.filter(|r| r.awaited) else {
            // Not ours, or already written: only the cursor moves.
            return store
                .remote_advance(&self.name, event_id)
                .await
                .map_err(|e| e.to_string());
        };
        let now = self.deps.clock.now_ms();
        let route = (
            run.account.clone(),
            run.chat_id.clone(),
            run.thread_id.clone(),
        );
        let items: Vec<NewOutboxItem> = self
            .replies(&run, event, event_id)
            .into_iter()
            .map(|reply| NewOutboxItem {
                item_key: reply.item_key,
                conversation_id: run.conversation_id,
                account: route.0.clone(),
                chat_id: route.1.clone(),
                thread_id: route.2.clone(),
                surface: run.surface,
                reply_to: run.reply_to.clone(),
                run_id: Some(self.run_key(run_id)),
                kind: reply.kind,
                text: reply.text,
                group_key: reply.group_key,
                edits_key: reply.edits_key,
                attachments: reply.attachments,
                created_at: now,
            })
            .collect();
        let written = store
            .remote_finish(&self.name, run_id, event_id, &items, now)
            .await
            .map_err(|e| e.to_string())?;
        if written {
            let state = event["state"].as_str().unwrap_or("failed");
            let state = crate::store::RunState::parse(state)
                .map(|s| s.as_str())
                .unwrap_or("failed");
            self.deps
                .observer
                .run_finished(&self.run_key(run_id), state, run.conversation_id);
            self.deps.outbox_wake.notify_one();
        }
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(run_id);
        Ok(())
    }

    /// A transient delta: a streaming preview of an awaited run.
    async fn delta(&self, event: &Value) {
        let run_id = event["run_id"].as_str().unwrap_or_default().to_owned();
        let epoch = event["epoch"].as_u64().unwrap_or(1) as u32;
        let seq = event["seq"].as_u64().unwrap_or(0);
        let known = self
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&run_id)
            .cloned();
        let (route, conversation_id) = match known {
            Some((route, conversation, last_epoch, last_seq)) => {
                // Older than what was shown: ignore (deltas may repeat or
                // arrive late).
                if (epoch, seq) <= (last_epoch, last_seq) {
                    return;
                }
                (route, conversation)
            }
            None => match self.deps.store.remote_get(&self.name, &run_id).await {
                Ok(Some(run)) if run.awaited => (
                    Arc::new(Route {
                        account: run.account,
                        chat_id: run.chat_id,
                        thread_id: run.thread_id,
                        surface: run.surface,
                        reply_to: run.reply_to,
                    }),
                    run.conversation_id,
                ),
                _ => return,
            },
        };
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(run_id.clone(), (route.clone(), conversation_id, epoch, seq));
        let _ = self.deltas.send(RunDelta {
            run_id: self.run_key(&run_id),
            conversation_id,
            route,
            epoch,
            sequence: seq,
            delta: String::new(),
            text: event["text"].as_str().unwrap_or_default().to_owned(),
        });
    }

    /// After a (re)connect: read every awaited run, and take the terminal
    /// ones as if their `run.finished` had arrived.
    async fn reread_awaited(&self) -> Result<(), String> {
        let mut after = None;
        loop {
            let page = self
                .deps
                .store
                .remote_awaited(&self.name, after.clone(), 200)
                .await
                .map_err(|e| e.to_string())?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = Some((last.created_at, last.run_id.clone()));
            for run in &page {
                let path = format!("/v1/runs/{}", urlencode(&run.run_id));
                match self.call(reqwest::Method::GET, &path, None).await {
                    Ok(mut read) if read["event_id"].is_i64() => {
                        read["type"] = json!("run.finished");
                        self.finished(&read).await?;
                    }
                    Ok(_) => {}
                    Err(CallError::Status(404, _, _)) => {
                        tracing::warn!(runtime = %self.name, run = %run.run_id, "the runtime does not know a run it admitted; its answer will not come");
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            if page.len() < 200 {
                return Ok(());
            }
        }
    }

    fn set_down(&self, why: String) {
        self.connected.store(false, Ordering::SeqCst);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }

    /// One connection of the event stream, until it ends.
    async fn stream_once(&self) -> Result<(), String> {
        let cursor = self
            .deps
            .store
            .remote_cursor(&self.name)
            .await
            .map_err(|e| e.to_string())?;
        let mut request = self
            .stream_client
            .get(format!("{}/v1/events?after={cursor}", self.base));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let mut response = request
            .send()
            .await
            .map_err(|e| format!("GET /v1/events: {e}"))?;
        if !response.status().is_success() {
            return Err(format!(
                "GET /v1/events answered HTTP {}",
                response.status()
            ));
        }
        self.connected.store(true, Ordering::SeqCst);
        tracing::info!(runtime = %self.name, after = cursor, "event stream connected");
        self.reread_awaited().await?;
        let mut buffer: Vec<u8> = Vec::new();
        loop {
            let chunk = tokio::select! {
                _ = self.stop.cancelled() => return Ok(()),
                chunk = tokio::time::timeout(STREAM_IDLE, response.chunk()) => chunk,
            };
            let chunk = match chunk {
                Err(_) => {
                    return Err(format!(
                        "no event or heartbeat for {}s",
                        STREAM_IDLE.as_secs()
                    ));
                }
                Ok(Err(e)) => return Err(format!("the event stream broke: {e}")),
                Ok(Ok(None)) => return Err("the runtime ended the event stream".into()),
                Ok(Ok(Some(chunk))) => chunk,
            };
            buffer.extend_from_slice(&chunk);
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                let Ok(event) = serde_json::from_str::<Value>(line) else {
                    tracing::warn!(runtime = %self.name, line = %line.chars().take(200).collect::<String>(), "an event line is not JSON; ignored");
                    continue;
                };
                match event["type"].as_str() {
                    Some("run.finished") => self.finished(&event).await?,
                    Some("run.delta") => self.delta(&event).await,
                    // Other durable events only move the cursor.
                    _ => {
                        if let Some(id) = event["event_id"].as_i64() {
                            self.deps
                                .store
                                .remote_advance(&self.name, id)
                                .await
                                .map_err(|e| e.to_string())?;
                        }
                    }
                }
            }
        }
    }

    async fn consume(self: Arc<Self>) {
        let mut failures = 0u32;
        while !self.stop.is_cancelled() {
            match self.stream_once().await {
                Ok(()) => return,
                Err(why) => {
                    // A connection that worked for a while starts over.
                    if self.connected.load(Ordering::SeqCst) {
                        failures = 0;
                    }
                    failures = failures.saturating_add(1);
                    if failures == 1 || failures.is_multiple_of(10) {
                        tracing::warn!(runtime = %self.name, error = %why, "runtime event stream down; reconnecting");
                    }
                    self.set_down(why);
                }
            }
            let wait =
                Duration::from_millis(200u64 << failures.min(7)).min(Duration::from_secs(30));
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn submission_json(s: &Submission) -> Value {
    json!({
        "idempotency_key": s.idempotency_key,
        "conversation_id": s.conversation_id.to_string(),
        "input": {
            "text": s.input.text,
            "attachments": s.input.attachments,
            "sender": {"id": s.input.sender_id, "name": s.input.sender_name},
        },
        "context": {
            "surface": s.surface.as_str(),
            "account": s.account,
            "chat_id": s.chat_id,
            "thread_id": s.thread_id,
            "principal": s.input.sender_id,
        },
        "input_policy": s.policy.as_str(),
        "coalesce_pending": s.coalesce_pending,
        "max_queued_inputs": s.max_queued_inputs,
        "soft_interrupt": s.soft_interrupt,
    })
}

#[async_trait]
impl Runtime for RemoteRuntime {
    fn name(&self) -> &str {
        &self.inner.name
    }

    async fn submit(&self, batch: Vec<Submission>) -> Vec<Result<Admission, SubmitError>> {
        let inner = &self.inner;
        let body = json!({"submissions": batch.iter().map(submission_json).collect::<Vec<_>>()});
        let answer = match inner
            .call(reqwest::Method::POST, "/v1/submissions", Some(&body))
            .await
        {
            Ok(answer) => answer,
            Err(e) => {
                let why = e.to_string();
                return batch
                    .iter()
                    .map(|_| Err(SubmitError::Unavailable(why.clone())))
                    .collect();
            }
        };
        let admissions = answer["admissions"].as_array().cloned().unwrap_or_default();
        let now = inner.deps.clock.now_ms();
        let mut results = Vec::with_capacity(batch.len());
        let mut awaited = Vec::new();
        let mut blocked = std::collections::HashSet::new();
        for (i, submission) in batch.iter().enumerate() {
            let admission = admissions.get(i).cloned().unwrap_or(Value::Null);
            if blocked.contains(&submission.conversation_id) {
                results.push(Err(SubmitError::Unavailable(
                    "an earlier input of this conversation was not admitted".into(),
                )));
                continue;
            }
            if let Some(run_id) = admission["run_id"].as_str() {
                awaited.push(RemoteRun {
                    runtime: inner.name.clone(),
                    run_id: run_id.to_owned(),
                    conversation_id: submission.conversation_id,
                    account: submission.account.clone(),
                    chat_id: submission.chat_id.clone(),
                    thread_id: submission.thread_id.clone(),
                    surface: submission.surface,
                    reply_to: submission.reply_to.clone(),
                    end_notice: None,
                    awaited: true,
                    event_id: None,
                    created_at: now,
                });
                results.push(Ok(Admission {
                    run_id: inner.run_key(run_id),
                    new: admission["new"].as_bool().unwrap_or(true),
                }));
                continue;
            }
            let code = admission["error"]["code"].as_str().unwrap_or("unavailable");
            let message = admission["error"]["message"]
                .as_str()
                .unwrap_or("no admission for this submission")
                .to_owned();
            results.push(Err(match code {
                "queue_full" => SubmitError::Refused(message),
                "rejected" => SubmitError::Rejected(message),
                _ => {
                    blocked.insert(submission.conversation_id);
                    SubmitError::Unavailable(message)
                }
            }));
        }
        // Admitted runs are awaited before the journal hears of them: a
        // journal row marked admitted always has its run recorded.
        if let Err(e) = inner.deps.store.remote_await(&awaited).await {
            let why = format!("recording admitted runs: {e}");
            return batch
                .iter()
                .map(|_| Err(SubmitError::Unavailable(why.clone())))
                .collect();
        }
        results
    }

    async fn stop(&self, stop: Stop) -> Result<StopReport, SubmitError> {
        let inner = &self.inner;
        let path = format!("/v1/conversations/{}/stop", stop.conversation_id);
        let answer = inner
            .call(
                reqwest::Method::POST,
                &path,
                Some(&json!({"reason": stop.reason})),
            )
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))?;
        let interrupted = answer["interrupted"].as_str().map(str::to_owned);
        if let Some(notice) = &stop.notice {
            inner
                .deps
                .store
                .remote_stop_notice(&inner.name, interrupted.as_deref(), notice)
                .await
                .map_err(|e| SubmitError::Unavailable(e.to_string()))?;
            inner.deps.outbox_wake.notify_one();
        }
        Ok(StopReport {
            interrupted: interrupted.map(|id| inner.run_key(&id)),
            cancelled: answer["cancelled"].as_u64().unwrap_or(0) as usize,
        })
    }

    fn deltas(&self) -> broadcast::Receiver<RunDelta> {
        self.inner.deltas.subscribe()
    }

    /// Start following the event stream (once).
    async fn recover(&self) -> Result<usize, String> {
        if !self.inner.started.swap(true, Ordering::SeqCst) {
            tokio::spawn(self.inner.clone().consume());
        }
        Ok(0)
    }

    async fn close(&self, _grace: Duration, _force: Duration) -> CloseReport {
        // Runs belong to the runtime; what is still awaited is re-read at
        // the next start.
        self.inner.stop.cancel();
        CloseReport {
            settled: true,
            remaining: 0,
        }
    }

    async fn health(&self) -> Result<(), String> {
        if self.inner.connected.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(self
                .inner
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone())
        }
    }
}
