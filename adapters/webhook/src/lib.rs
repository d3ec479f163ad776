//! The generic HTTP channel: the public API for any program that wants to
//! talk to a Switchboard bot over plain HTTP, and the local/demo channel.
//!
//! - Inbound: `POST /v1/channels/{account}/updates` with a JSON update; the
//!   answer is `202` only after the core has journaled it ([`ingress`]).
//! - Outbound: replies are POSTed as JSON to the account's `callback_url`; a
//!   2xx is the receipt, and receivers deduplicate on `reply_key`
//!   ([`sender`]).
//!
//! The wire format is documented in `docs/webhook-channel.md`.

pub mod ingress;
pub mod sender;

pub use ingress::{IngressAccount, router};
pub use sender::{CallbackBody, WebhookSender};

/// The store identity of a webhook channel account.
pub fn identity(account_name: &str) -> String {
    format!("webhook:{account_name}")
}
