//! Access control, built in the core and used by every channel; here through
//! the webhook channel: DM pairing approved from the CLI, owners, the DM
//! allowlist, the group allowlist and the mention-or-reply trigger. Every
//! refusal is journaled with its reason.

mod common;

use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post};
use switchboard::store::{Disposition, SharedStore};

struct Bot {
    _dir: tempfile::TempDir,
    daemon: Daemon,
    receiver: Receiver,
    store: SharedStore,
    client: reqwest::Client,
    n: std::cell::Cell<u32>,
}

impl Bot {
    async fn start(access: &str) -> Bot {
        let dir = tempfile::tempdir().unwrap();
        let receiver = Receiver::start().await;
        let mut config = DaemonConfig::new(receiver.url());
        config.channel_extra = format!("[channels.main.access]\n{access}");
        let daemon = Daemon::start(dir.path(), &config).await;
        let store = open_store(dir.path()).await;
        Bot {
            _dir: dir,
            daemon,
            receiver,
            store,
            client: reqwest::Client::new(),
            n: std::cell::Cell::new(0),
        }
    }

    /// Send and return the journal row id.
    async fn send(
        &self,
        chat: &str,
        kind: &str,
        sender: &str,
        text: &str,
        mentions_bot: bool,
    ) -> i64 {
        self.n.set(self.n.get() + 1);
        let body = serde_json::json!({
            "update_id": format!("u{}", self.n.get()),
            "chat": {"id": chat, "kind": kind},
            "sender": {"id": sender, "name": sender},
            "text": text,
            "mentions_bot": mentions_bot,
        });
        let (status, answer) = post(&self.client, &self.daemon.updates_url("main"), &body)
            .await
            .unwrap();
        assert_eq!(status.as_u16(), 202, "{answer}");
        answer["inbound_id"].as_i64().unwrap()
    }

    async fn settled(&self, inbound: i64) -> (Disposition, Option<String>) {
        let store = &self.store;
        assert!(
            eventually(Duration::from_secs(10), || async move {
                store
                    .journal_get(inbound)
                    .await
                    .unwrap()
                    .unwrap()
                    .disposition
                    != Disposition::Pending
            })
            .await
        );
        let row = self.store.journal_get(inbound).await.unwrap().unwrap();
        (row.disposition, row.reason)
    }

    async fn replies_to(&self, chat: &str, n: usize) -> Vec<String> {
        let r = &self.receiver;
        assert!(
            eventually(Duration::from_secs(10), || async move {
                r.deliveries()
                    .iter()
                    .filter(|d| d.body.chat_id == chat)
                    .count()
                    >= n
            })
            .await,
            "{chat}: {:?}",
            self.receiver
                .deliveries()
                .iter()
                .map(|d| (d.body.chat_id.clone(), d.body.text.clone()))
                .collect::<Vec<_>>()
        );
        self.receiver
            .deliveries()
            .into_iter()
            .filter(|d| d.body.chat_id == chat)
            .map(|d| d.body.text)
            .collect()
    }
}

fn code_in(text: &str) -> String {
    text.split("pair approve ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_user_is_paired_by_an_operator_and_owners_always_get_in() {
    let bot = Bot::start("dm_policy = \"pairing\"\nowners = [\"boss\"]\n").await;
    let first = bot.send("dm-ann", "private", "ann", "hello?", true).await;
    let replies = bot.replies_to("dm-ann", 1).await;
    assert!(
        replies[0].contains("switchboard pair approve "),
        "{replies:?}"
    );
    let code = code_in(&replies[0]);
    let (disposition, reason) = bot.settled(first).await;
    assert_eq!(disposition, Disposition::Refused);
    assert_eq!(reason.unwrap(), format!("pairing required (code {code})"));

    // Asking again gives the same code while it is valid.
    bot.send("dm-ann", "private", "ann", "anyone?", true).await;
    let replies = bot.replies_to("dm-ann", 2).await;
    assert_eq!(code_in(&replies[1]), code);

    // The operator approves; from then on ann is answered.
    let out = bot.daemon.cli(&["pair", "list", "--account", "main"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&code),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = bot.daemon.cli(&["pair", "approve", &code.to_lowercase()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = bot.daemon.cli(&["pair", "approve", &code]);
    assert!(!out.status.success(), "a code is used once");
    let admitted = bot.send("dm-ann", "private", "ann", "now?", true).await;
    assert_eq!(bot.replies_to("dm-ann", 3).await[2], "echo: now?");
    assert_eq!(bot.settled(admitted).await.0, Disposition::Admitted);

    // Revoked, ann needs a new code.
    let out = bot
        .daemon
        .cli(&["pair", "revoke", "--account", "main", "ann"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    bot.send("dm-ann", "private", "ann", "still there?", true)
        .await;
    let replies = bot.replies_to("dm-ann", 4).await;
    assert!(replies[3].contains("pair approve") && code_in(&replies[3]) != code);

    // Owners never need a code.
    bot.send("dm-boss", "private", "boss", "status", true).await;
    assert_eq!(bot.replies_to("dm-boss", 1).await, ["echo: status"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dm_allowlist_refuses_others_visibly() {
    let bot = Bot::start("dm_policy = \"allowlist\"\nallow_users = [\"ok\"]\n").await;
    bot.send("dm-ok", "private", "ok", "hi", true).await;
    let refused = bot.send("dm-no", "private", "no", "hi", true).await;
    assert_eq!(bot.replies_to("dm-ok", 1).await, ["echo: hi"]);
    assert_eq!(
        bot.replies_to("dm-no", 1).await,
        ["Sorry, I only talk to people on my list."]
    );
    let (d, reason) = bot.settled(refused).await;
    assert_eq!(
        (d, reason.unwrap()),
        (
            Disposition::Refused,
            "user no is not on access.allow_users".to_owned()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_must_be_listed_and_then_answer_only_when_addressed() {
    let bot = Bot::start("groups = [\"team\"]\ngroup_trigger = \"mention\"\n").await;
    let chatter = bot
        .send("team", "group", "ann", "lunch anyone?", false)
        .await;
    let asked = bot
        .send("team", "group", "bob", "@bot what time is it", true)
        .await;
    let elsewhere = bot.send("random", "group", "eve", "@bot hi", true).await;
    assert_eq!(
        bot.replies_to("team", 1).await,
        ["echo: @bot what time is it"]
    );
    assert_eq!(bot.settled(asked).await.0, Disposition::Admitted);
    let (d, reason) = bot.settled(chatter).await;
    assert_eq!(d, Disposition::Ignored);
    assert!(reason.unwrap().contains("not addressed to the bot"));
    let (d, reason) = bot.settled(elsewhere).await;
    assert_eq!(d, Disposition::Ignored);
    assert!(
        reason
            .unwrap()
            .contains("not on this account's access.groups list")
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        bot.receiver
            .deliveries()
            .iter()
            .all(|d| d.body.chat_id == "team"),
        "nothing said where not asked"
    );
}
