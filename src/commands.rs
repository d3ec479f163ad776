//! Chat commands, in the core so every channel has them: `/stop`, `/new`,
//! `/help`. (The scheduler adds its own to the same router.)
//!
//! A command is recognised in the text of a message; `/cmd@name` is the
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
}

impl Command {
    pub fn name(self) -> &'static str {
        match self {
            Command::Stop => "/stop",
            Command::New => "/new",
            Command::Help => "/help",
        }
    }
}

/// The command a message's text is, if any.
pub fn parse(text: &str) -> Option<Command> {
    let word = text.split_whitespace().next()?;
    let name = word.strip_prefix('/')?;
    let name = name.split_once('@').map_or(name, |(n, _)| n);
    match name.to_ascii_lowercase().as_str() {
        "stop" => Some(Command::Stop),
        "new" | "reset" => Some(Command::New),
        "help" | "start" => Some(Command::Help),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_recognised_with_or_without_a_bot_name() {
        assert_eq!(parse("/stop"), Some(Command::Stop));
        assert_eq!(parse("  /STOP please"), Some(Command::Stop));
        assert_eq!(parse("/stop@my_bot"), Some(Command::Stop));
        assert_eq!(parse("/new"), Some(Command::New));
        assert_eq!(parse("/help"), Some(Command::Help));
        assert_eq!(parse("/weather in Paris"), None);
        assert_eq!(parse("stop"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("please /stop"), None);
    }
}
