//! The `switchboard` command: parse the command line, load config, set up
//! logging, call the library. Nothing else lives here.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use futures::StreamExt;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use switchboard::config::{Config, ConfigError, EXIT_CONFIG, LogFormat};
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{self, DispatchState, Disposition, RunState};

#[derive(Parser)]
#[command(
    name = "switchboard",
    version,
    about = "A channel-bridge daemon: chat platforms in, an agent runtime in the middle, a durable outbox out."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ConfigArg {
    /// The config file.
    #[arg(
        long,
        short,
        env = "SWITCHBOARD_CONFIG",
        default_value = "config/switchboard.toml"
    )]
    config: PathBuf,
}

// Parsed once per process; boxing clap's arguments would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM or SIGINT.
    Run(ConfigArg),
    /// Validate a config file offline; exit 78 when it is bad.
    Check(ConfigArg),
    /// Create the store and apply migrations, then exit.
    Migrate(ConfigArg),
    /// Copy a SQLite store into a new, empty PostgreSQL store (moving a
    /// deployment to several processes). Stop the daemon first.
    CopyStore {
        /// The SQLite store: sqlite://PATH (the old `store.url`).
        #[arg(long)]
        from: String,
        /// The PostgreSQL store: postgres://USER@HOST:PORT/DB (empty; the
        /// schema is created).
        #[arg(long)]
        to: String,
    },
    /// Run the whole loop in-process on a temporary store and show each step.
    Demo,
    /// The inbound journal.
    Inbound {
        #[command(subcommand)]
        command: InboundCommand,
    },
    /// The outbox.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Runs of the built-in runtime.
    Runs {
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// Durable schedules: reminders and recurring prompts.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
    /// Pairing of direct-message users (accounts with dm_policy = "pairing").
    Pair {
        #[command(subcommand)]
        command: PairCommand,
    },
    /// The built-in runtime as a server of the runtime protocol.
    Runtime {
        #[command(subcommand)]
        command: RuntimeCommand,
    },
    /// Remove personal data on request.
    Purge {
        #[command(subcommand)]
        command: PurgeCommand,
    },
    /// Check the config, the store, each channel's token, the runtimes, the
    /// admin bind and secret file permissions; exit 1 when something fails.
    Doctor(ConfigArg),
}

#[derive(Subcommand)]
enum RuntimeCommand {
    /// Serve the runtime named by `[serve]` over docs/runtime-protocol.md
    /// until SIGTERM or SIGINT.
    Serve(ConfigArg),
}

#[derive(Subcommand)]
enum PurgeCommand {
    /// Remove one conversation's messages, runs and replies in one
    /// transaction. Its journal keys stay as tombstones, so a late
    /// redelivery cannot recreate it. Refused while a run of it is active.
    Conversation {
        #[command(flatten)]
        config: ConfigArg,
        /// The conversation id (`switchboard inbound list` shows it).
        id: i64,
    },
}

#[derive(Subcommand)]
enum PairCommand {
    /// Pairings, newest first: pending codes and who was approved or revoked.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only this channel account's (its configured name).
        #[arg(long)]
        account: Option<String>,
    },
    /// Admit the user who was given this code.
    Approve {
        #[command(flatten)]
        config: ConfigArg,
        code: String,
    },
    /// Stop admitting a user.
    Revoke {
        #[command(flatten)]
        config: ConfigArg,
        /// The channel account's configured name.
        #[arg(long)]
        account: String,
        /// The platform user id.
        user: String,
    },
}

// Parsed once per process; boxing clap's arguments would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum ScheduleCommand {
    /// Add a schedule (a running daemon picks it up).
    Add {
        #[command(flatten)]
        config: ConfigArg,
        /// The channel account's configured name.
        #[arg(long)]
        account: String,
        /// The chat to deliver to.
        #[arg(long)]
        chat: String,
        #[arg(long)]
        thread: Option<String>,
        /// private (default) or group.
        #[arg(long)]
        chat_kind: Option<String>,
        /// An instant: RFC 3339 with offset, or "2026-12-24 18:00" with --timezone.
        #[arg(long, group = "when")]
        at: Option<String>,
        /// A duration from now: 10m, 2h30m, 1d.
        #[arg(long, group = "when")]
        after: Option<String>,
        /// A cron expression (needs --timezone): "0 9 * * MON-FRI".
        #[arg(long, group = "when")]
        every: Option<String>,
        /// An IANA time zone, e.g. Europe/Berlin.
        #[arg(long)]
        timezone: Option<String>,
        /// Deliver this text to the chat.
        #[arg(long, group = "what")]
        message: Option<String>,
        /// Submit this text to the runtime as an input of the chat's conversation.
        #[arg(long, group = "what")]
        prompt: Option<String>,
        /// skip, fire-once or fire-all.
        #[arg(long)]
        missed: Option<String>,
        #[arg(long)]
        max_attempts: Option<i64>,
    },
    /// Schedules, newest first.
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        account: Option<String>,
        #[arg(long)]
        chat: Option<String>,
        /// active, paused, completed, failed, cancelled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// One schedule and its recent occurrences.
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
    },
    /// Stop firing until resumed.
    Pause {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
    },
    /// Fire again (missed slots follow the schedule's missed-run policy).
    Resume {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
    },
    /// Never fire again.
    Cancel {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
    },
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct ResolveAction {
    /// The message did reach the user: mark it acknowledged.
    #[arg(long)]
    as_sent: bool,
    /// Send it again now.
    #[arg(long)]
    resend: bool,
    /// Do not send it: mark it dropped.
    #[arg(long)]
    drop: bool,
}

#[derive(Subcommand)]
enum RunsCommand {
    /// Runs, newest first: mode, state, what they answered.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only runs of this conversation.
        #[arg(long)]
        conversation: Option<i64>,
        /// Only runs in this state (queued, running, interrupt_requested, completed, interrupted, superseded, absorbed, cancelled, failed).
        #[arg(long)]
        state: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

#[derive(Subcommand)]
enum InboundCommand {
    /// Journal rows, newest first.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only rows with this disposition (pending, admitted, ignored, rejected, refused, failed, cancelled, absorbed).
        #[arg(long)]
        disposition: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Settle a held item: it arrived (--as-sent), send it again (--resend), or never send it (--drop).
    Resolve {
        #[command(flatten)]
        config: ConfigArg,
        /// The item's id (from `outbox list --state held`).
        id: i64,
        #[command(flatten)]
        action: ResolveAction,
    },
    /// Reply items, newest first.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only items in this dispatch state (not_dispatched, possibly_dispatched, acknowledged, failed, held, dropped).
        #[arg(long)]
        state: Option<String>,
        /// Only items of this conversation.
        #[arg(long)]
        conversation: Option<i64>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("switchboard: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(dispatch(cli.command))
}

async fn dispatch(command: Command) -> ExitCode {
    match command {
        Command::Run(args) => {
            let config = match load(&args) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let log = init_logging(&config.log.level, config.log.format);
            run_daemon(config, &args.config, log).await
        }
        Command::Check(args) => match load(&args) {
            Ok(config) => {
                use switchboard::config::ChannelConfig;
                for (name, channel) in &config.channels {
                    let unreadable = match channel {
                        ChannelConfig::Webhook(w) => {
                            w.resolve_secret().err().map(|e| ("secret_file", e))
                        }
                        ChannelConfig::Telegram(t) => t
                            .resolve_token()
                            .and_then(|token| switchboard_telegram::identity(&token))
                            .err()
                            .map(|e| ("token_file", e)),
                        ChannelConfig::Discord(d) => d
                            .resolve_token()
                            .and_then(|token| switchboard_discord::identity(&token))
                            .err()
                            .map(|e| ("token_file", e)),
                    };
                    if let Some((key, e)) = unreadable {
                        println!(
                            "warning: channels.{name}.{key}: {e} (the daemon will refuse to start)"
                        );
                    }
                }
                println!(
                    "{}: ok ({} channel account(s), {} runtime(s))",
                    args.config.display(),
                    config.channels.len(),
                    config.runtimes.len()
                );
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Migrate(args) => {
            let config = match load(&args) {
                Ok(c) => c,
                Err(code) => return code,
            };
            match store::open(&config.store, OpenMode::Tool).await {
                Ok(store) => {
                    println!("{}: migrations applied", store.describe());
                    store.close().await;
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        Command::CopyStore { from, to } => {
            match store::copy::sqlite_to_postgres(&from, &to).await {
                Ok(report) => {
                    for (table, rows) in &report.tables {
                        println!("{table}: {rows}");
                    }
                    println!(
                        "copied {} rows; now set store.url = \"{to}\" and start the daemons",
                        report.total()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        Command::Demo => {
            init_logging("warn", LogFormat::Text);
            match switchboard::demo::run().await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("demo failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Inbound {
            command:
                InboundCommand::List {
                    config,
                    disposition,
                    limit,
                },
        } => {
            let disposition = match parse_choice(
                disposition,
                "disposition",
                Disposition::parse,
                Disposition::ALL,
                Disposition::as_str,
            ) {
                Ok(d) => d,
                Err(code) => return code,
            };
            let store = match open_store(&config).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            print_or_fail(switchboard::cli::inbound_list(&store, disposition, limit).await)
        }
        Command::Outbox {
            command:
                OutboxCommand::List {
                    config,
                    state,
                    conversation,
                    limit,
                },
        } => {
            let state = match parse_choice(
                state,
                "dispatch state",
                DispatchState::parse,
                DispatchState::ALL,
                DispatchState::as_str,
            ) {
                Ok(s) => s,
                Err(code) => return code,
            };
            let store = match open_store(&config).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            print_or_fail(switchboard::cli::outbox_list(&store, state, conversation, limit).await)
        }
        Command::Outbox {
            command: OutboxCommand::Resolve { config, id, action },
        } => {
            let resolution = if action.as_sent {
                store::Resolution::AsSent
            } else if action.resend {
                store::Resolution::Resend
            } else {
                store::Resolution::Drop
            };
            let store = match open_store(&config).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            let now = switchboard::clock::Clock::now_ms(&switchboard::clock::SystemClock);
            match store.outbox_resolve(id, resolution, now).await {
                Ok(true) => {
                    println!("outbox item {id}: resolved ({resolution:?})");
                    ExitCode::SUCCESS
                }
                Ok(false) => {
                    eprintln!(
                        "switchboard: outbox item {id} is not held; see `switchboard outbox list --state held`"
                    );
                    ExitCode::from(1)
                }
                Err(e) => fail(e),
            }
        }
        Command::Schedule { command } => schedule_command(command).await,
        Command::Pair { command } => pair_command(command).await,
        Command::Purge {
            command: PurgeCommand::Conversation { config, id },
        } => {
            let store = match open_store(&config).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            let now = switchboard::clock::Clock::now_ms(&switchboard::clock::SystemClock);
            let outcome = store.purge_conversation(id, now).await;
            store.close().await;
            match outcome {
                Ok(store::PurgeOutcome::Purged {
                    inbound,
                    runs,
                    outbox,
                }) => {
                    println!(
                        "conversation {id} purged: {inbound} journal rows kept as key-only tombstones, {runs} runs and {outbox} replies removed"
                    );
                    ExitCode::SUCCESS
                }
                Ok(store::PurgeOutcome::NotFound) => {
                    eprintln!(
                        "switchboard: no conversation {id}; `switchboard inbound list` shows conversation ids"
                    );
                    ExitCode::from(2)
                }
                Ok(store::PurgeOutcome::Busy(why)) => {
                    eprintln!("switchboard: not purged: {why}");
                    ExitCode::from(3)
                }
                Err(e) => fail(e),
            }
        }
        Command::Runtime {
            command: RuntimeCommand::Serve(args),
        } => {
            let config = match load(&args) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let _log = init_logging(&config.log.level, config.log.format);
            let grace = std::time::Duration::from_secs(config.shutdown.grace_secs);
            let force = std::time::Duration::from_secs(config.shutdown.force_secs);
            let server = match switchboard::serve::Server::start(config).await {
                Ok(s) => s,
                Err(e) => return fail(format!("{e:#}")),
            };
            println!("serving the runtime protocol on http://{}", server.addr);
            let mut signals = match signal_hook_tokio::Signals::new([SIGTERM, SIGINT]) {
                Ok(s) => s,
                Err(e) => return fail(format!("cannot listen for signals: {e}")),
            };
            let _ = signals.next().await;
            server.shutdown(grace, force).await;
            ExitCode::SUCCESS
        }
        Command::Doctor(args) => match switchboard::doctor::run(&args.config).await {
            true => ExitCode::SUCCESS,
            false => ExitCode::FAILURE,
        },
        Command::Runs {
            command:
                RunsCommand::List {
                    config,
                    conversation,
                    state,
                    limit,
                },
        } => {
            let state = match parse_choice(
                state,
                "run state",
                RunState::parse,
                RunState::ALL,
                RunState::as_str,
            ) {
                Ok(s) => s,
                Err(code) => return code,
            };
            let store = match open_store(&config).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            print_or_fail(switchboard::cli::runs_list(&store, conversation, state, limit).await)
        }
    }
}

async fn pair_command(command: PairCommand) -> ExitCode {
    let now = switchboard::clock::Clock::now_ms(&switchboard::clock::SystemClock);
    let config_arg = match &command {
        PairCommand::List { config, .. }
        | PairCommand::Approve { config, .. }
        | PairCommand::Revoke { config, .. } => config,
    };
    let store = match open_store(config_arg).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let identity = |name: String| {
        let store = store.clone();
        async move {
            match store.channel_account(&name).await {
                Ok(Some((identity, _))) => Ok(identity),
                Ok(None) => {
                    eprintln!(
                        "switchboard: no channel account named {name:?} has run on this store"
                    );
                    Err(ExitCode::from(2))
                }
                Err(e) => Err(fail(e)),
            }
        }
    };
    match command {
        PairCommand::List { account, .. } => {
            let account = match account {
                Some(name) => match identity(name).await {
                    Ok(id) => Some(id),
                    Err(code) => return code,
                },
                None => None,
            };
            match store.pairing_list(account.as_deref(), 200).await {
                Ok(rows) => {
                    let mut table = switchboard::cli::Table::new(vec![
                        "ACCOUNT", "USER", "NAME", "CODE", "STATE", "EXPIRES",
                    ]);
                    for p in rows {
                        table.row(vec![
                            p.account,
                            p.user_id,
                            p.user_name.unwrap_or_else(|| "-".into()),
                            p.code,
                            p.state.to_string(),
                            switchboard::schedule::spec::show(p.expires_at, None),
                        ]);
                    }
                    print!("{}", table.render());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        PairCommand::Approve { code, .. } => match store.pairing_approve(&code, now).await {
            Ok(Some(p)) => {
                println!(
                    "approved {} ({}) on {}",
                    p.user_id,
                    p.user_name.as_deref().unwrap_or("no name"),
                    p.account
                );
                ExitCode::SUCCESS
            }
            Ok(None) => {
                eprintln!(
                    "switchboard: no pending pairing with code {code:?}; it may have expired (the user gets a new one with their next message). See `switchboard pair list`."
                );
                ExitCode::from(1)
            }
            Err(e) => fail(e),
        },
        PairCommand::Revoke { account, user, .. } => {
            let account = match identity(account).await {
                Ok(id) => id,
                Err(code) => return code,
            };
            match store.pairing_revoke(&account, &user, now).await {
                Ok(true) => {
                    println!("revoked {user} on {account}");
                    ExitCode::SUCCESS
                }
                Ok(false) => {
                    eprintln!("switchboard: {user} has no pairing on {account}");
                    ExitCode::from(1)
                }
                Err(e) => fail(e),
            }
        }
    }
}

async fn schedule_command(command: ScheduleCommand) -> ExitCode {
    use switchboard::schedule::ops;
    let now = switchboard::clock::Clock::now_ms(&switchboard::clock::SystemClock);
    let (config_arg, id) = match &command {
        ScheduleCommand::Add { config, .. } | ScheduleCommand::List { config, .. } => {
            (config, None)
        }
        ScheduleCommand::Show { config, id }
        | ScheduleCommand::Pause { config, id }
        | ScheduleCommand::Resume { config, id }
        | ScheduleCommand::Cancel { config, id } => (config, Some(*id)),
    };
    let config = match load(config_arg) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let store = match store::open(&config.store, OpenMode::Tool).await {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let result: Result<String, ops::OpError> = match command {
        ScheduleCommand::Add {
            account,
            chat,
            thread,
            chat_kind,
            at,
            after,
            every,
            timezone,
            message,
            prompt,
            missed,
            max_attempts,
            ..
        } => {
            let add = ops::AddSchedule {
                account,
                chat_id: chat,
                thread_id: thread,
                chat_kind,
                at,
                after,
                every,
                timezone,
                message,
                prompt,
                missed,
                max_attempts,
            };
            ops::add(&store, &config, now, &add, "cli")
                .await
                .map(|s| format!("schedule {} added\n{}", s.id, ops::describe(&s)))
        }
        ScheduleCommand::List {
            account,
            chat,
            state,
            limit,
            ..
        } => {
            let state = match parse_choice(
                state,
                "schedule state",
                store::ScheduleState::parse,
                store::ScheduleState::ALL,
                store::ScheduleState::as_str,
            ) {
                Ok(s) => s,
                Err(code) => return code,
            };
            let account = match account {
                Some(name) => match store.channel_account(&name).await {
                    Ok(Some((identity, _))) => Some(identity),
                    Ok(None) => {
                        eprintln!(
                            "switchboard: no channel account named {name:?} has run on this store"
                        );
                        return ExitCode::from(2);
                    }
                    Err(e) => return fail(e),
                },
                None => None,
            };
            store
                .schedule_list(&store::ScheduleFilter {
                    account,
                    chat_id: chat,
                    state,
                    limit,
                })
                .await
                .map(|rows| {
                    rows.iter()
                        .map(ops::describe)
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .map_err(ops::OpError::from)
        }
        ScheduleCommand::Show { .. } => ops::show(&store, id.unwrap_or_default()).await.map(|d| {
            let mut out = ops::describe(&d.schedule);
            for o in &d.occurrences {
                out.push_str(&format!(
                    "\n  {}  slot {}  {}  attempts {}{}",
                    o.key,
                    switchboard::schedule::spec::show(
                        o.slot_at,
                        switchboard::schedule::zone_of(&d.schedule)
                    ),
                    o.state,
                    o.attempts,
                    o.reason
                        .as_deref()
                        .map(|r| format!("  ({r})"))
                        .unwrap_or_default()
                ));
            }
            out
        }),
        ScheduleCommand::Pause { .. } => {
            ops::transition(&store, now, id.unwrap_or_default(), "pause")
                .await
                .map(|s| ops::describe(&s))
        }
        ScheduleCommand::Resume { .. } => {
            ops::transition(&store, now, id.unwrap_or_default(), "resume")
                .await
                .map(|s| ops::describe(&s))
        }
        ScheduleCommand::Cancel { .. } => {
            ops::transition(&store, now, id.unwrap_or_default(), "cancel")
                .await
                .map(|s| ops::describe(&s))
        }
    };
    match result {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(ops::OpError::Invalid(why)) => {
            eprintln!("switchboard: {why}");
            ExitCode::from(2)
        }
        Err(e) => fail(e),
    }
}

/// Parse an optional command-line value into one of a closed set.
fn parse_choice<T: Copy>(
    value: Option<String>,
    what: &str,
    parse: fn(&str) -> Option<T>,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<Option<T>, ExitCode> {
    let Some(value) = value else { return Ok(None) };
    parse(&value).map(Some).ok_or_else(|| {
        let names: Vec<&str> = all.iter().map(|v| name(*v)).collect();
        eprintln!(
            "switchboard: unknown {what} {value:?}; use one of: {}",
            names.join(", ")
        );
        ExitCode::from(2)
    })
}

/// Open the store a config names, as an operator tool (beside a daemon).
async fn open_store(args: &ConfigArg) -> Result<store::SharedStore, ExitCode> {
    let config = load(args)?;
    store::open(&config.store, OpenMode::Tool)
        .await
        .map_err(fail)
}

fn print_or_fail(result: Result<String, store::StoreError>) -> ExitCode {
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn load(args: &ConfigArg) -> Result<Config, ExitCode> {
    Config::load(&args.config).map_err(|e: ConfigError| {
        eprintln!("switchboard: {e}");
        ExitCode::from(EXIT_CONFIG as u8)
    })
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("switchboard: {e}");
    ExitCode::FAILURE
}

fn init_logging(level: &str, format: LogFormat) -> LogReload {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let overridden = from_env.is_some();
    let filter = from_env
        .or_else(|| tracing_subscriber::EnvFilter::try_new(level).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    // Under systemd, stderr goes to the journal, which adds its own time
    // stamps and shows no colours.
    let journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let output = match format {
        LogFormat::Text if journald => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .without_time()
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(output)
        .init();
    LogReload {
        level: level.to_owned(),
        handle: (!overridden).then_some(handle),
    }
}

/// Run the daemon until SIGTERM or SIGINT (a second one exits at once);
/// SIGHUP reloads what can be reloaded.
async fn run_daemon(config: Config, path: &std::path::Path, mut log: LogReload) -> ExitCode {
    use switchboard::systemd;
    let mut signals = match signal_hook_tokio::Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot listen for signals: {e}")),
    };
    systemd::status("starting: opening the store");
    let daemon = match switchboard::daemon::Daemon::start(config).await {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "switchboard could not start");
            eprintln!("switchboard: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    systemd::ready(&daemon.status_line());
    let watchdog_stop = tokio_util::sync::CancellationToken::new();
    let watchdog = systemd::spawn_watchdog(daemon.observer.clone(), watchdog_stop.clone());
    while let Some(signal) = signals.next().await {
        if signal != SIGHUP {
            tracing::info!(signal, "stop requested");
            break;
        }
        tracing::info!(path = %path.display(), "SIGHUP: reloading the configuration");
        match Config::load(path) {
            Ok(new) => {
                let mut report = daemon.reload(&new);
                if new.log.level != log.level {
                    match log.set(&new.log.level) {
                        Ok(()) => {
                            report.applied.push("log.level".into());
                            log.level = new.log.level.clone();
                        }
                        Err(e) => tracing::warn!(error = %e, "log.level not changed"),
                    }
                }
                tracing::info!(
                    applied = ?report.applied,
                    needs_restart = ?report.needs_restart,
                    "configuration reloaded"
                );
                if !report.needs_restart.is_empty() {
                    tracing::warn!(keys = ?report.needs_restart, "these changes take effect only after a restart");
                }
                systemd::status(&daemon.status_line());
            }
            Err(e) => {
                tracing::error!(error = %e, "the new configuration is not valid; keeping the running one");
            }
        }
    }
    systemd::stopping("stopping: ingress closed, finishing runs and sends");
    watchdog_stop.cancel();
    if let Some(w) = watchdog {
        let _ = w.await;
    }
    tokio::spawn(async move {
        while let Some(signal) = signals.next().await {
            if signal != SIGHUP {
                tracing::warn!(signal, "second stop request: exiting now");
                std::process::exit(1);
            }
        }
    });
    let report = daemon.shutdown().await;
    if !report.settled {
        systemd::status(&format!(
            "stopped: timed out with {} unfinished",
            report.remaining
        ));
    }
    ExitCode::SUCCESS
}

/// The log filter, reloadable by SIGHUP (unless `RUST_LOG` overrides it).
struct LogReload {
    level: String,
    handle: Option<
        tracing_subscriber::reload::Handle<
            tracing_subscriber::EnvFilter,
            tracing_subscriber::Registry,
        >,
    >,
}

impl LogReload {
    fn set(&self, level: &str) -> Result<(), String> {
        let Some(handle) = &self.handle else {
            return Err("RUST_LOG is set and wins over log.level".into());
        };
        let filter = tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    }
}
