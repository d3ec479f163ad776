//! Operator commands that read the store: readable tables of the journal
//! and the outbox.

use std::fmt::Write as _;

use switchboard_channel::Content;

use crate::store::{
    DispatchState, Disposition, InboundRow, OutboxFilter, OutboxItem, RunRow, RunState,
    SharedStore, StoreResult,
};

/// A plain text table: a header row, then rows, columns padded to fit.
pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: Vec<&'static str>) -> Self {
        Table {
            header,
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
            let mut first = true;
            for (cell, w) in cells.zip(&widths) {
                if !first {
                    out.push_str("  ");
                }
                first = false;
                let pad = w.saturating_sub(cell.chars().count());
                out.push_str(cell);
                out.extend(std::iter::repeat_n(' ', pad));
            }
            let trimmed = out.trim_end().len();
            out.truncate(trimmed);
            out.push('\n');
        };
        line(&mut out, &mut self.header.iter().copied());
        for row in &self.rows {
            line(&mut out, &mut row.iter().map(String::as_str));
        }
        out
    }
}

/// Shorten text for a table cell, on one line.
pub fn cell(text: &str, max: usize) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut s: String = one_line.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

fn opt(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "-".to_owned())
}

/// The text of a journal row's payload, for display.
fn inbound_text(row: &InboundRow) -> String {
    match row.payload.as_deref().map(serde_json::from_str::<Content>) {
        None => "(pruned)".to_owned(),
        Some(Ok(Content::Message { text, .. })) => text,
        Some(Ok(Content::Unsupported { kind, .. })) => format!("({kind})"),
        Some(Ok(Content::ChatMigrated { to_chat_id })) => format!("(migrated to {to_chat_id})"),
        Some(Err(_)) => "(unreadable)".to_owned(),
    }
}

pub fn inbound_table(rows: &[InboundRow]) -> String {
    let mut table = Table::new(vec![
        "ID",
        "ACCOUNT",
        "UPDATE",
        "CONV",
        "CHAT",
        "DISPOSITION",
        "RUN",
        "TEXT",
        "REASON",
    ]);
    for r in rows {
        table.row(vec![
            r.id.to_string(),
            r.account.clone(),
            cell(&r.update_key, 24),
            r.conversation_id.to_string(),
            cell(&r.chat_id, 20),
            r.disposition.to_string(),
            opt(&r.run_id),
            cell(&inbound_text(r), 40),
            cell(r.reason.as_deref().unwrap_or("-"), 80),
        ]);
    }
    table.render()
}

pub fn outbox_table(items: &[OutboxItem]) -> String {
    let mut table = Table::new(vec![
        "ID", "CONV", "ORD", "STATE", "ATTEMPTS", "RESENDS", "ITEM KEY", "TEXT", "REASON",
    ]);
    for i in items {
        table.row(vec![
            i.id.to_string(),
            i.conversation_id.to_string(),
            i.ordinal.to_string(),
            i.state.to_string(),
            i.attempts.to_string(),
            i.resends.to_string(),
            i.item_key.clone(),
            cell(&i.text, 40),
            cell(i.reason.as_deref().unwrap_or("-"), 80),
        ]);
    }
    table.render()
}

pub fn runs_table(runs: &[RunRow]) -> String {
    let mut table = Table::new(vec![
        "ID",
        "CONV",
        "MODE",
        "STATE",
        "ABSORBED BY",
        "PROMPT",
        "ANSWER",
        "REASON",
    ]);
    for r in runs {
        let prompt = r
            .prompt
            .as_deref()
            .and_then(|p| serde_json::from_str::<Vec<String>>(p).ok())
            .map(|p| p.join(" | "))
            .unwrap_or_else(|| "-".to_owned());
        table.row(vec![
            r.id.to_string(),
            r.conversation_id.to_string(),
            r.mode.to_string(),
            r.state.to_string(),
            r.absorbed_by.map_or("-".to_owned(), |a| a.to_string()),
            cell(&prompt, 30),
            cell(r.answer.as_deref().unwrap_or("-"), 40),
            cell(r.reason.as_deref().unwrap_or("-"), 50),
        ]);
    }
    table.render()
}

/// `switchboard runs list`.
pub async fn runs_list(
    store: &SharedStore,
    conversation_id: Option<i64>,
    state: Option<RunState>,
    limit: usize,
) -> StoreResult<String> {
    Ok(runs_table(
        &store.runs_list(conversation_id, state, limit).await?,
    ))
}

/// `switchboard inbound list`.
pub async fn inbound_list(
    store: &SharedStore,
    disposition: Option<Disposition>,
    limit: usize,
) -> StoreResult<String> {
    let rows = store.journal_list(disposition, limit).await?;
    let counts = store.journal_counts().await?;
    let mut out = inbound_table(&rows);
    let _ = writeln!(
        out,
        "\n{}",
        summary(counts.iter().map(|(d, n)| (d.as_str(), *n)))
    );
    Ok(out)
}

/// `switchboard outbox list`.
pub async fn outbox_list(
    store: &SharedStore,
    state: Option<DispatchState>,
    conversation_id: Option<i64>,
    limit: usize,
) -> StoreResult<String> {
    let items = store
        .outbox_list(&OutboxFilter {
            state,
            conversation_id,
            limit,
        })
        .await?;
    let counts = store.outbox_counts().await?;
    let mut out = outbox_table(&items);
    let _ = writeln!(
        out,
        "\n{}",
        summary(counts.iter().map(|(s, n)| (s.as_str(), *n)))
    );
    Ok(out)
}

fn summary<'a>(counts: impl Iterator<Item = (&'a str, i64)>) -> String {
    let parts: Vec<String> = counts.map(|(k, n)| format!("{k}: {n}")).collect();
    if parts.is_empty() {
        "total: 0".to_owned()
    } else {
        format!("totals: {}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_pad_columns() {
        let mut t = Table::new(vec!["A", "LONGER"]);
        t.row(vec!["wide cell".into(), "x".into()]);
        assert_eq!(t.render(), "A          LONGER\nwide cell  x\n");
    }

    #[test]
    fn cells_are_shortened_on_one_line() {
        assert_eq!(cell("a\nb", 10), "a b");
        assert_eq!(cell("abcdefghijk", 5), "abcd…");
    }
}
