//! Switchboard's benchmark program.
//!
//! Each scenario runs several times and reports the median with min and
//! max, next to the machine's own limits measured in the same run with the
//! same SQLite settings, so ratios mean something on a noisy shared
//! machine. Results print as a table and are written as JSON.
//!
//! ```text
//! cargo run --release -p switchboard-bench -- [--quick] [--reps N] [--json PATH] [SCENARIO ...]
//! ```

mod limits;
mod postgres;
mod report;
mod scenarios;

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
    /// Scenarios to run (default: all): limits, dispatch, postgres (one
    /// and three processes on the server named by SWITCHBOARD_BENCH_PG_URL).
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
            dispatch_items: 5_000,
            dispatch_conversations: 500,
        }
    } else {
        Scale {
            quick: false,
            reps,
            limit_rows: 20_000,
            dispatch_items: 50_000,
            dispatch_conversations: 1_000,
        }
    };
    let all = ["limits", "dispatch", "postgres"];
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

    let mut report = Report::new(scale).await?;
    report.print_header();
    if chosen.iter().any(|s| s == "limits") {
        limits::run(&mut report, scale).await?;
    }
    if chosen.iter().any(|s| s == "dispatch") {
        scenarios::dispatch(&mut report, scale).await?;
    }
    if chosen.iter().any(|s| s == "postgres") {
        postgres::run(&mut report, scale).await?;
    }
    report.print_ratios();
    report.write_json(&args.json)?;
    println!("\nresults written to {}", args.json.display());
    Ok(())
}
