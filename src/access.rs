//! Who may talk to a bot — in the core, once, for every channel.
//!
//! Private chats follow the account's DM policy: `open`, `allowlist`, or
//! `pairing` (an unknown user gets a short code that expires; an operator
//! admits them with `switchboard pair approve CODE`); `owners` are always
//! admitted. Group chats must be on the account's allowlist, and in them the
//! bot answers only when addressed (mentioned, replied to, commanded) unless
//! configured otherwise. Every refusal is journaled with its reason.

use rand::RngExt;
use switchboard_channel::{ChatKind, Platform};

use crate::config::{AccessConfig, DmPolicy, GroupTrigger, Messages};
use crate::store::{InboundRow, PairingState, SharedStore, StoreResult};

/// What happens to an update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// Not for the bot (a group message that did not address it, a group
    /// not on the list): journaled as `ignored`, no answer.
    Ignore(String),
    /// Refused: journaled as `refused`, with an answer when there is one.
    Refuse {
        reason: String,
        reply: Option<String>,
    },
}

/// An account's access settings with the platform's defaults applied.
#[derive(Debug, Clone)]
pub struct Access {
    dm_policy: DmPolicy,
    allow_users: Vec<String>,
    owners: Vec<String>,
    groups: Option<Vec<String>>,
    guilds: Vec<String>,
    trigger: GroupTrigger,
    ttl_minutes: u64,
}

impl Access {
    pub fn resolve(config: &AccessConfig, platform: Platform) -> Access {
        let webhook = platform == Platform::Webhook;
        Access {
            dm_policy: config.dm_policy.unwrap_or(if webhook {
                DmPolicy::Open
            } else {
                DmPolicy::Pairing
            }),
            allow_users: config.allow_users.clone(),
            owners: config.owners.clone(),
            groups: config
                .groups
                .clone()
                .or(if webhook { None } else { Some(Vec::new()) }),
            guilds: config.guilds.clone(),
            trigger: config.group_trigger.unwrap_or(if webhook {
                GroupTrigger::All
            } else {
                GroupTrigger::Mention
            }),
            ttl_minutes: config.pairing_ttl_minutes.unwrap_or(60).max(1),
        }
    }

    /// Decide about one journal row.
    pub async fn check(
        &self,
        store: &SharedStore,
        messages: &Messages,
        row: &InboundRow,
        now: i64,
    ) -> StoreResult<Decision> {
        let sender = row.sender_id.as_deref().unwrap_or_default();
        if row.chat_kind == ChatKind::Group {
            let in_allowed_guild = row.space.as_ref().is_some_and(|g| self.guilds.contains(g));
            if let Some(groups) = &self.groups
                && !groups.contains(&row.chat_id)
                && !in_allowed_guild
                && !self.allowed_before_migration(store, row, groups).await?
            {
                return Ok(Decision::Ignore(match &row.space {
                    Some(guild) => format!(
                        "channel {} (guild {guild}) is on neither access.groups nor access.guilds",
                        row.chat_id
                    ),
                    None => format!(
                        "group chat {} is not on this account's access.groups list",
                        row.chat_id
                    ),
                }));
            }
            if self.trigger == GroupTrigger::Mention && !row.addressed {
                return Ok(Decision::Ignore(
                    "not addressed to the bot (access.group_trigger = \"mention\")".into(),
                ));
            }
            return Ok(Decision::Allow);
        }
        if self.owners.iter().any(|o| o == sender) {
            return Ok(Decision::Allow);
        }
        match self.dm_policy {
            DmPolicy::Open => Ok(Decision::Allow),
            DmPolicy::Allowlist if self.allow_users.iter().any(|u| u == sender) => {
                Ok(Decision::Allow)
            }
            DmPolicy::Allowlist => Ok(Decision::Refuse {
                reason: format!("user {sender} is not on access.allow_users"),
                reply: Some(messages.not_allowed.clone()),
            }),
            DmPolicy::Pairing => {
                if let Some(p) = store.pairing_get(&row.account, sender).await?
                    && p.state == PairingState::Approved
                {
                    return Ok(Decision::Allow);
                }
                let pairing = store
                    .pairing_issue(
                        &row.account,
                        sender,
                        row.sender_name.as_deref(),
                        &new_code(),
                        now,
                        now + (self.ttl_minutes * 60_000) as i64,
                    )
                    .await?;
                Ok(Decision::Refuse {
                    reason: format!("pairing required (code {})", pairing.code),
                    reply: Some(
                        messages
                            .pairing
                            .replace("{code}", &pairing.code)
                            .replace("{minutes}", &self.ttl_minutes.to_string()),
                    ),
                })
            }
        }
    }
}

/// A short code that is easy to read out: no 0/O, 1/I/L.
impl Access {
    /// A group allowed under an old id stays allowed after it migrated
    /// (a Telegram group upgraded to a supergroup gets a new id).
    async fn allowed_before_migration(
        &self,
        store: &SharedStore,
        row: &InboundRow,
        groups: &[String],
    ) -> StoreResult<bool> {
        let origins = store.chat_origins(&row.account, &row.chat_id).await?;
        Ok(origins.iter().any(|old| groups.contains(old)))
    }
}

fn new_code() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHJKMNPQRSTUVWXYZ23456789";
    let mut rng = rand::rng();
    (0..6)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_six_readable_characters() {
        for _ in 0..100 {
            let c = new_code();
            assert_eq!(c.len(), 6);
            assert!(
                c.chars()
                    .all(|ch| ch.is_ascii_uppercase() || ch.is_ascii_digit())
            );
            assert!(!c.contains(['0', 'O', '1', 'I', 'L']));
        }
    }

    #[test]
    fn platform_defaults() {
        let webhook = Access::resolve(&AccessConfig::default(), Platform::Webhook);
        assert_eq!(
            (webhook.dm_policy, webhook.groups.clone(), webhook.trigger),
            (DmPolicy::Open, None, GroupTrigger::All)
        );
        let telegram = Access::resolve(&AccessConfig::default(), Platform::Telegram);
        assert_eq!(
            (
                telegram.dm_policy,
                telegram.groups.clone(),
                telegram.trigger
            ),
            (DmPolicy::Pairing, Some(vec![]), GroupTrigger::Mention)
        );
    }
}
