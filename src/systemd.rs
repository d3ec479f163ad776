//! The service manager's side of the process (sd_notify): READY once the
//! store is open and recovery is queued, STATUS lines, WATCHDOG pings while
//! the daemon's loops make progress, STOPPING when shutdown begins. Every
//! call is a no-op outside systemd (no `NOTIFY_SOCKET`).
//!
//! The `sd-notify` crate speaks the protocol (a datagram to the socket the
//! service manager names); this module decides when.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::observe::Observer;

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "could not notify the service manager");
    }
}

/// Start-up is done: the store is open, listeners are bound, recovery work
/// is queued.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// A loop that has not gone round for this long (or for the watchdog
/// interval, if that is longer) is stalled. Idle loops go round at least
/// every few seconds (their poll intervals), so this is far above normal.
const STALL: Duration = Duration::from_secs(30);

/// Ping the watchdog every half interval, but only while every loop the
/// daemon registered (dispatcher, submitter, scheduler, reconciler) has
/// gone round recently: a hung loop stops the pings, and systemd restarts
/// the service. Does nothing when no watchdog is set.
pub fn spawn_watchdog(observer: Arc<Observer>, stop: CancellationToken) -> Option<JoinHandle<()>> {
    let interval = sd_notify::watchdog_enabled()?;
    tracing::info!(
        interval_ms = interval.as_millis() as u64,
        "systemd watchdog enabled"
    );
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval((interval / 2).max(Duration::from_millis(50)));
        let mut stalled_before = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let stalled = observer.stalled_loops(interval.max(STALL));
            if stalled.is_empty() {
                send(&[NotifyState::Watchdog]);
                if stalled_before {
                    tracing::info!("every loop is making progress again");
                    stalled_before = false;
                }
            } else if !stalled_before {
                stalled_before = true;
                tracing::error!(loops = ?stalled, "not pinging the watchdog: these loops made no progress within its interval");
                status(&format!("stalled: {}", stalled.join(", ")));
            }
        }
    }))
}
