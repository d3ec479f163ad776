//! A throwaway PostgreSQL database per test, on the server named by
//! `SWITCHBOARD_TEST_PG_URL` (`.ci/run` starts one on a loopback port).
//!
//! Without that variable the PostgreSQL tests say so and check nothing,
//! so `cargo test` works on a machine with only the Rust toolchain; CI sets
//! `SWITCHBOARD_REQUIRE_PG=1`, which turns a missing server into a failure.

#![allow(dead_code)]

use sqlx::Connection;

/// The server's URL, or `None` (with a note) when there is none.
pub fn base_url() -> Option<String> {
    match std::env::var("SWITCHBOARD_TEST_PG_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("SWITCHBOARD_REQUIRE_PG").is_none(),
                "SWITCHBOARD_REQUIRE_PG is set but SWITCHBOARD_TEST_PG_URL is not: start PostgreSQL (see .ci/run)"
            );
            eprintln!(
                "note: SWITCHBOARD_TEST_PG_URL is not set; this PostgreSQL test checks nothing here (.ci/run runs it)"
            );
            None
        }
    }
}

/// A new, empty database on the test server; its URL.
pub async fn fresh_database() -> Option<String> {
    let base = base_url()?;
    let name = format!(
        "sb_{}_{}",
        std::process::id(),
        rand::random::<u64>() % 1_000_000_000_000
    );
    let mut admin = sqlx::PgConnection::connect(&base)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to SWITCHBOARD_TEST_PG_URL: {e}"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let _ = admin.close().await;
    let (prefix, _) = base.rsplit_once('/').expect("a URL with a database path");
    Some(format!("{prefix}/{name}"))
}
