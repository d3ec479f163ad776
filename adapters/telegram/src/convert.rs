//! Telegram updates (raw Bot API JSON) to envelopes.
//!
//! The same converter serves long polling and webhooks. It works on the
//! JSON rather than on typed updates so that update kinds a client library
//! does not know are still journaled (as ignored, with their kind), never
//! dropped.
//!
//! Journal keys are the platform's identity of what was said — `chat:message`
//! for messages, `chat:message:edit:<edit_date>` for edits, `cb:<id>` for
//! button presses — rather than `update_id`, which Telegram may restart at a
//! random value after a week without updates.

use serde_json::Value;
use switchboard_channel::{AttachmentRef, ChatKind, Content, Envelope, Sender};

/// What to do with edited messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edits {
    /// Journal them as ignored, with the reason.
    Ignore,
    /// Treat an edit as a new input.
    NewInput,
}

/// What the converter needs to know about the bot.
#[derive(Debug, Clone)]
pub struct BotContext {
    /// The channel account's configured name.
    pub account: String,
    pub bot_id: i64,
    /// Lowercase, without the `@`; empty until `getMe` answered.
    pub username: String,
    pub edits: Edits,
}

fn str_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn chat_kind(chat: &Value) -> Option<ChatKind> {
    match chat["type"].as_str()? {
        "private" => Some(ChatKind::Private),
        "group" | "supergroup" => Some(ChatKind::Group),
        _ => None,
    }
}

fn sender_of(user: &Value) -> Option<Sender> {
    let id = str_of(&user["id"])?;
    let name = [user["first_name"].as_str(), user["last_name"].as_str()]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" ");
    let name = if name.is_empty() {
        user["username"].as_str().map(str::to_owned)
    } else {
        Some(name)
    };
    Some(Sender {
        id,
        name,
        is_bot: user["is_bot"].as_bool().unwrap_or(false),
    })
}

/// A topic of a forum supergroup is its own conversation.
fn thread_of(message: &Value) -> Option<String> {
    if message["is_topic_message"].as_bool() == Some(true) {
        str_of(&message["message_thread_id"])
    } else {
        None
    }
}

fn attachments(message: &Value) -> Vec<AttachmentRef> {
    let mut out = Vec::new();
    let mut add = |v: &Value, default_type: &str| {
        if let Some(file_id) = v["file_id"].as_str() {
            out.push(AttachmentRef {
                reference: file_id.to_owned(),
                media_type: Some(v["mime_type"].as_str().unwrap_or(default_type).to_owned()),
                size: v["file_size"].as_u64(),
                filename: v["file_name"].as_str().map(str::to_owned),
            });
        }
    };
    if let Some(sizes) = message["photo"].as_array()
        && let Some(largest) = sizes.last()
    {
        add(largest, "image/jpeg");
    }
    for (field, default_type) in [
        ("document", "application/octet-stream"),
        ("voice", "audio/ogg"),
        ("audio", "audio/mpeg"),
        ("video", "video/mp4"),
        ("video_note", "video/mp4"),
        ("animation", "video/mp4"),
    ] {
        if message[field].is_object() {
            add(&message[field], default_type);
        }
    }
    if message["sticker"].is_object() {
        let video = message["sticker"]["is_video"].as_bool() == Some(true);
        add(
            &message["sticker"],
            if video { "video/webm" } else { "image/webp" },
        );
    }
    out
}

/// Whether a group message addresses the bot, and whether it is a command
/// for another bot.
fn addressing(message: &Value, text: &str, bot: &BotContext) -> (bool, Option<String>) {
    let lower = text.to_lowercase();
    if let Some(command) = lower.strip_prefix('/') {
        let word = command.split_whitespace().next().unwrap_or_default();
        if let Some((_, target)) = word.split_once('@') {
            if !bot.username.is_empty() && target != bot.username {
                return (false, Some(target.to_owned()));
            }
            return (true, None);
        }
        // A bare command in a group is for every bot that reads it.
        return (true, None);
    }
    let mentioned = !bot.username.is_empty() && lower.contains(&format!("@{}", bot.username));
    let text_mention = message["entities"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(message["caption_entities"].as_array().into_iter().flatten())
        .any(|e| e["type"] == "text_mention" && e["user"]["id"].as_i64() == Some(bot.bot_id));
    let replied_to_bot = message["reply_to_message"]["from"]["id"].as_i64() == Some(bot.bot_id);
    (mentioned || text_mention || replied_to_bot, None)
}

fn unsupported(
    bot: &BotContext,
    key: String,
    chat: &Value,
    kind: &str,
    reason: String,
) -> Envelope {
    Envelope {
        account: bot.account.clone(),
        update_key: key,
        chat_id: str_of(&chat["id"]).unwrap_or_else(|| "updates".to_owned()),
        chat_kind: chat_kind(chat).unwrap_or(ChatKind::Group),
        thread_id: None,
        space: None,
        sender: None,
        message_id: None,
        content: Content::Unsupported {
            kind: kind.to_owned(),
            reason,
        },
        input_policy: None,
        addressed: false,
    }
}

fn message_envelope(bot: &BotContext, message: &Value, edit: bool) -> Envelope {
    let chat = &message["chat"];
    let chat_id = str_of(&chat["id"]).unwrap_or_default();
    let message_id = str_of(&message["message_id"]).unwrap_or_default();
    let key = if edit {
        format!(
            "{chat_id}:{message_id}:edit:{}",
            message["edit_date"].as_i64().unwrap_or_default()
        )
    } else {
        format!("{chat_id}:{message_id}")
    };
    let Some(kind) = chat_kind(chat) else {
        return unsupported(
            bot,
            key,
            chat,
            "channel_post",
            "channel posts are not inputs".into(),
        );
    };
    if let Some(to) = str_of(&message["migrate_to_chat_id"]) {
        let mut envelope = unsupported(bot, key, chat, "migration", String::new());
        envelope.content = Content::ChatMigrated { to_chat_id: to };
        return envelope;
    }
    let text = message["text"]
        .as_str()
        .or_else(|| message["caption"].as_str())
        .unwrap_or_default()
        .to_owned();
    let files = attachments(message);
    if text.is_empty() && files.is_empty() {
        let service = [
            "new_chat_members",
            "left_chat_member",
            "new_chat_title",
            "new_chat_photo",
            "pinned_message",
            "group_chat_created",
            "supergroup_chat_created",
            "forum_topic_created",
            "poll",
            "location",
            "contact",
            "dice",
        ]
        .into_iter()
        .find(|k| !message[*k].is_null())
        .unwrap_or("service message");
        return unsupported(
            bot,
            key,
            chat,
            service,
            format!("{service} messages are not inputs"),
        );
    }
    let (addressed, other_bot) = if kind == ChatKind::Private {
        (true, None)
    } else {
        addressing(message, &text, bot)
    };
    if let Some(other) = other_bot {
        return unsupported(
            bot,
            key,
            chat,
            "command",
            format!("a command for @{other}, not this bot"),
        );
    }
    Envelope {
        account: bot.account.clone(),
        update_key: key,
        chat_id,
        chat_kind: kind,
        thread_id: thread_of(message),
        space: None,
        sender: sender_of(&message["from"]),
        message_id: Some(message_id),
        content: Content::Message {
            text,
            attachments: files,
        },
        input_policy: None,
        addressed,
    }
}

/// One update as an envelope. A callback query's id is returned too, so
/// the button can be answered once the envelope is journaled.
pub fn convert(bot: &BotContext, update: &Value) -> (Envelope, Option<String>) {
    let update_id = update["update_id"].as_i64().unwrap_or_default();
    if update["message"].is_object() {
        return (message_envelope(bot, &update["message"], false), None);
    }
    if update["edited_message"].is_object() {
        let edited = &update["edited_message"];
        return match bot.edits {
            Edits::NewInput => (message_envelope(bot, edited, true), None),
            Edits::Ignore => {
                let key = format!(
                    "{}:{}:edit:{}",
                    str_of(&edited["chat"]["id"]).unwrap_or_default(),
                    str_of(&edited["message_id"]).unwrap_or_default(),
                    edited["edit_date"].as_i64().unwrap_or_default()
                );
                let reason = format!(
                    "message edits are ignored (channels.{}.edits = \"ignore\")",
                    bot.account
                );
                (
                    unsupported(bot, key, &edited["chat"], "edited_message", reason),
                    None,
                )
            }
        };
    }
    if update["callback_query"].is_object() {
        let q = &update["callback_query"];
        let id = q["id"].as_str().unwrap_or_default().to_owned();
        let message = &q["message"];
        let chat = &message["chat"];
        let Some(kind) = chat_kind(chat) else {
            let envelope = unsupported(
                bot,
                format!("cb:{id}"),
                chat,
                "callback_query",
                "a button outside a chat".into(),
            );
            return (envelope, Some(id));
        };
        let envelope = Envelope {
            account: bot.account.clone(),
            update_key: format!("cb:{id}"),
            chat_id: str_of(&chat["id"]).unwrap_or_default(),
            chat_kind: kind,
            thread_id: thread_of(message),
            space: None,
            sender: sender_of(&q["from"]),
            message_id: str_of(&message["message_id"]),
            content: Content::Message {
                text: q["data"].as_str().unwrap_or_default().to_owned(),
                attachments: Vec::new(),
            },
            input_policy: None,
            addressed: true,
        };
        return (envelope, Some(id));
    }
    // Anything else is journaled as ignored with its kind.
    let kind = update
        .as_object()
        .and_then(|o| o.keys().find(|k| *k != "update_id").cloned())
        .unwrap_or_else(|| "unknown".to_owned());
    let chat = update[&kind]["chat"].clone();
    let envelope = unsupported(
        bot,
        format!("upd:{update_id}"),
        &chat,
        &kind,
        format!("this bot does not handle {kind} updates"),
    );
    (envelope, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bot() -> BotContext {
        BotContext {
            account: "tg".into(),
            bot_id: 42,
            username: "helper_bot".into(),
            edits: Edits::Ignore,
        }
    }

    fn message(chat: Value, text: &str) -> Value {
        json!({"update_id": 7, "message": {"message_id": 9, "date": 0, "chat": chat, "from": {"id": 5, "is_bot": false, "first_name": "Ann", "last_name": "Lee"}, "text": text}})
    }

    #[test]
    fn private_messages_are_addressed_inputs_keyed_by_chat_and_message() {
        let (e, cb) = convert(
            &bot(),
            &message(json!({"id": 100, "type": "private"}), "hi"),
        );
        assert_eq!(
            (e.update_key.as_str(), e.chat_id.as_str(), e.chat_kind),
            ("100:9", "100", ChatKind::Private)
        );
        assert!(e.addressed && cb.is_none());
        assert_eq!(e.sender.unwrap().name.as_deref(), Some("Ann Lee"));
        assert_eq!(
            e.content,
            Content::Message {
                text: "hi".into(),
                attachments: vec![]
            }
        );
    }

    #[test]
    fn group_messages_address_the_bot_by_mention_reply_or_command() {
        let group = json!({"id": -100, "type": "supergroup"});
        assert!(
            !convert(&bot(), &message(group.clone(), "lunch?"))
                .0
                .addressed
        );
        assert!(
            convert(&bot(), &message(group.clone(), "hey @Helper_Bot what's up"))
                .0
                .addressed
        );
        assert!(
            convert(&bot(), &message(group.clone(), "/stop@helper_bot"))
                .0
                .addressed
        );
        let mut reply = message(group.clone(), "and?");
        reply["message"]["reply_to_message"] =
            json!({"message_id": 3, "from": {"id": 42, "is_bot": true, "first_name": "b"}});
        assert!(convert(&bot(), &reply).0.addressed);
        let (other, _) = convert(&bot(), &message(group, "/stop@other_bot"));
        assert!(
            matches!(other.content, Content::Unsupported { ref reason, .. } if reason.contains("@other_bot"))
        );
    }

    #[test]
    fn topics_attachments_edits_buttons_migrations_and_unknown_kinds() {
        let mut topic = message(
            json!({"id": -100, "type": "supergroup", "is_forum": true}),
            "@helper_bot hi",
        );
        topic["message"]["message_thread_id"] = json!(77);
        topic["message"]["is_topic_message"] = json!(true);
        assert_eq!(convert(&bot(), &topic).0.thread_id.as_deref(), Some("77"));

        let photo = json!({"update_id": 8, "message": {"message_id": 10, "date": 0, "chat": {"id": 1, "type": "private"},
            "photo": [{"file_id": "small", "file_unique_id": "s", "width": 1, "height": 1}, {"file_id": "big", "file_unique_id": "b", "width": 9, "height": 9, "file_size": 2048}],
            "caption": "look"}});
        let (e, _) = convert(&bot(), &photo);
        let Content::Message { text, attachments } = e.content else {
            panic!()
        };
        assert_eq!(text, "look");
        assert_eq!(
            (attachments[0].reference.as_str(), attachments[0].size),
            ("big", Some(2048))
        );

        let edit = json!({"update_id": 9, "edited_message": {"message_id": 9, "date": 0, "edit_date": 55, "chat": {"id": 1, "type": "private"}, "text": "fixed"}});
        let (e, _) = convert(&bot(), &edit);
        assert_eq!(e.update_key, "1:9:edit:55");
        assert!(
            matches!(e.content, Content::Unsupported { ref kind, .. } if kind == "edited_message")
        );
        let (e, _) = convert(
            &BotContext {
                edits: Edits::NewInput,
                ..bot()
            },
            &edit,
        );
        assert_eq!(
            e.content,
            Content::Message {
                text: "fixed".into(),
                attachments: vec![]
            }
        );

        let button = json!({"update_id": 10, "callback_query": {"id": "q1", "from": {"id": 5, "is_bot": false, "first_name": "Ann"}, "chat_instance": "x", "data": "yes",
            "message": {"message_id": 3, "date": 0, "chat": {"id": 1, "type": "private"}, "text": "ok?"}}});
        let (e, cb) = convert(&bot(), &button);
        assert_eq!(
            (e.update_key.as_str(), cb.as_deref()),
            ("cb:q1", Some("q1"))
        );
        assert_eq!(
            e.content,
            Content::Message {
                text: "yes".into(),
                attachments: vec![]
            }
        );

        let migration = json!({"update_id": 11, "message": {"message_id": 12, "date": 0, "chat": {"id": -5, "type": "group"}, "migrate_to_chat_id": -1009}});
        assert_eq!(
            convert(&bot(), &migration).0.content,
            Content::ChatMigrated {
                to_chat_id: "-1009".into()
            }
        );

        let poll = json!({"update_id": 12, "poll": {"id": "p"}});
        let (e, _) = convert(&bot(), &poll);
        assert_eq!(e.update_key, "upd:12");
        assert!(matches!(e.content, Content::Unsupported { ref kind, .. } if kind == "poll"));
    }
}
