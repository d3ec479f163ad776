//! Chat commands, in the core so every channel has them: `/stop`, `/new`,
//! `/help`, and the scheduler's `/remind`, `/schedules`, `/cancel`,
//! `/timezone`.
//!
//! A command is recognised in the text of a message (`/cmd` or `!cmd`);
//! `/cmd@name` is the
//! same command (platforms append the bot's name in groups; whether it names
//! *this* bot is the channel's business). Anything else starting with `/` is
//! an ordinary message for the runtime.

/// A command the core handles itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Interrupt the running answer and cancel waiting inputs.
    Stop,
    /// Start a new conversation (fresh history) for this chat.
    New,
    /// List the commands.
    Help,
    /// Set a reminder (`/remind in 10m text`).
    Remind,
    /// List this chat's schedules.
    Schedules,
    /// Cancel one of this chat's schedules.
    Cancel,
    /// Show or set the chat's time zone.
    Timezone,
}

impl Command {
    pub fn name(self) -> &'static str {
        match self {
            Command::Stop => "/stop",
            Command::New => "/new",
            Command::Help => "/help",
            Command::Remind => "/remind",
            Command::Schedules => "/schedules",
            Command::Cancel => "/cancel",
            Command::Timezone => "/timezone",
        }
    }
}

/// The commands as a platform's command menu shows them (Telegram
/// `setMyCommands`): name without the slash, and a short description.
pub const MENU: [(&str, &str); 7] = [
    ("help", "What this bot can do"),
    (
        "stop",
        "Stop the answer being written and drop waiting messages",
    ),
    ("new", "Start a new conversation"),
    ("remind", "Set a reminder: /remind in 10m tea"),
    ("schedules", "List this chat's reminders and schedules"),
    ("cancel", "Cancel a schedule: /cancel ID"),
    (
        "timezone",
        "Show or set this chat's time zone: /timezone Europe/Berlin",
    ),
];

/// The command a message's text is, if any, with its arguments.
pub fn parse(text: &str) -> Option<(Command, &str)> {
    let text = text.trim_start();
    let (word, args) = text
        .split_once(char::is_whitespace)
        .map_or((text, ""), |(w, a)| (w, a.trim()));
    // `!stop` is the same command: Discord users expect the `!` form.
    let name = word.strip_prefix('/').or_else(|| word.strip_prefix('!'))?;
    let name = name.split_once('@').map_or(name, |(n, _)| n);
    let command = match name.to_ascii_lowercase().as_str() {
        "stop" => Command::Stop,
        "new" | "reset" => Command::New,
        "help" | "start" => Command::Help,
        "remind" => Command::Remind,
        "schedules" => Command::Schedules,
        "cancel" => Command::Cancel,
        "timezone" | "tz" => Command::Timezone,
        _ => return None,
    };
    Some((command, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_recognised_with_or_without_a_bot_name() {
        assert_eq!(parse("/stop"), Some((Command::Stop, "")));
        assert_eq!(parse("  /STOP please"), Some((Command::Stop, "please")));
        assert_eq!(parse("/stop@my_bot"), Some((Command::Stop, "")));
        assert_eq!(parse("/new"), Some((Command::New, "")));
        assert_eq!(parse("/help"), Some((Command::Help, "")));
        assert_eq!(
            parse("/remind in 10m tea"),
            Some((Command::Remind, "in 10m tea"))
        );
        assert_eq!(parse("/cancel 12"), Some((Command::Cancel, "12")));
        assert_eq!(parse("/weather in Paris"), None);
        assert_eq!(parse("stop"), None);
        assert_eq!(parse("!stop"), Some((Command::Stop, "")));
        assert_eq!(parse("!new"), Some((Command::New, "")));
        assert_eq!(parse("!weather"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("please /stop"), None);
    }
}
