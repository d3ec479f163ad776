//! Switchboard: a channel-bridge daemon.
//!
//! Updates come in from chat platforms through `adapters/*`, are journaled
//! and deduplicated ([`ingress`]), handed to an agent runtime by the
//! [`submitter`] ([`runtime`]), and the runtime's replies leave through the
//! durable [`outbox`]. Everything durable lives in the [`store`]; [`daemon`]
//! wires the parts together and stops them in order.
//!
//! ```text
//! adapter ──Envelope──► ingress ──► journal (store) ──► submitter ──► runtime
//!                                                                      │
//! adapter ◄──OutboundMessage── dispatcher ◄── outbox (store) ◄─────────┘
//! ```
//!
//! Architecture invariants (each has a test):
//! - An update is acknowledged to its platform only after its journal row is
//!   committed ([`ingress::Ingress`] returns after the commit).
//! - One update yields at most one run: the submission idempotency key is a
//!   function of the inbound key ([`keys`]), and runtimes admit by that key.
//! - A reply item is marked `possibly_dispatched` durably before its send,
//!   and every later state write is fenced by the claim's token
//!   ([`outbox`]).
//! - Items of one conversation leave in ordinal order: only a lane's head is
//!   ever claimable.
//! - The core does not depend on any platform SDK: only `adapters/*` do.

pub mod access;
pub mod admin;
pub mod backoff;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod doctor;
pub mod ingress;
pub mod keys;
pub mod lanes;
pub mod observe;
pub mod outbox;
pub mod retention;
pub mod runtime;
pub mod schedule;
pub mod serve;
pub mod store;
pub mod submitter;
pub mod surface;
pub mod systemd;
