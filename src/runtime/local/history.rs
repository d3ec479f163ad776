//! What a model call sees of its conversation: the system prompt, the most
//! recent turns within a budget, then the turn being answered.
//!
//! A turn is one earlier run: the user's inputs it answered and its answer.
//! Only completed and interrupted runs are turns; superseded runs never
//! reach a prompt and cost nothing against the budget. How an interrupted
//! turn appears is configured (`history.interrupted_assistant`).

use super::model::{ChatMessage, Role};
use crate::config::{HistoryConfig, InterruptedAssistant};
use crate::store::{RunRow, RunState};

/// How the model is told that a turn was cut off (`assistant-marked`).
pub const MODEL_MARKER: &str = "[interrupted: this turn was cut off before it finished]";

/// Approximate tokens of a text: four characters a token.
fn approx_tokens(text: &str) -> usize {
    text.chars().count().div_ceil(4)
}

/// The user inputs a run answered, from its `prompt` column.
pub fn prompt_texts(run: &RunRow) -> Vec<String> {
    run.prompt
        .as_deref()
        .and_then(|p| serde_json::from_str::<Vec<String>>(p).ok())
        .unwrap_or_default()
}

/// The messages of one earlier turn.
fn turn_messages(run: &RunRow, config: &HistoryConfig) -> Vec<ChatMessage> {
    let mut messages = vec![ChatMessage::new(Role::User, prompt_texts(run).join("\n\n"))];
    let answer = run.answer.clone().unwrap_or_default();
    match (run.state, config.interrupted_assistant) {
        (RunState::Interrupted, InterruptedAssistant::AssistantMarked) => {
            let text = if answer.is_empty() {
                MODEL_MARKER.to_owned()
            } else {
                format!("{answer}\n\n{MODEL_MARKER}")
            };
            messages.push(ChatMessage::new(Role::Assistant, text));
        }
        (RunState::Interrupted, InterruptedAssistant::SystemNote) => {
            if !answer.is_empty() {
                messages.push(ChatMessage::new(Role::Assistant, answer));
            }
            messages.push(ChatMessage::new(
                Role::System,
                "The previous assistant turn was interrupted before it finished.",
            ));
        }
        (RunState::Interrupted, InterruptedAssistant::Omit) => {}
        _ => messages.push(ChatMessage::new(Role::Assistant, answer)),
    }
    messages
}

/// Build the prompt. `past` is newest first (as the store returns it).
pub fn build(
    system: Option<&str>,
    past: &[RunRow],
    config: &HistoryConfig,
    current: &[ChatMessage],
) -> Vec<ChatMessage> {
    let mut budget = config.max_tokens;
    let mut turns: Vec<Vec<ChatMessage>> = Vec::new();
    for run in past
        .iter()
        .filter(|r| matches!(r.state, RunState::Completed | RunState::Interrupted))
        .take(config.max_turns)
    {
        let messages = turn_messages(run, config);
        let cost: usize = messages.iter().map(|m| approx_tokens(&m.content)).sum();
        if cost > budget {
            break;
        }
        budget -= cost;
        turns.push(messages);
    }
    let mut prompt = Vec::new();
    if let Some(system) = system.filter(|s| !s.is_empty()) {
        prompt.push(ChatMessage::new(Role::System, system));
    }
    for turn in turns.into_iter().rev() {
        prompt.extend(turn);
    }
    prompt.extend_from_slice(current);
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RunMode;
    use crate::surface::SurfaceKind;

    fn run(id: i64, state: RunState, prompt: &[&str], answer: &str) -> RunRow {
        RunRow {
            id,
            conversation_id: 1,
            runtime: "r".into(),
            account: "a".into(),
            chat_id: "c".into(),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
            mode: RunMode::Ordinary,
            state,
            priority: 0,
            end_as: None,
            end_notice: None,
            prompt: Some(serde_json::to_string(prompt).unwrap()),
            answer: Some(answer.into()),
            reason: None,
            absorbed_by: None,
            created_at: 0,
            started_at: None,
            finished_at: None,
        }
    }

    fn config(mode: InterruptedAssistant) -> HistoryConfig {
        HistoryConfig {
            max_turns: 10,
            max_tokens: 1000,
            interrupted_assistant: mode,
        }
    }

    fn texts(messages: &[ChatMessage]) -> Vec<(Role, String)> {
        messages
            .iter()
            .map(|m| (m.role, m.content.clone()))
            .collect()
    }

    #[test]
    fn turns_come_oldest_first_with_the_system_prompt_and_current_input() {
        let past = [
            run(3, RunState::Completed, &["b"], "echo: b"),
            run(1, RunState::Completed, &["a"], "echo: a"),
        ];
        let now = [ChatMessage::new(Role::User, "c")];
        let prompt = build(
            Some("be brief"),
            &past,
            &config(InterruptedAssistant::Omit),
            &now,
        );
        assert_eq!(
            texts(&prompt),
            [
                (Role::System, "be brief".into()),
                (Role::User, "a".into()),
                (Role::Assistant, "echo: a".into()),
                (Role::User, "b".into()),
                (Role::Assistant, "echo: b".into()),
                (Role::User, "c".into()),
            ]
        );
    }

    #[test]
    fn interrupted_turns_follow_the_configured_form() {
        let past = [run(1, RunState::Interrupted, &["a"], "echo: half")];
        let marked = build(
            None,
            &past,
            &config(InterruptedAssistant::AssistantMarked),
            &[],
        );
        assert_eq!(
            marked[1].content,
            "echo: half\n\n[interrupted: this turn was cut off before it finished]"
        );
        let note = build(None, &past, &config(InterruptedAssistant::SystemNote), &[]);
        assert_eq!(
            note.iter().map(|m| m.role).collect::<Vec<_>>(),
            [Role::User, Role::Assistant, Role::System]
        );
        let omitted = build(None, &past, &config(InterruptedAssistant::Omit), &[]);
        assert_eq!(texts(&omitted), [(Role::User, "a".into())]);
    }

    #[test]
    fn superseded_runs_never_reach_the_prompt_and_the_budget_drops_the_oldest() {
        let past = [
            run(4, RunState::Superseded, &["s"], "never shown"),
            run(3, RunState::Completed, &["x".repeat(40).as_str()], "y"),
            run(2, RunState::Completed, &["old"], "older answer"),
        ];
        let mut small = config(InterruptedAssistant::AssistantMarked);
        small.max_tokens = 12;
        let prompt = build(None, &past, &small, &[]);
        assert!(prompt.iter().all(|m| !m.content.contains("never shown")));
        assert_eq!(prompt.len(), 2, "only the newest turn fits: {prompt:?}");
        assert_eq!(prompt[1].content, "y");
        small.max_turns = 0;
        assert!(build(None, &past, &small, &[]).is_empty());
    }
}
