//! Discord messages (gateway events and REST history alike) to envelopes.

use serenity::model::channel::{Message, MessageType};
use switchboard_channel::{AttachmentRef, ChatKind, Content, Envelope, Sender};

/// Where a channel sits: a DM, a guild channel, or a thread of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelInfo {
    pub channel_id: u64,
    /// `None` for DMs.
    pub guild_id: Option<u64>,
    /// For threads: the channel the thread belongs to.
    pub parent_id: Option<u64>,
}

impl ChannelInfo {
    /// The conversation's chat and thread: a thread is a conversation of
    /// its own inside its parent channel.
    pub fn chat_and_thread(&self) -> (String, Option<String>) {
        match self.parent_id {
            Some(parent) => (parent.to_string(), Some(self.channel_id.to_string())),
            None => (self.channel_id.to_string(), None),
        }
    }
}

/// What the converter needs to know about the bot and the account.
#[derive(Debug, Clone)]
pub struct BotContext {
    pub account: String,
    pub user_id: u64,
    pub allow_bots: bool,
}

/// Remove mentions of the bot (`<@id>`, `<@!id>`) and trim, so a command
/// after a mention is still a command.
pub fn strip_mentions(text: &str, bot: u64) -> String {
    text.replace(&format!("<@{bot}>"), "")
        .replace(&format!("<@!{bot}>"), "")
        .trim()
        .to_owned()
}

fn is_command(text: &str) -> bool {
    text.starts_with('/') || text.starts_with('!')
}

/// A message as an envelope; `None` for the bot's own messages (they are
/// ours, not inputs, and the gateway echoes every one of them).
pub fn convert(
    bot: &BotContext,
    message: &Message,
    channel: ChannelInfo,
    key: String,
) -> Option<Envelope> {
    if message.author.id.get() == bot.user_id {
        return None;
    }
    let (chat_id, thread_id) = channel.chat_and_thread();
    let chat_kind = if channel.guild_id.is_some() {
        ChatKind::Group
    } else {
        ChatKind::Private
    };
    let base = Envelope {
        account: bot.account.clone(),
        update_key: key,
        chat_id,
        chat_kind,
        thread_id,
        space: channel.guild_id.map(|g| g.to_string()),
        sender: Some(Sender {
            id: message.author.id.to_string(),
            name: Some(
                message
                    .author
                    .global_name
                    .clone()
                    .unwrap_or_else(|| message.author.name.clone()),
            ),
            is_bot: message.author.bot,
        }),
        message_id: Some(message.id.to_string()),
        content: Content::Message {
            text: String::new(),
            attachments: Vec::new(),
        },
        input_policy: None,
        addressed: chat_kind == ChatKind::Private,
    };
    let unsupported = |kind: &str, reason: String| Envelope {
        content: Content::Unsupported {
            kind: kind.to_owned(),
            reason,
        },
        addressed: false,
        ..base.clone()
    };
    if (message.author.bot || message.webhook_id.is_some()) && !bot.allow_bots {
        return Some(unsupported(
            "bot_message",
            format!(
                "from a bot or webhook (channels.{}.allow_bots = false)",
                bot.account
            ),
        ));
    }
    if !matches!(
        message.kind,
        MessageType::Regular | MessageType::InlineReply
    ) {
        let number: u8 = message.kind.into();
        return Some(unsupported(
            &format!("message_type_{number}"),
            format!("Discord message type {number} (a system message) is not an input"),
        ));
    }
    let text = strip_mentions(&message.content, bot.user_id);
    let attachments: Vec<AttachmentRef> = message
        .attachments
        .iter()
        .map(|a| AttachmentRef {
            reference: a.url.clone(),
            media_type: a.content_type.clone(),
            size: Some(u64::from(a.size)),
            filename: Some(a.filename.clone()),
        })
        .collect();
    if text.is_empty() && attachments.is_empty() {
        return Some(unsupported(
            "empty",
            "the message has no text or files (without the Message Content intent, guild messages arrive empty unless they mention the bot)".into(),
        ));
    }
    let mentioned = message.mentions.iter().any(|u| u.id.get() == bot.user_id);
    let replied_to_bot = message
        .referenced_message
        .as_ref()
        .is_some_and(|m| m.author.id.get() == bot.user_id);
    Some(Envelope {
        addressed: base.addressed || mentioned || replied_to_bot || is_command(&text),
        content: Content::Message { text, attachments },
        ..base
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(value: serde_json::Value) -> Message {
        let mut base = json!({
            "id": "1000", "channel_id": "50", "content": "", "timestamp": "2026-11-30T10:00:00.000000+00:00",
            "edited_timestamp": null, "tts": false, "mention_everyone": false, "mentions": [], "mention_roles": [],
            "attachments": [], "embeds": [], "pinned": false, "type": 0,
            "author": {"id": "7", "username": "ann", "global_name": "Ann", "discriminator": "0", "avatar": null}
        });
        for (k, v) in value.as_object().unwrap() {
            base[k] = v.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    fn bot() -> BotContext {
        BotContext {
            account: "dc".into(),
            user_id: 99,
            allow_bots: false,
        }
    }

    const DM: ChannelInfo = ChannelInfo {
        channel_id: 50,
        guild_id: None,
        parent_id: None,
    };
    const THREAD: ChannelInfo = ChannelInfo {
        channel_id: 51,
        guild_id: Some(3),
        parent_id: Some(50),
    };

    #[test]
    fn dms_threads_mentions_commands_and_attachments() {
        let e = convert(
            &bot(),
            &message(json!({"content": "hi"})),
            DM,
            "1000".into(),
        )
        .unwrap();
        assert_eq!(
            (e.chat_id.as_str(), e.chat_kind, e.addressed),
            ("50", ChatKind::Private, true)
        );

        let m = message(
            json!({"content": "<@99> !stop", "mentions": [{"id": "99", "username": "bot", "discriminator": "0", "avatar": null, "bot": true}]}),
        );
        let e = convert(&bot(), &m, THREAD, "1000".into()).unwrap();
        assert_eq!(
            (
                e.chat_id.as_str(),
                e.thread_id.as_deref(),
                e.space.as_deref()
            ),
            ("50", Some("51"), Some("3"))
        );
        assert!(e.addressed);
        assert_eq!(
            e.content,
            Content::Message {
                text: "!stop".into(),
                attachments: vec![]
            }
        );

        let chatter = convert(
            &bot(),
            &message(json!({"content": "lunch?"})),
            THREAD,
            "1".into(),
        )
        .unwrap();
        assert!(!chatter.addressed);

        let file = message(
            json!({"attachments": [{"id": "5", "filename": "a.png", "size": 12, "url": "https://cdn/a.png", "proxy_url": "https://p/a.png", "content_type": "image/png"}]}),
        );
        let e = convert(&bot(), &file, DM, "1".into()).unwrap();
        let Content::Message { attachments, .. } = e.content else {
            panic!()
        };
        assert_eq!(attachments[0].reference, "https://cdn/a.png");
        assert_eq!(attachments[0].size, Some(12));
    }

    #[test]
    fn own_messages_vanish_bots_and_system_messages_are_ignored_with_reasons() {
        let own = message(
            json!({"content": "x", "author": {"id": "99", "username": "bot", "discriminator": "0", "avatar": null, "bot": true}}),
        );
        assert!(convert(&bot(), &own, DM, "1".into()).is_none());
        let other = message(
            json!({"content": "x", "author": {"id": "8", "username": "b2", "discriminator": "0", "avatar": null, "bot": true}}),
        );
        let e = convert(&bot(), &other, DM, "1".into()).unwrap();
        assert!(
            matches!(e.content, Content::Unsupported { ref kind, .. } if kind == "bot_message")
        );
        let join = message(json!({"type": 7}));
        let e = convert(&bot(), &join, DM, "1".into()).unwrap();
        assert!(
            matches!(e.content, Content::Unsupported { ref kind, .. } if kind == "message_type_7")
        );
        let empty = message(json!({}));
        let e = convert(&bot(), &empty, THREAD, "1".into()).unwrap();
        assert!(
            matches!(e.content, Content::Unsupported { ref reason, .. } if reason.contains("Message Content"))
        );
    }
}
