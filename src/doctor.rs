//! `switchboard doctor`: everything `check` does, plus what needs the
//! network and the disk — the store and its migrations, which bot each
//! token belongs to, whether each runtime answers, how the admin API is
//! exposed, and whether secret files are readable by others. One line per
//! check, PASS / WARN / FAIL with the fix; the exit status says whether
//! anything failed.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{ChannelConfig, Config, ModelConfig, RuntimeConfig, parse_listen};
use crate::store::sqlite::OpenMode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pass,
    Warn,
    Fail,
}

struct Report {
    failed: bool,
}

impl Report {
    fn line(&mut self, verdict: Verdict, what: &str, detail: impl AsRef<str>) {
        let tag = match verdict {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => {
                self.failed = true;
                "FAIL"
            }
        };
        println!("{tag} {what:<18} {}", detail.as_ref());
    }
}

/// Run every check against the config at `path`; `true` when none failed.
pub async fn run(path: &Path) -> bool {
    let mut report = Report { failed: false };
    let config = match Config::load(path) {
        Ok(c) => {
            report.line(
                Verdict::Pass,
                "config",
                format!(
                    "{}: {} channel account(s), {} runtime(s)",
                    path.display(),
                    c.channels.len(),
                    c.runtimes.len()
                ),
            );
            c
        }
        Err(e) => {
            report.line(Verdict::Fail, "config", e.to_string());
            return false;
        }
    };
    check_store(&config, &mut report).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default();
    for (name, channel) in &config.channels {
        check_channel(name, channel, &client, &mut report).await;
    }
    for (name, runtime) in &config.runtimes {
        check_runtime(name, runtime, &client, &mut report).await;
    }
    check_admin(&config, &mut report);
    for (key, file) in secret_files(&config) {
        check_secret_file(&key, &file, &mut report);
    }
    !report.failed
}

async fn check_store(config: &Config, report: &mut Report) {
    match crate::store::open(&config.store, OpenMode::Tool).await {
        Ok(store) => {
            match store.ping().await {
                Ok(()) => report.line(
                    Verdict::Pass,
                    "store",
                    format!("{} opened, migrations applied", store.describe()),
                ),
                Err(e) => report.line(Verdict::Fail, "store", format!("{}: {e}", store.describe())),
            }
            store.close().await;
        }
        Err(e) => report.line(
            Verdict::Fail,
            "store",
            format!("{e}; check store.url and that the directory is writable by this user"),
        ),
    }
}

async fn check_channel(
    name: &str,
    channel: &ChannelConfig,
    client: &reqwest::Client,
    report: &mut Report,
) {
    let what = format!("channel {name}");
    match channel {
        ChannelConfig::Webhook(w) => {
            if let Err(e) = w.resolve_secret() {
                report.line(Verdict::Fail, &what, format!("secret_file: {e}"));
                return;
            }
            match client.head(&w.callback_url).send().await {
                Ok(r) => report.line(
                    Verdict::Pass,
                    &what,
                    format!("callback {} answers (HTTP {} to HEAD)", w.callback_url, r.status().as_u16()),
                ),
                Err(e) if e.is_connect() => report.line(
                    Verdict::Warn,
                    &what,
                    format!("callback {} refuses connections; replies wait in the outbox until it listens", w.callback_url),
                ),
                Err(e) => report.line(Verdict::Warn, &what, format!("callback {}: {e}", w.callback_url)),
            }
        }
        ChannelConfig::Telegram(t) => {
            let token = match t.resolve_token() {
                Ok(token) => token,
                Err(e) => return report.line(Verdict::Fail, &what, e),
            };
            let url = format!("{}/bot{token}/getMe", t.api_url.trim_end_matches('/'));
            match client.get(&url).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let body: serde_json::Value = r.json().await.unwrap_or_default();
                    if body["ok"] == true {
                        report.line(
                            Verdict::Pass,
                            &what,
                            format!(
                                "the token belongs to @{} (bot id {})",
                                body["result"]["username"].as_str().unwrap_or("?"),
                                body["result"]["id"]
                            ),
                        );
                    } else if status == 401 || status == 404 {
                        report.line(Verdict::Fail, &what, "Telegram does not know this token (401): get a new one from @BotFather");
                    } else {
                        report.line(
                            Verdict::Fail,
                            &what,
                            format!("getMe answered HTTP {status}: {}", body["description"]),
                        );
                    }
                }
                Err(_) => report.line(
                    Verdict::Fail,
                    &what,
                    format!("cannot reach {} (network, proxy or api_url)", t.api_url),
                ),
            }
        }
        ChannelConfig::Discord(d) => {
            let token = match d.resolve_token() {
                Ok(token) => token,
                Err(e) => return report.line(Verdict::Fail, &what, e),
            };
            let url = format!(
                "{}/api/v10/oauth2/applications/@me",
                d.api_url.trim_end_matches('/')
            );
            match client
                .get(&url)
                .header(reqwest::header::AUTHORIZATION, format!("Bot {token}"))
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => {
                    let app: serde_json::Value = r.json().await.unwrap_or_default();
                    let flags = app["flags"].as_u64().unwrap_or(0);
                    let content = flags & ((1 << 18) | (1 << 19)) != 0;
                    report.line(
                        if content { Verdict::Pass } else { Verdict::Warn },
                        &what,
                        format!(
                            "the token belongs to {} (application {}){}",
                            app["bot"]["username"].as_str().or(app["name"].as_str()).unwrap_or("?"),
                            app["id"].as_str().unwrap_or("?"),
                            if content {
                                ""
                            } else {
                                "; the Message Content intent is off: guild messages arrive empty unless they mention the bot (Developer Portal → Bot → Privileged Gateway Intents)"
                            }
                        ),
                    );
                }
                Ok(r) if r.status().as_u16() == 401 => report.line(
                    Verdict::Fail,
                    &what,
                    "Discord does not accept this token (401): reset it in the Developer Portal (Bot → Reset Token)",
                ),
                Ok(r) => report.line(Verdict::Fail, &what, format!("Discord answered HTTP {}", r.status().as_u16())),
                Err(_) => report.line(
                    Verdict::Fail,
                    &what,
                    format!("cannot reach {} (network, proxy or api_url)", d.api_url),
                ),
            }
        }
    }
}

async fn check_runtime(
    name: &str,
    runtime: &RuntimeConfig,
    client: &reqwest::Client,
    report: &mut Report,
) {
    let what = format!("runtime {name}");
    match runtime {
        RuntimeConfig::Http(http) => {
            let token = match http.resolve_token() {
                Ok(t) => t,
                Err(e) => return report.line(Verdict::Fail, &what, format!("token_file: {e}")),
            };
            let mut request =
                client.get(format!("{}/v1/health", http.base_url.trim_end_matches('/')));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            match request.send().await {
                Ok(r) if r.status().is_success() => report.line(
                    Verdict::Pass,
                    &what,
                    format!("{} answers /v1/health", http.base_url),
                ),
                Ok(r) => report.line(
                    Verdict::Fail,
                    &what,
                    format!(
                        "{} answers /v1/health with HTTP {}",
                        http.base_url,
                        r.status().as_u16()
                    ),
                ),
                Err(_) => report.line(
                    Verdict::Fail,
                    &what,
                    format!("cannot reach {}; is the runtime running?", http.base_url),
                ),
            }
        }
        RuntimeConfig::Local(local) => {
            match &local.model {
                ModelConfig::Echo(_) => report.line(Verdict::Pass, &what, "built-in, echo model"),
                ModelConfig::Openai(o) => {
                    let key = match o.resolve_api_key() {
                        Ok(k) => k,
                        Err(e) => {
                            return report.line(Verdict::Fail, &what, format!("api_key_file: {e}"));
                        }
                    };
                    let mut request =
                        client.get(format!("{}/models", o.base_url.trim_end_matches('/')));
                    if let Some(key) = key {
                        request = request.bearer_auth(key);
                    }
                    match request.send().await {
                    Ok(r) if r.status().is_success() => report.line(
                        Verdict::Pass,
                        &what,
                        format!("{} answers; model {:?}", o.base_url, o.model),
                    ),
                    Ok(r) if r.status().as_u16() == 401 || r.status().as_u16() == 403 => report.line(
                        Verdict::Fail,
                        &what,
                        format!("{} refuses the API key (HTTP {})", o.base_url, r.status().as_u16()),
                    ),
                    Ok(r) => report.line(
                        Verdict::Warn,
                        &what,
                        format!("{} answers GET /models with HTTP {}; chat completions may still work", o.base_url, r.status().as_u16()),
                    ),
                    Err(_) => report.line(
                        Verdict::Fail,
                        &what,
                        format!("cannot reach {}; is the model server running?", o.base_url),
                    ),
                }
                }
                ModelConfig::Command(c) => match which(&c.program) {
                    Some(found) => {
                        report.line(Verdict::Pass, &what, format!("command {}", found.display()))
                    }
                    None => report.line(
                        Verdict::Fail,
                        &what,
                        format!(
                            "{} is not an executable file (nor on PATH)",
                            c.program.display()
                        ),
                    ),
                },
            }
        }
    }
}

fn which(program: &Path) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.components().count() > 1 {
        return executable(program).then(|| program.to_owned());
    }
    std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(program))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .find(|p| executable(p))
}

fn check_admin(config: &Config, report: &mut Report) {
    let token = config.admin.resolve_token();
    match (parse_listen(&config.admin.listen), token) {
        (_, Err(e)) => report.line(Verdict::Fail, "admin", format!("token_file: {e}")),
        (Ok(addr), Ok(token)) if addr.ip().is_loopback() => report.line(
            Verdict::Pass,
            "admin",
            format!(
                "{addr}, loopback only{}",
                if token.is_some() {
                    ", bearer token required"
                } else {
                    ""
                }
            ),
        ),
        (Ok(addr), Ok(Some(_))) => report.line(
            Verdict::Pass,
            "admin",
            format!("{addr}, reachable from other machines, bearer token required"),
        ),
        (Ok(addr), Ok(None)) => report.line(
            Verdict::Fail,
            "admin",
            format!(
                "{addr} is reachable from other machines without a token; set admin.token_file"
            ),
        ),
        (Err(e), _) => report.line(Verdict::Fail, "admin", e),
    }
}

/// Every `*_file` key that names a secret, with the file it names.
fn secret_files(config: &Config) -> Vec<(String, PathBuf)> {
    let mut files = Vec::new();
    if let Some(f) = &config.admin.token_file {
        files.push(("admin.token_file".to_owned(), f.clone()));
    }
    for (name, channel) in &config.channels {
        let (key, file) = match channel {
            ChannelConfig::Webhook(w) => {
                if let Some(f) = &w.callback_signing_secret_file {
                    files.push((
                        format!("channels.{name}.callback_signing_secret_file"),
                        f.clone(),
                    ));
                }
                ("secret_file", w.secret_file.clone())
            }
            ChannelConfig::Telegram(t) => ("token_file", t.token_file.clone()),
            ChannelConfig::Discord(d) => ("token_file", d.token_file.clone()),
        };
        if let Some(f) = file {
            files.push((format!("channels.{name}.{key}"), f));
        }
    }
    for (name, runtime) in &config.runtimes {
        if let RuntimeConfig::Http(http) = runtime
            && let Some(f) = &http.token_file
        {
            files.push((format!("runtimes.{name}.token_file"), f.clone()));
        }
        if let RuntimeConfig::Local(local) = runtime
            && let ModelConfig::Openai(o) = &local.model
            && let Some(f) = &o.api_key_file
        {
            files.push((format!("runtimes.{name}.model.api_key_file"), f.clone()));
        }
    }
    files
}

fn check_secret_file(key: &str, file: &Path, report: &mut Report) {
    let full = match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) if file.is_relative() => Path::new(&dir).join(file),
        _ => file.to_owned(),
    };
    match std::fs::metadata(&full) {
        Ok(meta) if meta.permissions().mode() & 0o077 != 0 => report.line(
            Verdict::Fail,
            key,
            format!(
                "{} is readable by others (mode {:o}); chmod 600 {}",
                full.display(),
                meta.permissions().mode() & 0o777,
                full.display()
            ),
        ),
        Ok(_) => report.line(Verdict::Pass, key, format!("{} is private", full.display())),
        Err(e) => report.line(Verdict::Fail, key, format!("{}: {e}", full.display())),
    }
}
