//! Model backends of the built-in runtime: `echo`, `openai` (any
//! OpenAI-compatible streaming chat-completions server) and `command` (a
//! local program).
//!
//! A backend streams its answer into a [`DeltaSink`] and returns the final
//! text. Dropping the future cancels the call: the runtime does that on
//! interrupt, on soft interrupt and on shutdown, and reads what was said so
//! far from the sink.

pub mod command;
pub mod echo;
pub mod openai;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::config::ModelConfig;
use crate::runtime::RunDelta;
use crate::surface::SurfaceKind;

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

/// One message of a prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
        }
    }
}

/// What a model call gets: the prompt, ending with the user turn to answer.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub run_id: i64,
    pub conversation_id: i64,
    pub surface: SurfaceKind,
    pub messages: Vec<ChatMessage>,
}

impl ModelRequest {
    /// The text of the last user message (the input being answered).
    pub fn last_user_text(&self) -> &str {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .map_or("", |m| m.content.as_str())
    }
}

/// Why a model call produced no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The backend failed (an error answer, a crash, a bad exit status).
    #[error("{0}")]
    Failed(String),
    /// The backend did not answer in time.
    #[error("timed out: {0}")]
    Timeout(String),
}

/// A model backend.
#[async_trait]
pub trait Model: Send + Sync {
    /// Stream the answer into `sink`, return the final text.
    async fn generate(
        &self,
        request: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<String, ModelError>;
}

/// Build the backend a `model = { backend = ... }` section describes.
pub fn build(config: &ModelConfig) -> Result<Box<dyn Model>, String> {
    Ok(match config {
        ModelConfig::Echo(c) => Box::new(echo::Echo::new(c)),
        ModelConfig::Openai(c) => Box::new(openai::OpenAi::new(c)?),
        ModelConfig::Command(c) => Box::new(command::CommandModel::new(c)),
    })
}

/// Where a model call streams its answer: it keeps the text so far (so an
/// interrupted run keeps its partial answer) and publishes transient
/// deltas.
pub struct DeltaSink {
    run_id: String,
    conversation_id: i64,
    route: std::sync::Arc<crate::runtime::Route>,
    /// What earlier steps of the same run said, before this call's text.
    prefix: String,
    epoch: AtomicU32,
    sequence: AtomicU64,
    text: Mutex<String>,
    events: broadcast::Sender<RunDelta>,
}

impl DeltaSink {
    pub fn new(
        run_id: i64,
        conversation_id: i64,
        route: std::sync::Arc<crate::runtime::Route>,
        epoch: u32,
        prefix: String,
        events: broadcast::Sender<RunDelta>,
    ) -> Self {
        DeltaSink {
            run_id: run_id.to_string(),
            conversation_id,
            route,
            prefix,
            epoch: AtomicU32::new(epoch),
            sequence: AtomicU64::new(0),
            text: Mutex::new(String::new()),
            events,
        }
    }

    /// A sink that publishes nowhere (tests).
    pub fn detached() -> Self {
        let route = crate::runtime::Route {
            account: String::new(),
            chat_id: String::new(),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
        };
        DeltaSink::new(
            0,
            0,
            std::sync::Arc::new(route),
            1,
            String::new(),
            broadcast::channel(1).0,
        )
    }

    /// Append a piece of the answer.
    pub fn push(&self, delta: &str) {
        if delta.is_empty() {
            return;
        }
        let text = {
            let mut text = self.text.lock().unwrap_or_else(|p| p.into_inner());
            text.push_str(delta);
            format!("{}{}", self.prefix, text)
        };
        let sequence = self.sequence.fetch_add(1, Ordering::SeqCst) + 1;
        let _ = self.events.send(RunDelta {
            run_id: self.run_id.clone(),
            conversation_id: self.conversation_id,
            route: self.route.clone(),
            epoch: self.epoch.load(Ordering::SeqCst),
            sequence,
            delta: delta.to_owned(),
            text,
        });
    }

    /// The call starts its answer over (a retry): what it said so far is
    /// dropped and a new epoch begins.
    pub fn restart(&self) {
        self.text.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.sequence.store(0, Ordering::SeqCst);
    }

    /// This call's text so far.
    pub fn text(&self) -> String {
        self.text.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn route(&self) -> std::sync::Arc<crate::runtime::Route> {
        self.route.clone()
    }

    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }
}
