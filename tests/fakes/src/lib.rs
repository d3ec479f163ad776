//! Loopback fakes of the platforms Switchboard talks to, speaking their real
//! wire formats, for tests: the Telegram Bot API ([`telegram`]), Discord's
//! REST API and gateway ([`discord`]), and an agent runtime speaking
//! docs/runtime-protocol.md with faults on demand ([`runtime`]). Each fake runs on 127.0.0.1 with a
//! free port, records what it was sent, and misbehaves on request.

pub mod discord;
pub mod runtime;
pub mod telegram;
