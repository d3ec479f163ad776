//! Executing one run: model calls ("steps"), inject at step boundaries,
//! soft interrupts, interrupts, the run timeout, and what each ending writes.
//!
//! A run answers its own inputs with one model call. When inject inputs
//! were offered while that call ran, the step boundary takes them in: the
//! run makes one more call that answers them (seeing its own earlier answer),
//! and so on. With a soft interrupt the current call is cut at once and the
//! run continues with the new input. The final answer is the answers of all
//! steps; only a run that *completes* absorbs the inject runs it answered.

use std::sync::Arc;

use tokio::time::Instant;

use super::Inner;
use super::history;
use super::lane::{QueuedRun, RunControl};
use super::model::{ChatMessage, DeltaSink, ModelError, ModelRequest, Role};
use crate::store::{RunFinish, RunState};

/// How a run ended.
enum Ended {
    Completed,
    /// Interrupted or superseded, with what it had said in the step that
    /// was cut.
    Cut {
        state: RunState,
        partial: String,
    },
    Failed(ModelError),
    TimedOut {
        partial: String,
    },
}

impl Inner {
    /// Execute a run to its end and record it. Returns the inject runs it
    /// absorbed (to be removed from the lane).
    pub(super) async fn execute(
        &self,
        conversation_id: i64,
        run: QueuedRun,
        control: Arc<RunControl>,
    ) -> Vec<i64> {
        let run_id = run.run_id;
        // Recording `running` is for operators and recovery; the answer does
        // not wait for it (the finish write is guarded by state).
        let starts = self.starts.clone();
        tokio::spawn(async move {
            let _ = starts.call(run_id, "run start").await;
        });
        let past = match self
            .store
            .runs_history(conversation_id, self.history.max_turns)
            .await
        {
            Ok(past) => past,
            Err(e) => {
                tracing::warn!(run_id, error = %e, "could not read the history; answering without it");
                Vec::new()
            }
        };
        let own: Vec<String> = run.inputs.iter().map(|i| i.text.clone()).collect();
        let mut answered = own.clone();
        let mut steps: Vec<(String, String)> = Vec::new();
        let mut absorbed: Vec<i64> = Vec::new();
        let mut current = own.join("\n\n");
        let deadline = Instant::now() + self.run_timeout;
        let mut epoch = 0u32;

        let ended = loop {
            epoch += 1;
            let mut turn = Vec::with_capacity(steps.len() * 2 + 1);
            for (user, answer) in &steps {
                turn.push(ChatMessage::new(Role::User, user.clone()));
                turn.push(ChatMessage::new(Role::Assistant, answer.clone()));
            }
            turn.push(ChatMessage::new(Role::User, current.clone()));
            let request = ModelRequest {
                run_id,
                conversation_id,
                surface: run.route.surface,
                messages: history::build(
                    self.system_prompt.as_deref(),
                    &past,
                    &self.history,
                    &turn,
                ),
            };
            let said_before = joined(steps.iter().map(|(_, a)| a.as_str()));
            let prefix = if said_before.is_empty() {
                said_before
            } else {
                format!("{said_before}\n\n")
            };
            let sink = DeltaSink::new(
                run_id,
                conversation_id,
                run.route.clone(),
                epoch,
                prefix,
                self.deltas.clone(),
            );
            let step = control.next_step();
            enum Step {
                Done(Result<String, ModelError>),
                Soft,
                End,
                Timeout,
            }
            let outcome = tokio::select! {
                biased;
                // Shutdown after the grace period: the run stays `running`
                // in the store and is re-run by the next start.
                _ = self.abort.cancelled() => return Vec::new(),
                _ = control.cancelled() => Step::End,
                _ = step.cancelled() => Step::Soft,
                _ = tokio::time::sleep_until(deadline) => Step::Timeout,
                result = self.model.generate(&request, &sink) => Step::Done(result),
            };
            match outcome {
                Step::Done(Ok(answer)) => {
                    steps.push((current, answer));
                    let offers = control.take_offers();
                    if offers.is_empty() {
                        break Ended::Completed;
                    }
                    let texts: Vec<String> = offers
                        .iter()
                        .flat_map(|o| o.inputs.iter().map(|i| i.text.clone()))
                        .collect();
                    absorbed.extend(offers.iter().map(|o| o.run_id));
                    answered.extend(texts.iter().cloned());
                    current = texts.join("\n\n");
                }
                Step::Done(Err(e)) => break Ended::Failed(e),
                Step::Soft => {
                    steps.push((current.clone(), sink.text()));
                    let offers = control.take_offers();
                    let texts: Vec<String> = offers
                        .iter()
                        .flat_map(|o| o.inputs.iter().map(|i| i.text.clone()))
                        .collect();
                    absorbed.extend(offers.iter().map(|o| o.run_id));
                    answered.extend(texts.iter().cloned());
                    if !texts.is_empty() {
                        current = texts.join("\n\n");
                    }
                }
                Step::End => {
                    break Ended::Cut {
                        state: control.end_state(),
                        partial: sink.text(),
                    };
                }
                Step::Timeout => {
                    break Ended::TimedOut {
                        partial: sink.text(),
                    };
                }
            }
        };

        let said = |partial: &str| joined(steps.iter().map(|(_, a)| a.as_str()).chain([partial]));
        let now = self.clock.now_ms();
        let account = run.route.account.as_str();
        let finish = match ended {
            Ended::Completed => RunFinish {
                run_id,
                state: RunState::Completed,
                answer: Some(said("")),
                prompt: Some(prompt_json(&answered)),
                reason: None,
                replies: self.shaper.answer(account, run_id, &said("")),
                absorb: absorbed.clone(),
                now,
            },
            Ended::Cut { state, partial } => {
                let said = said(&partial);
                let mut finish =
                    ended_without_partial(self, run_id, account, state, control.stopped(), &own);
                if !said.is_empty() {
                    if state == RunState::Interrupted {
                        finish.replies = self.shaper.answer(
                            account,
                            run_id,
                            &format!("{said}\n\n{}", self.messages.interrupted_marker),
                        );
                    }
                    finish.answer = Some(said);
                }
                finish.now = now;
                finish
            }
            Ended::Failed(ModelError::Timeout(reason)) => failed(
                self,
                run_id,
                &own,
                format!("model call timed out: {reason}"),
                true,
                now,
            ),
            Ended::Failed(ModelError::Failed(reason)) => {
                failed(self, run_id, &own, reason, false, now)
            }
            Ended::TimedOut { partial } => {
                let mut finish = failed(
                    self,
                    run_id,
                    &own,
                    format!("the run took longer than {}s", self.run_timeout.as_secs()),
                    true,
                    now,
                );
                finish.answer = Some(said(&partial));
                finish
            }
        };
        if finish.state == RunState::Failed {
            tracing::warn!(run_id, runtime = %self.name, reason = finish.reason.as_deref().unwrap_or(""), "run failed");
        }
        let completed = finish.state == RunState::Completed;
        let written = self.finish(finish, conversation_id).await;
        if completed && written {
            absorbed
        } else {
            Vec::new()
        }
    }
}

/// The record of a run that ended (interrupted or superseded) before it
/// said anything: an interrupted run tells the user with the marker, unless
/// a `/stop` confirmation follows anyway; a superseded run turns a preview
/// that was shown into the "discarded" marker, and says nothing otherwise.
pub(super) fn ended_without_partial(
    inner: &Inner,
    run_id: i64,
    account: &str,
    state: RunState,
    confirmation_follows: bool,
    own_inputs: &[String],
) -> RunFinish {
    let replies = match state {
        RunState::Interrupted if !confirmation_follows => {
            inner
                .shaper
                .answer(account, run_id, &inner.messages.interrupted_marker)
        }
        RunState::Superseded => vec![
            inner
                .shaper
                .discard(run_id, &inner.messages.discarded_marker),
        ],
        _ => Vec::new(),
    };
    RunFinish {
        run_id,
        state,
        answer: Some(String::new()),
        prompt: Some(prompt_json(own_inputs)),
        reason: Some(match state {
            RunState::Superseded => "superseded by a newer input".to_owned(),
            _ => "interrupted".to_owned(),
        }),
        replies,
        absorb: Vec::new(),
        now: inner.clock.now_ms(),
    }
}

fn failed(
    inner: &Inner,
    run_id: i64,
    own: &[String],
    reason: String,
    timeout: bool,
    now: i64,
) -> RunFinish {
    let text = if timeout {
        inner.messages.run_timeout.clone()
    } else {
        inner.messages.run_failed.clone()
    };
    RunFinish {
        run_id,
        state: RunState::Failed,
        answer: None,
        prompt: Some(prompt_json(own)),
        reason: Some(reason),
        replies: vec![inner.shaper.run_notice(run_id, "failure", &text)],
        absorb: Vec::new(),
        now,
    }
}

fn prompt_json(texts: &[String]) -> String {
    serde_json::to_string(texts).unwrap_or_else(|_| "[]".to_owned())
}

/// Non-empty pieces joined by a blank line.
fn joined<'a>(pieces: impl Iterator<Item = &'a str>) -> String {
    pieces
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n")
}
