//! A local program as the model: one process per model call.
//!
//! The program gets one JSON object on stdin and its stdout is the answer,
//! streamed as it is written:
//!
//! ```json
//! {"run_id": 12, "conversation_id": 3, "surface": "webhook",
//!  "input": "the user's message",
//!  "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
//! ```
//!
//! A non-zero exit fails the run with the end of stderr as the reason; a
//! program that runs longer than `timeout_secs` is killed; an interrupted
//! run kills it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{DeltaSink, Model, ModelError, ModelRequest};
use crate::config::CommandConfig;

/// How much of stderr a failure reason keeps (its end).
const STDERR_TAIL: usize = 2048;

pub struct CommandModel {
    program: PathBuf,
    args: Vec<String>,
    timeout: Duration,
}

impl CommandModel {
    pub fn new(config: &CommandConfig) -> Self {
        CommandModel {
            program: config.program.clone(),
            args: config.args.clone(),
            timeout: Duration::from_secs(config.timeout_secs),
        }
    }

    async fn run(&self, request: &ModelRequest, sink: &DeltaSink) -> Result<String, ModelError> {
        let shown = self.program.display().to_string();
        let mut child = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // An interrupted run drops this future: the program dies with it.
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ModelError::Failed(format!("cannot start {shown}: {e}")))?;
        let payload = json!({
            "run_id": request.run_id,
            "conversation_id": request.conversation_id,
            "surface": request.surface.as_str(),
            "input": request.last_user_text(),
            "messages": request.messages,
        })
        .to_string();
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let writer = tokio::spawn(async move {
            // A program that does not read its input is its own business.
            let _ = stdin.write_all(payload.as_bytes()).await;
            let _ = stdin.shutdown().await;
        });
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let stderr_tail = tokio::spawn(async move {
            let mut tail: VecDeque<u8> = VecDeque::with_capacity(STDERR_TAIL);
            let mut buf = [0u8; 1024];
            while let Ok(n) = stderr.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                for &b in &buf[..n] {
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(b);
                }
            }
            String::from_utf8_lossy(&tail.into_iter().collect::<Vec<u8>>())
                .trim()
                .to_owned()
        });
        let mut stdout = child.stdout.take().expect("stdout is piped");
        let mut text = String::new();
        let mut pending: Vec<u8> = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = stdout
                .read(&mut buf)
                .await
                .map_err(|e| ModelError::Failed(format!("reading {shown}'s output: {e}")))?;
            if n == 0 {
                break;
            }
            pending.extend_from_slice(&buf[..n]);
            let piece = take_utf8(&mut pending);
            if !piece.is_empty() {
                sink.push(&piece);
                text.push_str(&piece);
            }
        }
        if !pending.is_empty() {
            let rest = String::from_utf8_lossy(&pending).into_owned();
            sink.push(&rest);
            text.push_str(&rest);
        }
        let status = child
            .wait()
            .await
            .map_err(|e| ModelError::Failed(format!("waiting for {shown}: {e}")))?;
        let _ = writer.await;
        let tail = stderr_tail.await.unwrap_or_default();
        if !status.success() {
            let reason = if tail.is_empty() {
                format!("{shown} exited with {status}")
            } else {
                format!("{shown} exited with {status}: {tail}")
            };
            return Err(ModelError::Failed(reason));
        }
        Ok(text.trim_end().to_owned())
    }
}

/// Take the longest valid UTF-8 prefix of `bytes`, leaving an incomplete
/// character at the end for the next read; invalid bytes become U+FFFD.
fn take_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                bytes.clear();
                return out;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[..valid]).unwrap_or_default());
                match e.error_len() {
                    // An incomplete character at the end: wait for more.
                    None => {
                        bytes.drain(..valid);
                        return out;
                    }
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes.drain(..valid + bad);
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Model for CommandModel {
    async fn generate(
        &self,
        request: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<String, ModelError> {
        match tokio::time::timeout(self.timeout, self.run(request, sink)).await {
            Ok(result) => result,
            // Dropping the run future kills the program.
            Err(_) => Err(ModelError::Timeout(format!(
                "{} ran longer than {}s and was killed",
                self.program.display(),
                self.timeout.as_secs()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_reads_is_kept_whole() {
        let bytes = "héllo ✓".as_bytes();
        let mut pending = bytes[..2].to_vec(); // 'h' and half of 'é'
        assert_eq!(take_utf8(&mut pending), "h");
        pending.extend_from_slice(&bytes[2..]);
        assert_eq!(take_utf8(&mut pending), "éllo ✓");
        let mut bad = vec![b'a', 0xff, b'b'];
        assert_eq!(take_utf8(&mut bad), "a\u{fffd}b");
    }
}
