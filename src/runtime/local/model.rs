//! Model backends of the built-in runtime.

use std::time::Duration;

use async_trait::async_trait;

use crate::config::{EchoConfig, ModelConfig};

/// What a model call gets.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// The input this run answers.
    pub input: String,
}

/// Why a model call produced no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Failed(String),
}

/// A model backend.
#[async_trait]
pub trait Model: Send + Sync {
    /// Produce the final answer. Dropping the future cancels the call (the
    /// runtime does that on interrupt and shutdown).
    async fn generate(&self, request: &ModelRequest) -> Result<String, ModelError>;
}

/// Build the backend a `[runtimes.NAME.model]` section describes.
pub fn build(config: &ModelConfig) -> Box<dyn Model> {
    match config {
        ModelConfig::Echo(echo) => Box::new(Echo::new(echo)),
    }
}

/// The deterministic backend: answers `echo: <input>`, optionally one word
/// at a time with a delay per word so streaming and interruption can be
/// seen and tested.
pub struct Echo {
    word_delay: Duration,
}

impl Echo {
    pub fn new(config: &EchoConfig) -> Self {
        Echo {
            word_delay: Duration::from_millis(config.token_delay_ms),
        }
    }

    /// The answer for `input`.
    pub fn answer(input: &str) -> String {
        format!("echo: {input}")
    }
}

#[async_trait]
impl Model for Echo {
    async fn generate(&self, request: &ModelRequest) -> Result<String, ModelError> {
        let answer = Echo::answer(&request.input);
        if !self.word_delay.is_zero() {
            for _ in answer.split_whitespace() {
                tokio::time::sleep(self.word_delay).await;
            }
        }
        Ok(answer)
    }
}
