//! Switchboard's benchmark program.
//!
//! Each scenario runs several times and reports the median with min and
//! max, next to the machine's own limits measured in the same run with the
//! same SQLite settings, so ratios mean something on a noisy shared
//! machine. Results print as a table and are written as JSON.
//!
//! ```text
//! cargo run --release -p switchboard-bench -- [--quick] [--reps N] [--soak-secs S] [--json PATH] [SCENARIO ...]
//! ```
//!
//! Scenarios: `limits` (raw SQLite), `dispatch` (an outbox backlog through
//! the real dispatcher), `peer` (apalis-sqlite 1.0 doing the same jobs),
//! `ingest` and `e2e` (the real daemon in-process, webhook updates over
//! loopback), `memory` and `recovery` (the real `switchboard` binary as a
//! child process, on a store preloaded with raw SQL). Stores live in
//! `BENCH_DIR` (default: the system temp directory), which must be on a
//! real disk for the figures to mean anything.

mod ingest;
mod limits;
mod memory;
mod peer;
mod postgres;
mod report;
mod scenarios;
mod util;

use std::path::PathBuf;

use clap::Parser;

use crate::report::Report;

#[derive(Parser)]
#[command(about = "Measure Switchboard against the machine's limits")]
struct Args {
    /// A short run (under two minutes): fewer items, fewer repetitions.
    #[arg(long)]
    quick: bool,
    /// Repetitions of each scenario (default 5, or 3 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench-results.json")]
    json: PathBuf,
    /// Length of the memory soak in seconds (default 600, or 20 with
    /// --quick).
    #[arg(long)]
    soak_secs: Option<u64>,
    /// Scenarios to run (default: all): limits, dispatch, peer, ingest,
    /// e2e, memory, recovery, postgres (one and three processes on the
    /// server named by SWITCHBOARD_BENCH_PG_URL; skipped without it).
    scenarios: Vec<String>,
}

/// Sizes of one run.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub quick: bool,
    pub reps: usize,
    /// Rows for the raw SQLite limits.
    pub limit_rows: usize,
    /// Outbox items drained by the dispatch scenario.
    pub dispatch_items: usize,
    pub dispatch_conversations: usize,
    /// Updates posted by the ingest throughput phase.
    pub ingest_updates: usize,
    /// Length of a fixed-load latency phase.
    pub latency_secs: f64,
    /// The preloaded store of the memory and recovery scenarios.
    pub fixture: memory::FixtureSize,
    pub soak_secs: u64,
    pub soak_rate: f64,
    pub soak_sample_secs: u64,
}

/// Where scenarios put their stores: a directory on the same disk as the
/// project (never a RAM disk), `BENCH_DIR` or the system's temp directory.
pub fn scratch_dir() -> PathBuf {
    std::env::var_os("BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let reps = args.reps.unwrap_or(if args.quick { 3 } else { 5 }).max(1);
    let scale = if args.quick {
        Scale {
            quick: true,
            reps,
            limit_rows: 3_000,
            dispatch_items: 3_000,
            dispatch_conversations: 500,
            ingest_updates: 4_000,
            latency_secs: 2.0,
            fixture: memory::FixtureSize {
                conversations: 10_000,
                rows: 100_000,
                pending: 1_000,
            },
            soak_secs: args.soak_secs.unwrap_or(20),
            soak_rate: 500.0,
            soak_sample_secs: 2,
        }
    } else {
        Scale {
            quick: false,
            reps,
            limit_rows: 20_000,
            dispatch_items: 20_000,
            dispatch_conversations: 1_000,
            ingest_updates: 30_000,
            latency_secs: 10.0,
            fixture: memory::FixtureSize {
                conversations: 100_000,
                rows: 1_000_000,
                pending: 10_000,
            },
            soak_secs: args.soak_secs.unwrap_or(600),
            soak_rate: 500.0,
            soak_sample_secs: 5,
        }
    };
    let all = [
        "limits", "dispatch", "peer", "ingest", "e2e", "memory", "recovery", "postgres",
    ];
    let chosen: Vec<String> = if args.scenarios.is_empty() {
        all.iter().map(|s| s.to_string()).collect()
    } else {
        args.scenarios.clone()
    };
    for s in &chosen {
        anyhow::ensure!(
            all.contains(&s.as_str()),
            "unknown scenario {s:?}; choose from {all:?}"
        );
    }

    let wants = |name: &str| chosen.iter().any(|s| s == name);
    let started = std::time::Instant::now();
    let mut report = Report::new(scale).await?;
    report.print_header();
    let step = |name: &str| eprintln!("[{:>5.1} s] {name}...", started.elapsed().as_secs_f64());
    if wants("limits") {
        step("limits: raw SQLite");
        limits::run(&mut report, scale).await?;
    }
    if wants("dispatch") {
        step("dispatch: a backlog drained to a loopback sink");
        scenarios::dispatch(&mut report, scale).await?;
    }
    if wants("peer") {
        step("peer: apalis-sqlite 1.0, the same jobs");
        peer::run(&mut report, scale).await?;
    }
    if wants("ingest") {
        step("ingest: updates posted to the in-process daemon");
        ingest::ingest(&mut report, scale).await?;
    }
    if wants("e2e") {
        step("end to end: POST to reply at fixed loads");
        ingest::end_to_end(&mut report, scale).await?;
    }
    if wants("memory") || wants("recovery") {
        step("building the preloaded store");
        let fixture = memory::fixture(scale.fixture).await?;
        if wants("recovery") {
            step("recovery: start to READY on the preloaded store");
            memory::recovery(&mut report, scale, &fixture).await?;
        }
        if wants("memory") {
            step("memory: RSS of the switchboard process");
            memory::memory(&mut report, scale, &fixture).await?;
        }
    }
    if wants("postgres") {
        step("postgres: one and three processes on one database");
        postgres::run(&mut report, scale).await?;
    }
    step("done");
    report.print_ratios();
    report.write_json(&args.json)?;
    println!("\nresults written to {}", args.json.display());
    Ok(())
}
