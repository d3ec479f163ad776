//! Loopback fakes of the platforms Switchboard talks to, speaking their real
//! wire formats, for tests: the Telegram Bot API ([`telegram`]) and Discord's
//! REST API and gateway ([`discord`]). Each fake runs on 127.0.0.1 with a
//! free port, records what it was sent, and misbehaves on request.

pub mod discord;
pub mod telegram;
