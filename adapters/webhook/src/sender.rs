//! Replies go out as JSON POSTs to the account's callback URL.
//!
//! A 2xx is the receipt. Receivers deduplicate on `reply_key`, which makes a
//! resend after an ambiguous outcome safe, so this adapter declares the
//! `idempotent_send` capability.
//!
//! With a signing secret, every POST carries `X-Switchboard-Timestamp`
//! (Unix seconds) and `X-Switchboard-Signature: v1=<hex HMAC-SHA256 of
//! "<timestamp>.<body>">`, so a receiver can reject forgeries (wrong
//! signature) and replays (old timestamp).

use std::time::Duration;

use async_trait::async_trait;
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use switchboard_channel::{
    AttachmentRef, Capabilities, ChannelAdapter, DeliveryError, LengthUnit, Limits,
    OutboundMessage, Platform, RateScope, Receipt, SendAction,
};

/// The header with the signature's time stamp (Unix seconds).
pub const TIMESTAMP_HEADER: &str = "x-switchboard-timestamp";
/// The header with the signature: `v1=<hex HMAC-SHA256>`.
pub const SIGNATURE_HEADER: &str = "x-switchboard-signature";

/// `v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub fn signature(secret: &str, timestamp: u64, body: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("v1={hex}")
}

/// The JSON body POSTed to the callback URL for every reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallbackBody {
    /// Stable identity of this reply; the same on every resend.
    pub reply_key: String,
    pub conversation_id: i64,
    pub chat_id: String,
    pub thread_id: Option<String>,
    /// Position of this reply in its conversation (1, 2, 3, ...).
    pub ordinal: i64,
    pub run_id: Option<String>,
    pub text: String,
    /// Present when this body replaces the text of an earlier reply (a
    /// streaming preview): the `reply_key` of the message to update. Such
    /// bodies come in order and may repeat; apply the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edits: Option<String>,
    /// Files the runtime attached (URLs or platform file ids), never bytes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentRef>,
}

/// The outbound side of one webhook channel account.
pub struct WebhookSender {
    identity: String,
    callback_url: reqwest::Url,
    client: reqwest::Client,
    max_reply_chars: usize,
    signing_secret: Option<String>,
}

impl WebhookSender {
    /// `timeout` bounds one POST; a timeout after the request left is an
    /// ambiguous outcome.
    pub fn new(
        identity: String,
        callback_url: reqwest::Url,
        timeout: Duration,
        max_reply_chars: usize,
    ) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .timeout(timeout)
            .pool_max_idle_per_host(64)
            .build()?;
        Ok(WebhookSender {
            identity,
            callback_url,
            client,
            max_reply_chars,
            signing_secret: None,
        })
    }

    /// Sign every callback with this secret.
    pub fn signed(mut self, secret: Option<String>) -> Self {
        self.signing_secret = secret;
        self
    }
}

/// How long to wait when a receiver says 429 without a usable Retry-After.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

fn retry_after(headers: &reqwest::header::HeaderMap) -> Duration {
    headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(3600.0)))
        .unwrap_or(DEFAULT_RETRY_AFTER)
}

/// Map a finished HTTP exchange to a receipt or a delivery error.
fn classify(
    status: StatusCode,
    headers: &reqwest::header::HeaderMap,
    reply_key: &str,
) -> Result<Receipt, DeliveryError> {
    if status.is_success() {
        return Ok(Receipt {
            message_ids: vec![reply_key.to_owned()],
        });
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        return Err(DeliveryError::RetryAfter {
            after: retry_after(headers),
            scope: RateScope::Account,
        });
    }
    // A 5xx or 408 means the receiver did not take the reply. Receivers
    // deduplicate on reply_key, so trying again later is always safe.
    if status.is_server_error() || status == StatusCode::REQUEST_TIMEOUT {
        return Err(DeliveryError::NotSent(format!(
            "callback answered {status}"
        )));
    }
    Err(DeliveryError::Permanent(format!(
        "callback answered {status}"
    )))
}

#[async_trait]
impl ChannelAdapter for WebhookSender {
    fn identity(&self) -> &str {
        &self.identity
    }

    fn platform(&self) -> Platform {
        Platform::Webhook
    }

    fn limits(&self) -> Limits {
        Limits {
            // Not a platform rule: what the account's receiver takes
            // (`max_reply_chars`); longer answers become several replies.
            max_text_len: self.max_reply_chars,
            length_unit: LengthUnit::Chars,
            per_chat: None,
            per_group: None,
            per_account: None,
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            idempotent_send: true,
            // On a streaming surface the receiver must apply `edits` bodies:
            // the final answer then arrives as the last edit of the preview.
            // (The webhook surface is terminal-only by default.)
            edit: true,
            typing: false,
            drafts: false,
        }
    }

    async fn send(&self, message: &OutboundMessage) -> Result<Receipt, DeliveryError> {
        let body = CallbackBody {
            reply_key: message.item_key.clone(),
            conversation_id: message.meta.conversation_id,
            chat_id: message.chat_id.clone(),
            thread_id: message.thread_id.clone(),
            ordinal: message.meta.ordinal,
            run_id: message.meta.run_id.clone(),
            text: message.text.clone(),
            edits: match &message.action {
                SendAction::Create => None,
                SendAction::Edit { message_id } => Some(message_id.clone()),
            },
            attachments: message.attachments.clone(),
        };
        let bytes = serde_json::to_vec(&body)
            .map_err(|e| DeliveryError::Permanent(format!("the reply cannot be encoded: {e}")))?;
        let mut request = self
            .client
            .post(self.callback_url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json");
        if let Some(secret) = &self.signing_secret {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            request = request
                .header(TIMESTAMP_HEADER, now.to_string())
                .header(SIGNATURE_HEADER, signature(secret, now, &bytes));
        }
        let result = request.body(bytes).send().await;
        match result {
            // The message a receipt names: the one created, or the one edited.
            Ok(response) => classify(
                response.status(),
                response.headers(),
                body.edits.as_deref().unwrap_or(&body.reply_key),
            ),
            // Refused or unreachable before anything was written: certainly
            // not delivered.
            Err(e) if e.is_connect() => Err(DeliveryError::NotSent(format!(
                "could not connect to the callback URL: {e}"
            ))),
            Err(e) if e.is_builder() => Err(DeliveryError::Permanent(format!(
                "could not build the callback request: {e}"
            ))),
            // A timeout or a broken connection after the request left: the
            // receiver may have it.
            Err(e) => Err(DeliveryError::Ambiguous(format!(
                "callback request did not complete: {e}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

    #[test]
    fn signatures_match_a_known_vector() {
        // python3 -c "import hmac,hashlib;print(hmac.new(b'key',b'1700000000.{}',hashlib.sha256).hexdigest())"
        assert_eq!(
            signature("key", 1_700_000_000, b"{}"),
            "v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
    }

    #[test]
    fn status_codes_map_to_delivery_kinds() {
        let none = HeaderMap::new();
        assert!(classify(StatusCode::OK, &none, "k").is_ok());
        assert!(classify(StatusCode::NO_CONTENT, &none, "k").is_ok());
        assert!(matches!(
            classify(StatusCode::SERVICE_UNAVAILABLE, &none, "k"),
            Err(DeliveryError::NotSent(_))
        ));
        assert!(matches!(
            classify(StatusCode::GONE, &none, "k"),
            Err(DeliveryError::Permanent(_))
        ));
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(
            classify(StatusCode::TOO_MANY_REQUESTS, &h, "k"),
            Err(DeliveryError::RetryAfter {
                after: Duration::from_secs(3),
                scope: RateScope::Account
            })
        );
    }
}
