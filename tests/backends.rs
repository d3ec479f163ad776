//! The model backends of the built-in runtime, each against something that
//! speaks its real interface: `openai` against a loopback fake
//! chat-completions server (SSE), `command` against a small script. And the
//! failure notices: a run that fails or times out is answered with a short
//! notice, never with silence.

mod common;

use std::time::Duration;

use common::openai::{FakeOpenAi, Script};
use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post, run_of, update};
use switchboard::store::RunState;

struct Bot {
    _dir: tempfile::TempDir,
    daemon: Daemon,
    receiver: Receiver,
    store: switchboard::store::SharedStore,
    client: reqwest::Client,
}

impl Bot {
    async fn start(runtime: String, extra: &str) -> Bot {
        let dir = tempfile::tempdir().unwrap();
        let receiver = Receiver::start().await;
        let mut config = DaemonConfig::new(receiver.url());
        config.runtime = Some(runtime);
        config.extra = extra.to_owned();
        let daemon = Daemon::start(dir.path(), &config).await;
        let store = open_store(dir.path()).await;
        Bot {
            _dir: dir,
            daemon,
            receiver,
            store,
            client: reqwest::Client::new(),
        }
    }

    async fn say(&self, id: &str, text: &str) -> i64 {
        let (status, body) = post(
            &self.client,
            &self.daemon.updates_url("main"),
            &update(id, "chat", text),
        )
        .await
        .unwrap();
        assert_eq!(status.as_u16(), 202, "{body}");
        body["inbound_id"].as_i64().unwrap()
    }

    async fn replies(&self, n: usize) -> Vec<String> {
        assert!(
            self.receiver
                .wait_for_keys(n, Duration::from_secs(30))
                .await,
            "only {} of {n} replies; log:\n{}",
            self.receiver.distinct_keys(),
            self.daemon.logs()
        );
        self.receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect()
    }

    async fn finished_run(&self, inbound: i64) -> switchboard::store::RunRow {
        let store = &self.store;
        assert!(
            eventually(Duration::from_secs(20), || async move {
                matches!(run_of(store, inbound).await, Some(r) if r.state.is_terminal())
            })
            .await
        );
        run_of(store, inbound).await.unwrap()
    }
}

fn openai_runtime(fake: &FakeOpenAi, key_file: &std::path::Path, retries: u32) -> String {
    format!(
        r#"kind = "local"
system_prompt = "You are terse."
model = {{ backend = "openai", base_url = "{}", model = "fake-1", api_key_file = "{}", max_retries = {retries}, retry_base_ms = 10, request_timeout_secs = 5, idle_timeout_secs = 2 }}"#,
        fake.base_url(),
        key_file.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_streams_the_answer_and_sends_the_history() {
    let fake = FakeOpenAi::start().await;
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("key");
    std::fs::write(&key_file, "sk-test\n").unwrap();
    let bot = Bot::start(openai_runtime(&fake, &key_file, 2), "").await;

    bot.say("1", "hello there").await;
    assert_eq!(bot.replies(1).await, ["fake: hello there"]);
    bot.say("2", "and again").await;
    assert_eq!(bot.replies(2).await[1], "fake: and again");

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let (headers, body) = &requests[1];
    assert_eq!(
        headers["authorization"], "Bearer sk-test",
        "the key comes from api_key_file, trimmed"
    );
    assert_eq!(body["model"], "fake-1");
    assert_eq!(body["stream"], true);
    let messages: Vec<(String, String)> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        messages,
        [
            ("system".to_owned(), "You are terse.".to_owned()),
            ("user".to_owned(), "hello there".to_owned()),
            ("assistant".to_owned(), "fake: hello there".to_owned()),
            ("user".to_owned(), "and again".to_owned()),
        ],
        "the second call sees the first turn"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_retries_a_429_a_mid_stream_error_and_a_dropped_stream() {
    let fake = FakeOpenAi::start().await;
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("key");
    std::fs::write(&key_file, "sk").unwrap();
    let bot = Bot::start(openai_runtime(&fake, &key_file, 3), "").await;
    fake.script(vec![
        Script::Status(429, Some("0")),
        Script::StreamThenError(vec!["half an ".into(), "answer".into()]),
        Script::StreamThenDrop(vec!["another half".into()]),
    ]);
    let inbound = bot.say("1", "hi").await;
    // The retried attempt starts the answer over: no piece of the broken
    // attempts reaches the user.
    assert_eq!(bot.replies(1).await, ["fake: hi"]);
    assert_eq!(fake.requests().len(), 4);
    assert_eq!(bot.finished_run(inbound).await.state, RunState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_model_server_gets_the_user_a_failure_notice() {
    let fake = FakeOpenAi::start().await;
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("key");
    std::fs::write(&key_file, "sk").unwrap();
    let bot = Bot::start(openai_runtime(&fake, &key_file, 2), "").await;
    // Three 500s exhaust max_retries = 2; a 400 is not retried at all.
    fake.script(vec![
        Script::Status(500, None),
        Script::Status(500, None),
        Script::Status(500, None),
        Script::Status(400, None),
    ]);
    let first = bot.say("1", "hi").await;
    let run = bot.finished_run(first).await;
    assert_eq!(run.state, RunState::Failed);
    assert!(
        run.reason.as_deref().unwrap().contains("500"),
        "{:?}",
        run.reason
    );
    let second = bot.say("2", "bad request").await;
    let run = bot.finished_run(second).await;
    assert!(
        run.reason.as_deref().unwrap().contains("400"),
        "{:?}",
        run.reason
    );
    assert_eq!(fake.requests().len(), 4);
    let texts = bot.replies(2).await;
    assert_eq!(
        texts,
        vec!["Sorry, something went wrong and I could not answer that."; 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_model_server_fails_the_run_with_a_notice() {
    let closed = common::free_port();
    let runtime = format!(
        r#"kind = "local"
model = {{ backend = "openai", base_url = "http://127.0.0.1:{closed}/v1", model = "m", max_retries = 1, retry_base_ms = 10 }}"#
    );
    let bot = Bot::start(runtime, "[messages]\nrun_failed = \"The model is down.\"\n").await;
    let inbound = bot.say("1", "hi").await;
    assert_eq!(
        bot.replies(1).await,
        ["The model is down."],
        "the notice text is configurable"
    );
    let run = bot.finished_run(inbound).await;
    assert!(
        run.reason.as_deref().unwrap().contains("request to"),
        "{:?}",
        run.reason
    );
}

fn command_runtime(mode: &str, timeout: u64) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/agent.py");
    format!(
        r#"kind = "local"
system_prompt = "sys"
model = {{ backend = "command", program = "python3", args = ["{script}", "{mode}"], timeout_secs = {timeout} }}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_streams_stdout_as_the_answer() {
    let bot = Bot::start(command_runtime("answer", 20), "").await;
    bot.say("1", "hello").await;
    assert_eq!(bot.replies(1).await, ["cmd: hello (2 messages)"]);
    bot.say("2", "more").await;
    // system + the first turn (user, assistant) + this input.
    assert_eq!(bot.replies(2).await[1], "cmd: more (4 messages)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_failure_is_a_failed_run_with_the_stderr_tail() {
    let bot = Bot::start(command_runtime("fail", 20), "").await;
    let inbound = bot.say("1", "hello").await;
    assert_eq!(
        bot.replies(1).await,
        ["Sorry, something went wrong and I could not answer that."]
    );
    let run = bot.finished_run(inbound).await;
    assert_eq!(run.state, RunState::Failed);
    let reason = run.reason.unwrap();
    assert!(
        reason.contains("exit status: 3") && reason.contains("something broke: out of memory"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_timeout_kills_the_program_and_tells_the_user() {
    let bot = Bot::start(command_runtime("slow", 1), "").await;
    let inbound = bot.say("1", "hello").await;
    assert_eq!(
        bot.replies(1).await,
        ["Sorry, that took too long and I gave up on it."]
    );
    let run = bot.finished_run(inbound).await;
    assert_eq!(run.state, RunState::Failed);
    assert!(
        run.reason
            .unwrap()
            .contains("ran longer than 1s and was killed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_its_time_limit_fails_with_the_timeout_notice() {
    let runtime = r#"kind = "local"
run_timeout_secs = 1
model = { backend = "echo", token_delay_ms = 200 }"#;
    let bot = Bot::start(runtime.to_owned(), "").await;
    let inbound = bot
        .say("1", "one two three four five six seven eight")
        .await;
    assert_eq!(
        bot.replies(1).await,
        ["Sorry, that took too long and I gave up on it."]
    );
    let run = bot.finished_run(inbound).await;
    assert_eq!(run.state, RunState::Failed);
    assert!(run.reason.as_deref().unwrap().contains("longer than 1s"));
    assert!(
        !run.answer.unwrap().is_empty(),
        "what it said before is kept in the record"
    );
}
