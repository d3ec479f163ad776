//! Any OpenAI-compatible chat-completions server with streaming: OpenAI,
//! Ollama, llama.cpp, vLLM, OpenRouter.
//!
//! `POST {base_url}/chat/completions` with `stream: true`; the answer comes
//! back as server-sent events, each `data: {...}` carrying
//! `choices[0].delta.content`, ending with `data: [DONE]`. A 429, a 5xx, a
//! broken or stalled stream, or an error object inside the stream is retried
//! with backoff (a `Retry-After` header wins) up to `max_retries`; a retry
//! starts the answer over (a new epoch of deltas). Other 4xx answers fail
//! the run at once. Dropping the call closes the connection.

use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{DeltaSink, Model, ModelError, ModelRequest};
use crate::backoff::backoff;
use crate::config::OpenAiConfig;

pub struct OpenAi {
    client: reqwest::Client,
    url: reqwest::Url,
    model: String,
    api_key: Option<String>,
    request_timeout: Duration,
    idle_timeout: Duration,
    max_retries: u32,
    retry_base: Duration,
    temperature: Option<f64>,
    max_tokens: Option<u32>,
}

/// How one attempt ended, when it did not produce an answer.
enum AttemptError {
    /// Worth another try (`after` from Retry-After when given).
    Retry {
        reason: String,
        after: Option<Duration>,
        timeout: bool,
    },
    /// Not worth another try.
    Fatal(String),
}

impl OpenAi {
    pub fn new(config: &OpenAiConfig) -> Result<Self, String> {
        let base = config.base_url.trim_end_matches('/');
        let url = reqwest::Url::parse(&format!("{base}/chat/completions"))
            .map_err(|e| format!("model.base_url {:?}: {e}", config.base_url))?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(config.request_timeout_secs.min(10)))
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(OpenAi {
            client,
            url,
            model: config.model.clone(),
            api_key: config.resolve_api_key()?,
            request_timeout: Duration::from_secs(config.request_timeout_secs),
            idle_timeout: Duration::from_secs(config.idle_timeout_secs),
            max_retries: config.max_retries,
            retry_base: Duration::from_millis(config.retry_base_ms),
            temperature: config.temperature,
            max_tokens: config.max_tokens,
        })
    }

    fn body(&self, request: &ModelRequest) -> Value {
        let mut body = json!({
            "model": self.model,
            "messages": request.messages,
            "stream": true,
        });
        if let Some(t) = self.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(m) = self.max_tokens {
            body["max_tokens"] = json!(m);
        }
        body
    }

    async fn attempt(
        &self,
        request: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<String, AttemptError> {
        let mut call = self.client.post(self.url.clone()).json(&self.body(request));
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let response = match tokio::time::timeout(self.request_timeout, call.send()).await {
            Err(_) => {
                return Err(AttemptError::Retry {
                    reason: format!("no response within {}s", self.request_timeout.as_secs()),
                    after: None,
                    timeout: true,
                });
            }
            Ok(Err(e)) => {
                return Err(AttemptError::Retry {
                    reason: format!("request to {} failed: {e}", self.url),
                    after: None,
                    timeout: false,
                });
            }
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| Duration::from_secs_f64(s.min(300.0)));
            let body = response.text().await.unwrap_or_default();
            let reason = format!("model server answered {status}: {}", error_message(&body));
            return if status.as_u16() == 429 || status.is_server_error() {
                Err(AttemptError::Retry {
                    reason,
                    after,
                    timeout: false,
                })
            } else {
                Err(AttemptError::Fatal(reason))
            };
        }
        let mut events = response.bytes_stream().eventsource();
        let mut text = String::new();
        let mut finished = false;
        loop {
            let next = match tokio::time::timeout(self.idle_timeout, events.next()).await {
                Err(_) => {
                    return Err(AttemptError::Retry {
                        reason: format!("the stream stalled for {}s", self.idle_timeout.as_secs()),
                        after: None,
                        timeout: true,
                    });
                }
                Ok(next) => next,
            };
            let event = match next {
                None => break,
                Some(Err(e)) => {
                    return Err(AttemptError::Retry {
                        reason: format!("the stream broke: {e}"),
                        after: None,
                        timeout: false,
                    });
                }
                Some(Ok(event)) => event,
            };
            let data = event.data.trim();
            if data == "[DONE]" {
                return Ok(text);
            }
            if data.is_empty() {
                continue;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|e| AttemptError::Retry {
                reason: format!("unreadable stream event ({e}): {}", excerpt(data)),
                after: None,
                timeout: false,
            })?;
            if chunk.get("error").is_some() {
                return Err(AttemptError::Retry {
                    reason: format!("the stream reported an error: {}", error_message(data)),
                    after: None,
                    timeout: false,
                });
            }
            let choice = &chunk["choices"][0];
            if let Some(piece) = choice["delta"]["content"].as_str() {
                text.push_str(piece);
                sink.push(piece);
            }
            if choice["finish_reason"].is_string() {
                finished = true;
            }
        }
        if finished {
            Ok(text)
        } else {
            Err(AttemptError::Retry {
                reason: "the stream ended before the answer was finished".into(),
                after: None,
                timeout: false,
            })
        }
    }
}

#[async_trait]
impl Model for OpenAi {
    async fn generate(
        &self,
        request: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<String, ModelError> {
        let mut retries = 0;
        loop {
            match self.attempt(request, sink).await {
                Ok(text) => return Ok(text),
                Err(AttemptError::Fatal(reason)) => return Err(ModelError::Failed(reason)),
                Err(AttemptError::Retry {
                    reason,
                    after,
                    timeout,
                }) => {
                    if retries >= self.max_retries {
                        let reason = format!("{reason} (gave up after {retries} retries)");
                        return Err(if timeout {
                            ModelError::Timeout(reason)
                        } else {
                            ModelError::Failed(reason)
                        });
                    }
                    retries += 1;
                    let delay = after.unwrap_or_else(|| {
                        backoff(retries, self.retry_base, Duration::from_secs(30))
                    });
                    tracing::info!(run_id = request.run_id, retry = retries, delay_ms = delay.as_millis() as u64, %reason, "model call failed; retrying");
                    tokio::time::sleep(delay).await;
                    sink.restart();
                }
            }
        }
    }
}

/// The `error.message` of an OpenAI-style error body, or an excerpt of it.
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| excerpt(body))
}

fn excerpt(text: &str) -> String {
    let t: String = text.chars().take(200).collect();
    if t.len() < text.len() {
        format!("{t}…")
    } else {
        t
    }
}
