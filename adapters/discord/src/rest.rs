//! Discord's REST API, called with our own HTTP client.
//!
//! serenity's `Http` (with its ratelimiter disabled, as it must be to reach
//! a proxy) turns a 429 into an error without `Retry-After` or the
//! `X-RateLimit-*` headers. The outbox needs both, so sends, edits, typing
//! and history go through this client, which keeps them: a bucket that said
//! `X-RateLimit-Remaining: 0` is not called again before its reset, and a
//! 429 becomes `RetryAfter` for the channel, or for the whole account when
//! Discord says the limit is global.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use switchboard_channel::{DeliveryError, RateScope};
use tokio::time::Instant;

/// Why a REST call gave no result.
#[derive(Debug, Clone, PartialEq)]
pub enum RestError {
    /// Rate limited: by a 429, or because the bucket is known to be empty.
    Wait { after: Duration, global: bool },
    /// Discord answered with an error.
    Status {
        status: u16,
        code: Option<i64>,
        message: String,
    },
    /// The request never reached Discord.
    NotSent(String),
    /// The request may have reached Discord (timeout, dropped connection).
    Unknown(String),
}

impl std::fmt::Display for RestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestError::Wait { after, global } => {
                write!(
                    f,
                    "rate limited for {after:?}{}",
                    if *global { " (global)" } else { "" }
                )
            }
            RestError::Status {
                status,
                code,
                message,
            } => match code {
                Some(code) => write!(f, "{status} {message} (code {code})"),
                None => write!(f, "{status} {message}"),
            },
            RestError::NotSent(e) | RestError::Unknown(e) => f.write_str(e),
        }
    }
}

impl RestError {
    /// The outbox's view (DESIGN.md §4). Discord bans bots that keep sending
    /// invalid requests, so no 4xx other than 429 is ever retried.
    pub fn into_delivery(self) -> DeliveryError {
        match self {
            RestError::Wait { after, global } => DeliveryError::RetryAfter {
                after,
                scope: if global {
                    RateScope::Account
                } else {
                    RateScope::Chat
                },
            },
            // The token was revoked: wait for it to be fixed (the gateway
            // side reports the account down) rather than fail every reply.
            RestError::Status { status: 401, .. } => DeliveryError::RetryAfter {
                after: Duration::from_secs(60),
                scope: RateScope::Account,
            },
            // Discord's 5xx: a create carries its nonce, so the retry cannot
            // duplicate within the nonce window.
            e @ RestError::Status { status: 500.., .. } => DeliveryError::NotSent(e.to_string()),
            e @ RestError::Status { .. } => DeliveryError::Permanent(e.to_string()),
            RestError::NotSent(e) => DeliveryError::NotSent(e),
            RestError::Unknown(e) => DeliveryError::Ambiguous(e),
        }
    }
}

pub struct Rest {
    http: reqwest::Client,
    /// `https://discord.com/api/v10`.
    base: String,
    authorization: String,
    /// Buckets known to be empty, by major parameter (the channel), until
    /// their reset.
    empty_until: Mutex<HashMap<String, Instant>>,
    global_until: Mutex<Option<Instant>>,
}

impl Rest {
    pub fn new(api_url: &str, token: &str, timeout: Duration) -> Result<Rest, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(timeout)
            .user_agent(concat!(
                "DiscordBot (https://github.com/switchboard, ",
                env!("CARGO_PKG_VERSION"),
                ")"
            ))
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(Rest {
            http,
            base: format!("{}/api/v10", api_url.trim_end_matches('/')),
            authorization: format!("Bot {token}"),
            empty_until: Mutex::new(HashMap::new()),
            global_until: Mutex::new(None),
        })
    }

    fn wait_for(&self, bucket: Option<&str>) -> Option<RestError> {
        let now = Instant::now();
        if let Some(until) = *self.global_until.lock().unwrap_or_else(|p| p.into_inner())
            && until > now
        {
            return Some(RestError::Wait {
                after: until - now,
                global: true,
            });
        }
        let bucket = bucket?;
        let buckets = self.empty_until.lock().unwrap_or_else(|p| p.into_inner());
        match buckets.get(bucket) {
            Some(until) if *until > now => Some(RestError::Wait {
                after: *until - now,
                global: false,
            }),
            _ => None,
        }
    }

    /// One call. `bucket` names the rate-limit bucket the call draws from
    /// (its major parameter); `None` for calls that need no bookkeeping.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        bucket: Option<&str>,
    ) -> Result<Value, RestError> {
        if let Some(wait) = self.wait_for(bucket) {
            return Err(wait);
        }
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header(reqwest::header::AUTHORIZATION, &self.authorization);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(classify)?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        if let Some(bucket) = bucket
            && header("x-ratelimit-remaining").as_deref() == Some("0")
            && let Some(reset) =
                header("x-ratelimit-reset-after").and_then(|s| s.parse::<f64>().ok())
        {
            self.empty_until
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    bucket.to_owned(),
                    Instant::now() + Duration::from_secs_f64(reset),
                );
        }
        let text = response.text().await.map_err(|e| {
            // The status line arrived: whatever it said happened.
            RestError::Unknown(format!("reading Discord's answer: {e}"))
        })?;
        let json: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::Null)
        };
        if (200..300).contains(&status) {
            return Ok(json);
        }
        if status == 429 {
            let after = header("retry-after")
                .and_then(|s| s.parse::<f64>().ok())
                .or_else(|| json["retry_after"].as_f64())
                .unwrap_or(1.0);
            let after = Duration::from_secs_f64(after.max(0.0));
            let global = header("x-ratelimit-global").as_deref() == Some("true")
                || json["global"].as_bool() == Some(true);
            if global {
                *self.global_until.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(Instant::now() + after);
            } else if let Some(bucket) = bucket {
                self.empty_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(bucket.to_owned(), Instant::now() + after);
            }
            return Err(RestError::Wait { after, global });
        }
        Err(RestError::Status {
            status,
            code: json["code"].as_i64(),
            message: json["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| text.chars().take(120).collect()),
        })
    }

    /// A plain GET of a URL (an attachment on Discord's CDN), refusing more
    /// than `max_bytes`.
    pub async fn download(
        &self,
        url: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>, switchboard_channel::FetchError> {
        use switchboard_channel::FetchError;
        let mut response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| FetchError::Failed(e.to_string()))?;
        match response.status().as_u16() {
            200..300 => {}
            404 => return Err(FetchError::NotFound(url.to_owned())),
            status => return Err(FetchError::Failed(format!("HTTP {status}"))),
        }
        if let Some(size) = response.content_length()
            && size > max_bytes
        {
            return Err(FetchError::TooLarge {
                size,
                limit: max_bytes,
            });
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| FetchError::Failed(e.to_string()))?
        {
            bytes.extend_from_slice(&chunk);
            if bytes.len() as u64 > max_bytes {
                return Err(FetchError::TooLarge {
                    size: bytes.len() as u64,
                    limit: max_bytes,
                });
            }
        }
        Ok(bytes)
    }
}

fn classify(e: reqwest::Error) -> RestError {
    if e.is_connect() || e.is_builder() {
        RestError::NotSent(e.to_string())
    } else {
        RestError::Unknown(e.to_string())
    }
}
