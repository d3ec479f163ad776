//! The Telegram adapter's delivery side against the loopback fake Bot API:
//! what each platform answer becomes for the outbox (DESIGN.md §4), files,
//! edits, migrations, typing, drafts and capped downloads.

use std::time::Duration;

use switchboard_channel::{
    AttachmentRef, ChannelAdapter, DeliveryError, FetchError, OutboundMessage, OutboundMeta,
    RateScope, SendAction,
};
use switchboard_fakes::telegram::{FakeTelegram, Fault};
use switchboard_telegram::{Edits, Mode, TelegramChannel, TelegramSettings};

const TOKEN: &str = "4242:TEST-token-a";

fn settings(api_url: String) -> TelegramSettings {
    TelegramSettings {
        account: "tg".into(),
        token: TOKEN.into(),
        api_url,
        mode: Mode::Polling,
        poll_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        edits: Edits::Ignore,
        reply_references: true,
        drafts: true,
        commands: vec![],
    }
}

async fn channel() -> (FakeTelegram, TelegramChannel) {
    let fake = FakeTelegram::start().await;
    fake.add_bot(TOKEN, 4242, "switch_bot");
    fake.add_chat(100, "private", "Ann");
    let channel = TelegramChannel::new(settings(fake.url())).unwrap();
    (fake, channel)
}

fn message(chat: i64, text: &str) -> OutboundMessage {
    OutboundMessage {
        item_key: "item-1".into(),
        chat_id: chat.to_string(),
        thread_id: None,
        text: text.into(),
        attachments: vec![],
        reply_to: None,
        action: SendAction::Create,
        meta: OutboundMeta {
            conversation_id: 1,
            ordinal: 1,
            run_id: None,
        },
    }
}

#[tokio::test]
async fn platform_answers_map_to_outbox_outcomes() {
    let (fake, tg) = channel().await;
    assert_eq!(tg.identity(), "telegram:4242");

    fake.fail_next(TOKEN, "sendMessage", Fault::RetryAfter(7));
    assert_eq!(
        tg.send(&message(100, "a")).await,
        Err(DeliveryError::RetryAfter {
            after: Duration::from_secs(7),
            scope: RateScope::Chat
        })
    );
    fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::Status(403, "Forbidden: bot was blocked by the user".into()),
    );
    assert!(matches!(
        tg.send(&message(100, "b")).await,
        Err(DeliveryError::Permanent(_))
    ));
    fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::Status(400, "Bad Request: chat not found".into()),
    );
    assert!(matches!(
        tg.send(&message(100, "c")).await,
        Err(DeliveryError::Permanent(_))
    ));
    fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::Status(
            400,
            "Bad Request: not enough rights to send text messages to the chat".into(),
        ),
    );
    assert!(matches!(
        tg.send(&message(100, "d")).await,
        Err(DeliveryError::Permanent(_))
    ));
    // The request left and no answer came in time: it may have been sent.
    fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::HangAfterEffect(Duration::from_secs(3)),
    );
    assert!(matches!(
        tg.send(&message(100, "e")).await,
        Err(DeliveryError::Ambiguous(_))
    ));
    // The connection closed after the request was written: ambiguous too.
    fake.fail_next(TOKEN, "sendMessage", Fault::Close);
    assert!(matches!(
        tg.send(&message(100, "f")).await,
        Err(DeliveryError::Ambiguous(_))
    ));
    // A proxy's error page instead of Bot API JSON (teloxide waits 10 s
    // after any 5xx before it returns).
    fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::Raw(502, "<html>Bad Gateway</html>".into()),
    );
    assert!(matches!(
        tg.send(&message(100, "g")).await,
        Err(DeliveryError::Ambiguous(_))
    ));
    assert!(tg.send(&message(100, "h")).await.is_ok());

    // Nothing listens: the request never left.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let offline = TelegramChannel::new(settings(format!("http://{closed}"))).unwrap();
    assert!(matches!(
        offline.send(&message(100, "i")).await,
        Err(DeliveryError::NotSent(_))
    ));

    // A revoked token: wait (the account reports itself down), keep the reply.
    fake.revoke(TOKEN);
    assert_eq!(
        tg.send(&message(100, "j")).await,
        Err(DeliveryError::RetryAfter {
            after: Duration::from_secs(60),
            scope: RateScope::Account
        })
    );
}

#[tokio::test]
async fn files_edits_migrations_typing_drafts_and_downloads() {
    let (fake, tg) = channel().await;

    fake.add_file("file-photo", vec![0u8; 10]);
    // A photo by file id with a short caption: one sendPhoto; a document by
    // URL after a long text: sendMessage then sendDocument.
    let mut photo = message(100, "a *cat*");
    photo.attachments = vec![AttachmentRef {
        reference: "file-photo".into(),
        media_type: Some("image/jpeg".into()),
        size: None,
        filename: None,
    }];
    let receipt = tg.send(&photo).await.unwrap();
    assert_eq!(receipt.message_ids.len(), 1);
    let sent = fake.sent(100);
    assert_eq!(sent[0].method, "sendPhoto");
    assert_eq!(sent[0].media.as_deref(), Some("file-photo"));
    assert_eq!(sent[0].visible_text, "a cat");

    let mut doc = message(100, &"long ".repeat(300));
    doc.attachments = vec![AttachmentRef {
        reference: "https://example.org/report.pdf".into(),
        media_type: Some("application/pdf".into()),
        size: None,
        filename: Some("report.pdf".into()),
    }];
    let receipt = tg.send(&doc).await.unwrap();
    assert_eq!(receipt.message_ids.len(), 2);
    let sent = fake.sent(100);
    assert_eq!(
        sent.iter().map(|m| m.method.as_str()).collect::<Vec<_>>(),
        ["sendPhoto", "sendMessage", "sendDocument"]
    );

    // Edits: identical text is success; a vanished message gets a new one.
    let created = tg.send(&message(100, "draft")).await.unwrap();
    let id = created.message_ids[0].clone();
    let mut edit = message(100, "final");
    edit.action = SendAction::Edit {
        message_id: id.clone(),
    };
    assert_eq!(tg.send(&edit).await.unwrap().message_ids, vec![id.clone()]);
    assert_eq!(tg.send(&edit).await.unwrap().message_ids, vec![id.clone()]);
    edit.action = SendAction::Edit {
        message_id: "999999".into(),
    };
    let replaced = tg.send(&edit).await.unwrap();
    assert_ne!(replaced.message_ids, [id]);
    assert_eq!(fake.sent(100).last().unwrap().visible_text, "final");

    // A group that became a supergroup: the message goes to the new id.
    fake.add_chat(-5, "group", "Team");
    fake.migrate_chat(-5, -1009);
    tg.send(&message(-5, "moved")).await.unwrap();
    assert_eq!(fake.sent(-1009).last().unwrap().visible_text, "moved");
    assert!(fake.sent(-5).is_empty());

    // Typing and drafts.
    tg.typing("100", None).await.unwrap();
    assert_eq!(fake.chat_actions().last().unwrap().action, "typing");
    tg.draft("100", None, 77, "half an **answer**")
        .await
        .unwrap();
    let draft = fake.drafts().pop().unwrap();
    assert_eq!(
        (draft.draft_id, draft.visible_text.as_str()),
        (77, "half an answer")
    );

    // Downloads on demand, refused over the cap.
    fake.add_file("file-1", vec![1u8; 100]);
    assert_eq!(
        tg.fetch_attachment("file-1", 1000).await.unwrap().len(),
        100
    );
    assert!(matches!(
        tg.fetch_attachment("file-1", 10).await,
        Err(FetchError::TooLarge { .. })
    ));
    assert!(matches!(
        tg.fetch_attachment("nope", 10).await,
        Err(FetchError::NotFound(_))
    ));
}
