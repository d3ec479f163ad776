//! The outbox: reply items leave through their channel adapters with
//! explicit dispatch states (DESIGN.md §4).
//!
//! - [`dispatcher`] claims lane heads (committing `possibly_dispatched`
//!   before the platform call), sends them, and group-commits the outcomes.
//! - [`reconcile`] resolves `possibly_dispatched` items whose lease ran out
//!   by their surface's `on_ambiguous_send`.
//!
//! Architecture invariant: no message is created that was not first durably
//! marked `possibly_dispatched`, and every state write after a claim carries
//! the claim's fencing token.

pub mod dispatcher;
pub mod reconcile;

pub use crate::backoff::backoff;
