//! Every file in `config/` parses and validates, and the default file's
//! documented values are the code's real defaults (so the documentation
//! cannot drift from the code).

use std::path::Path;

use switchboard::config::Config;

#[test]
fn every_example_config_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            if let Err(e) = Config::from_toml(&text) {
                panic!("{} does not load: {e}", path.display());
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 1,
        "no example configs found in {}",
        dir.display()
    );
}

#[test]
fn the_default_file_documents_the_real_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/switchboard.toml");
    let documented = Config::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    // The same runtime and channel with every other key left to the code.
    let minimal = Config::from_toml(
        r#"
        [runtimes.default]
        kind = "local"
        model = { backend = "echo" }
        [channels.local]
        kind = "webhook"
        runtime = "default"
        callback_url = "http://127.0.0.1:8790/replies"
        "#,
    )
    .unwrap();
    assert_eq!(
        format!("{:?}", documented.store),
        format!("{:?}", minimal.store)
    );
    assert_eq!(
        format!("{:?}", documented.server),
        format!("{:?}", minimal.server)
    );
    assert_eq!(
        format!("{:?}", documented.admin),
        format!("{:?}", minimal.admin)
    );
    assert_eq!(
        format!("{:?}", documented.log),
        format!("{:?}", minimal.log)
    );
    assert_eq!(
        format!("{:?}", documented.outbox),
        format!("{:?}", minimal.outbox)
    );
    assert_eq!(
        format!("{:?}", documented.submitter),
        format!("{:?}", minimal.submitter)
    );
    assert_eq!(
        format!("{:?}", documented.shutdown),
        format!("{:?}", minimal.shutdown)
    );
    assert_eq!(
        format!("{:?}", documented.retention),
        format!("{:?}", minimal.retention)
    );
    assert_eq!(
        format!("{:?}", documented.runtimes),
        format!("{:?}", minimal.runtimes)
    );
    // Access settings are compared as they apply (the file spells out the
    // webhook platform's defaults).
    let resolved = |c: &Config| {
        c.channels
            .iter()
            .map(|(name, ch)| {
                let access = switchboard::access::Access::resolve(
                    ch.access(),
                    switchboard_channel::Platform::Webhook,
                );
                let rest = format!("{ch:?}");
                let rest = rest.split("access:").next().unwrap_or_default().to_owned();
                (name.clone(), rest, format!("{access:?}"))
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(resolved(&documented), resolved(&minimal));
    // The surfaces section restates the webhook surface's defaults.
    for kind in switchboard::surface::SurfaceKind::ALL {
        assert_eq!(documented.surface(kind), minimal.surface(kind), "{kind}");
    }
}

#[test]
fn the_telegram_example_documents_the_real_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/telegram.toml");
    let documented = Config::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let minimal = Config::from_toml(
        r#"
        [store]
        url = "sqlite://data/telegram.db"
        [runtimes.default]
        kind = "local"
        model = { backend = "echo" }
        [channels.tg]
        kind = "telegram"
        runtime = "default"
        token_file = "telegram-token"
        "#,
    )
    .unwrap();
    let channel = |c: &Config| {
        let ch = &c.channels["tg"];
        let access = switchboard::access::Access::resolve(
            ch.access(),
            switchboard_channel::Platform::Telegram,
        );
        let rest = format!("{ch:?}");
        let rest = rest.split("access:").next().unwrap_or_default().to_owned();
        (rest, format!("{access:?}"))
    };
    assert_eq!(channel(&documented), channel(&minimal));
    for kind in switchboard::surface::SurfaceKind::ALL {
        assert_eq!(documented.surface(kind), minimal.surface(kind), "{kind}");
    }
}

#[test]
fn the_discord_example_documents_the_real_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/discord.toml");
    let documented = Config::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let minimal = Config::from_toml(
        r#"
        [store]
        url = "sqlite://data/discord.db"
        [runtimes.default]
        kind = "local"
        model = { backend = "echo" }
        [channels.dc]
        kind = "discord"
        runtime = "default"
        token_file = "discord-token"
        "#,
    )
    .unwrap();
    let channel = |c: &Config| {
        let ch = &c.channels["dc"];
        let access = switchboard::access::Access::resolve(
            ch.access(),
            switchboard_channel::Platform::Discord,
        );
        let rest = format!("{ch:?}");
        let rest = rest.split("access:").next().unwrap_or_default().to_owned();
        (rest, format!("{access:?}"))
    };
    assert_eq!(channel(&documented), channel(&minimal));
    for kind in switchboard::surface::SurfaceKind::ALL {
        assert_eq!(documented.surface(kind), minimal.surface(kind), "{kind}");
    }
}

#[test]
fn the_remote_runtime_example_documents_the_real_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/remote-runtime.toml");
    let documented = Config::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let minimal = Config::from_toml(
        r#"
        [runtimes.agent]
        kind = "http"
        base_url = "http://127.0.0.1:8800"
        [channels.local]
        kind = "webhook"
        runtime = "agent"
        callback_url = "http://127.0.0.1:8790/replies"
        "#,
    )
    .unwrap();
    assert_eq!(
        format!("{:?}", documented.runtimes),
        format!("{:?}", minimal.runtimes)
    );
}

#[test]
fn a_lease_too_short_to_renew_is_refused_naming_the_key() {
    let err = Config::from_toml(
        r#"
        [store]
        url = "postgres://switchboard@127.0.0.1/switchboard"
        lease_secs = 1
        [runtimes.default]
        kind = "local"
        model = { backend = "echo" }
        [channels.local]
        kind = "webhook"
        runtime = "default"
        callback_url = "http://127.0.0.1:8790/replies"
        "#,
    )
    .expect_err("a 1-second lease is refused")
    .to_string();
    assert!(
        err.contains("store.lease_secs") && err.contains("at least 3 seconds"),
        "{err}"
    );
}
