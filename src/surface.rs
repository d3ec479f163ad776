//! Surfaces: where a conversation lives and how its output is seen
//! (DESIGN.md §2), and the settings each one carries.

use serde::{Deserialize, Serialize};
pub use switchboard_channel::InputPolicy;
use switchboard_channel::{ChatKind, Platform};

/// A surface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SurfaceKind {
    TelegramPrivate,
    TelegramGroup,
    DiscordDm,
    DiscordGuild,
    Webhook,
    Schedule,
    Admin,
}

impl SurfaceKind {
    pub const ALL: [SurfaceKind; 7] = [
        SurfaceKind::TelegramPrivate,
        SurfaceKind::TelegramGroup,
        SurfaceKind::DiscordDm,
        SurfaceKind::DiscordGuild,
        SurfaceKind::Webhook,
        SurfaceKind::Schedule,
        SurfaceKind::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SurfaceKind::TelegramPrivate => "telegram.private",
            SurfaceKind::TelegramGroup => "telegram.group",
            SurfaceKind::DiscordDm => "discord.dm",
            SurfaceKind::DiscordGuild => "discord.guild",
            SurfaceKind::Webhook => "webhook",
            SurfaceKind::Schedule => "schedule",
            SurfaceKind::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<SurfaceKind> {
        SurfaceKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The surface of an update from `platform` in a chat of `kind`.
    pub fn of(platform: Platform, kind: ChatKind) -> SurfaceKind {
        match (platform, kind) {
            (Platform::Webhook, _) => SurfaceKind::Webhook,
            (Platform::Telegram, ChatKind::Private) => SurfaceKind::TelegramPrivate,
            (Platform::Telegram, ChatKind::Group) => SurfaceKind::TelegramGroup,
            (Platform::Discord, ChatKind::Private) => SurfaceKind::DiscordDm,
            (Platform::Discord, ChatKind::Group) => SurfaceKind::DiscordGuild,
        }
    }

    /// A chat of several people (group rate limits apply).
    pub fn is_group(self) -> bool {
        matches!(self, SurfaceKind::TelegramGroup | SurfaceKind::DiscordGuild)
    }

    /// The defaults of DESIGN.md §2.
    pub fn defaults(self) -> Defaults {
        use Delivery::*;
        use OnAmbiguousSend::*;
        let (delivery, on_ambiguous_send) = match self {
            SurfaceKind::TelegramPrivate => (Streaming, Resend),
            SurfaceKind::TelegramGroup => (TerminalOnly, Resend),
            SurfaceKind::DiscordDm => (Streaming, Idempotent),
            SurfaceKind::DiscordGuild => (TerminalOnly, Idempotent),
            SurfaceKind::Webhook => (TerminalOnly, Idempotent),
            // A schedule's output goes to its target conversation, whose
            // surface decides; these apply only when there is none.
            SurfaceKind::Schedule | SurfaceKind::Admin => (TerminalOnly, Idempotent),
        };
        Defaults {
            input_policy: InputPolicy::Queue,
            delivery,
            on_ambiguous_send,
        }
    }
}

impl Serialize for SurfaceKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for SurfaceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the answer is sent once at the end or shown growing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    TerminalOnly,
    Streaming,
}

/// What reconciliation does with a possibly-dispatched item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnAmbiguousSend {
    /// Wait for an operator.
    Hold,
    /// Send again (at least once; counted as a possible duplicate).
    Resend,
    /// Send again with the platform's idempotency key.
    Idempotent,
}

impl OnAmbiguousSend {
    pub fn as_str(self) -> &'static str {
        match self {
            OnAmbiguousSend::Hold => "hold",
            OnAmbiguousSend::Resend => "resend",
            OnAmbiguousSend::Idempotent => "idempotent",
        }
    }
}

/// A surface's built-in defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defaults {
    pub input_policy: InputPolicy,
    pub delivery: Delivery,
    pub on_ambiguous_send: OnAmbiguousSend,
}

/// Queued inputs per conversation beyond which a new one is refused.
pub const DEFAULT_MAX_QUEUED_INPUTS: usize = 32;

/// `[surfaces.NAME]`: each key overrides the surface's default when set.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SurfaceSettings {
    /// `queue` (default), `inject`, `interrupt`, `interrupt-next`,
    /// `supersede` or `auto`.
    #[serde(default)]
    pub input_policy: Option<InputPolicy>,
    /// `terminal-only` or `streaming`.
    #[serde(default)]
    pub delivery: Option<Delivery>,
    /// `hold`, `resend` or `idempotent`.
    #[serde(default)]
    pub on_ambiguous_send: Option<OnAmbiguousSend>,
    /// At most one queued successor per conversation; later inputs join it
    /// (default false).
    #[serde(default)]
    pub coalesce_pending: Option<bool>,
    /// Queued inputs per conversation beyond which a new input is refused
    /// with a visible reply (default 32).
    #[serde(default)]
    pub max_queued_inputs: Option<usize>,
    /// With `inject`: cut the current model call at once and continue the
    /// same run with the new input, instead of waiting for the call to end
    /// (default false).
    #[serde(default)]
    pub soft_interrupt: Option<bool>,
}

impl SurfaceSettings {
    /// These settings with `over`'s set keys on top.
    pub fn overlay(&self, over: &SurfaceSettings) -> SurfaceSettings {
        SurfaceSettings {
            input_policy: over.input_policy.or(self.input_policy),
            delivery: over.delivery.or(self.delivery),
            on_ambiguous_send: over.on_ambiguous_send.or(self.on_ambiguous_send),
            coalesce_pending: over.coalesce_pending.or(self.coalesce_pending),
            max_queued_inputs: over.max_queued_inputs.or(self.max_queued_inputs),
            soft_interrupt: over.soft_interrupt.or(self.soft_interrupt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_surface_name_round_trips() {
        for kind in SurfaceKind::ALL {
            assert_eq!(SurfaceKind::parse(kind.as_str()), Some(kind));
        }
    }

    #[test]
    fn defaults_follow_the_design_table() {
        assert_eq!(
            SurfaceKind::TelegramPrivate.defaults().delivery,
            Delivery::Streaming
        );
        assert_eq!(
            SurfaceKind::TelegramGroup.defaults().delivery,
            Delivery::TerminalOnly
        );
        assert_eq!(
            SurfaceKind::DiscordGuild.defaults().on_ambiguous_send,
            OnAmbiguousSend::Idempotent
        );
        assert_eq!(
            SurfaceKind::TelegramPrivate.defaults().on_ambiguous_send,
            OnAmbiguousSend::Resend
        );
        assert_eq!(
            SurfaceKind::Webhook.defaults().input_policy,
            InputPolicy::Queue
        );
    }
}
