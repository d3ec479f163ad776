//! The deterministic backend: answers `echo: <input>`.

use std::time::Duration;

use async_trait::async_trait;

use super::{DeltaSink, Model, ModelError, ModelRequest};
use crate::config::EchoConfig;

/// Answers `echo: <the last user message>`, one word at a time with an
/// optional delay per word, so streaming and interruption can be watched
/// and tested.
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
    async fn generate(
        &self,
        request: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<String, ModelError> {
        let answer = Echo::answer(request.last_user_text());
        // Stream word by word, keeping the separators, so the pieces add up
        // to the answer exactly.
        let mut rest = answer.as_str();
        while !rest.is_empty() {
            let start = rest.len() - rest.trim_start().len();
            let end = rest[start..]
                .find(char::is_whitespace)
                .map_or(rest.len(), |i| start + i);
            if !self.word_delay.is_zero() {
                tokio::time::sleep(self.word_delay).await;
            }
            sink.push(&rest[..end]);
            rest = &rest[end..];
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::local::model::{ChatMessage, Role};
    use crate::surface::SurfaceKind;

    #[tokio::test]
    async fn echo_streams_pieces_that_add_up_to_the_answer() {
        let (tx, mut rx) = tokio::sync::broadcast::channel(64);
        let detached = DeltaSink::detached();
        let sink = DeltaSink::new(7, 3, detached.route(), 1, String::new(), tx);
        let request = ModelRequest {
            run_id: 7,
            conversation_id: 3,
            surface: SurfaceKind::Webhook,
            messages: vec![ChatMessage::new(Role::User, "hello  big world")],
        };
        let answer = Echo::new(&EchoConfig { token_delay_ms: 0 })
            .generate(&request, &sink)
            .await
            .unwrap();
        assert_eq!(answer, "echo: hello  big world");
        assert_eq!(sink.text(), answer);
        let mut deltas = Vec::new();
        while let Ok(d) = rx.try_recv() {
            deltas.push(d);
        }
        assert_eq!(
            deltas.iter().map(|d| d.delta.as_str()).collect::<String>(),
            answer
        );
        let sequences: Vec<u64> = deltas.iter().map(|d| d.sequence).collect();
        assert_eq!(
            sequences,
            (1..=deltas.len() as u64).collect::<Vec<_>>(),
            "gap-free sequence"
        );
        assert!(deltas.iter().all(|d| d.run_id == "7" && d.epoch == 1));
        assert_eq!(deltas.last().unwrap().text, answer);
    }
}
