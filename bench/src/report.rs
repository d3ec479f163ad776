//! Collecting, printing and saving results.

use std::path::Path;

use serde::Serialize;

use crate::Scale;

/// The figures of one measurement over its repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub scenario: String,
    pub metric: String,
    pub unit: String,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
    pub note: String,
}

#[derive(Debug, Serialize)]
struct Machine {
    cores: usize,
    /// The 1-, 5- and 15-minute load averages when the run started (the
    /// machine is shared).
    load_average: String,
    sqlite_version: String,
    journal_mode: &'static str,
    synchronous: &'static str,
    repetitions: usize,
    quick: bool,
}

pub struct Report {
    machine: Machine,
    rows: Vec<Row>,
    /// Time series (the soak's RSS samples), saved in the JSON.
    series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Whole numbers for large figures, two decimals for small ones (latencies
/// in ms, MB).
fn fmt(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Report {
    pub async fn new(scale: Scale) -> anyhow::Result<Report> {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:").await?;
        let version: String = sqlx::query_scalar("SELECT sqlite_version()")
            .fetch_one(&mut conn)
            .await?;
        Ok(Report {
            machine: Machine {
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
                load_average: load_average(),
                sqlite_version: version,
                journal_mode: "WAL",
                synchronous: "FULL",
                repetitions: scale.reps,
                quick: scale.quick,
            },
            rows: Vec::new(),
            series: Vec::new(),
        })
    }

    pub fn print_header(&self) {
        let m = &self.machine;
        println!(
            "machine: {} cores (load average {} at start), SQLite {}, journal_mode={}, synchronous={}; {} repetitions per figure{}",
            m.cores,
            m.load_average,
            m.sqlite_version,
            m.journal_mode,
            m.synchronous,
            m.repetitions,
            if m.quick { " (--quick)" } else { "" }
        );
        println!(
            "\n{:<10} {:<40} {:>10} {:>10} {:>10}  unit",
            "scenario", "metric", "median", "min", "max"
        );
    }

    pub fn add(
        &mut self,
        scenario: &str,
        metric: &str,
        unit: &str,
        samples: Vec<f64>,
        note: &str,
    ) -> f64 {
        let row = Row {
            scenario: scenario.to_owned(),
            metric: metric.to_owned(),
            unit: unit.to_owned(),
            median: median(&samples),
            min: samples.iter().copied().fold(f64::INFINITY, f64::min),
            max: samples.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            samples,
            note: note.to_owned(),
        };
        println!(
            "{:<10} {:<40} {:>10} {:>10} {:>10}  {}{}",
            row.scenario,
            row.metric,
            fmt(row.median),
            fmt(row.min),
            fmt(row.max),
            row.unit,
            if row.note.is_empty() {
                String::new()
            } else {
                format!("  ({})", row.note)
            }
        );
        let m = row.median;
        self.rows.push(row);
        m
    }

    pub fn set_series(&mut self, name: &str, samples: Vec<(f64, f64)>) {
        self.series.push((name.to_owned(), samples));
    }

    pub fn get(&self, scenario: &str, metric: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.scenario == scenario && r.metric == metric)
            .map(|r| r.median)
    }

    pub fn print_ratios(&self) {
        let mut lines = Vec::new();
        if let (Some(d), Some(one)) = (
            self.get("dispatch", "backlog drained"),
            self.get("limits", "claim+ack, one transaction each"),
        ) {
            lines.push(format!(
                "dispatch / raw claim+ack (one transaction per step): {:.1}x",
                d / one
            ));
        }
        if let (Some(d), Some(one)) = (
            self.get("dispatch", "backlog drained"),
            self.get("limits", "single-row insert commits"),
        ) {
            lines.push(format!(
                "dispatch / raw single-row commits: {:.1}x",
                d / one
            ));
        }
        let ratio = |lines: &mut Vec<String>, label: &str, a: (&str, &str), b: (&str, &str)| {
            if let (Some(x), Some(y)) = (self.get(a.0, a.1), self.get(b.0, b.1)) {
                lines.push(format!("{label}: {:.2}x", x / y));
            }
        };
        ratio(
            &mut lines,
            "ingest (stored and admitted) / raw single-row commits",
            ("ingest", "updates stored and admitted"),
            ("limits", "single-row insert commits"),
        );
        ratio(
            &mut lines,
            "ingest (stored and admitted) / raw batched inserts",
            ("ingest", "updates stored and admitted"),
            ("limits", "batched inserts (100 rows/commit)"),
        );
        ratio(
            &mut lines,
            "dispatch / peer (apalis-sqlite) jobs processed",
            ("dispatch", "backlog drained"),
            ("peer", "apalis: jobs processed"),
        );
        ratio(
            &mut lines,
            "peer (apalis-sqlite) processed / raw claim+ack",
            ("peer", "apalis: jobs processed"),
            ("limits", "claim+ack, one transaction each"),
        );
        if !lines.is_empty() {
            println!("\nratios (medians):");
            for l in lines {
                println!("  {l}");
            }
        }
    }

    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        #[derive(Serialize)]
        struct Out<'a> {
            machine: &'a Machine,
            results: &'a [Row],
            series: &'a [(String, Vec<(f64, f64)>)],
        }
        let text = serde_json::to_string_pretty(&Out {
            machine: &self.machine,
            results: &self.rows,
            series: &self.series,
        })?;
        std::fs::write(path, text)?;
        Ok(())
    }
}

/// `/proc/loadavg`'s first three fields.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}
