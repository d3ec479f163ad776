//! Who owns a conversation's lane when several processes share a store.
//!
//! The built-in runtime decides input policies (queue, inject, interrupt,
//! supersede) on the lane it keeps in memory, so each conversation must be
//! served by one process at a time. On a shared store (PostgreSQL) a process
//! holds a lease named `lane:<conversation>` while it submits to that
//! conversation or has runs of it in flight; the submitter only reads
//! journal rows of lanes no other process holds, and the scheduler submits a
//! prompt only to a lane it holds. A lane idle for a lease period is
//! released, so conversations spread over the processes as their messages
//! arrive.
//!
//! A process that dies stops renewing; when its leases run out, the next
//! process that needs one of its lanes (a new message, a due prompt, or the
//! orphan sweep over unfinished runs) acquires it and first adopts the runs
//! the dead process left ([`Runtime::adopt`]), so they resume in order
//! before anything new is admitted.
//!
//! With a store one process owns (SQLite) every lane is this process's:
//! [`Lanes::hold`] answers `true` without touching the store, and start-up
//! recovery ([`Runtime::recover`]) resumes everything at once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::keys;
use crate::runtime::{LaneOwnership, Runtime};
use crate::store::{SharedStore, StoreResult};

/// A lane this process holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// When the lease runs out unless renewed.
    until: i64,
    /// When work last went through it.
    used_at: i64,
}

/// Lane ownership of this process.
pub struct Lanes {
    store: SharedStore,
    owner: String,
    shared: bool,
    ttl_ms: i64,
    clock: SharedClock,
    /// The runtimes that keep lanes in this process.
    runtimes: Vec<Arc<dyn Runtime>>,
    held: Mutex<HashMap<i64, Held>>,
    /// When each held lease runs out, readable without waiting (the
    /// runtime checks it before every run it starts).
    until: std::sync::Mutex<HashMap<i64, i64>>,
    /// Lanes the runtime dropped (it found the lease run out): their runs
    /// wait in the store and are adopted again at the next renewal.
    stale: std::sync::Mutex<HashSet<i64>>,
}

impl LaneOwnership for Lanes {
    fn owns(&self, conversation_id: i64) -> bool {
        !self.shared
            || self
                .until()
                .get(&conversation_id)
                .is_some_and(|until| *until > self.clock.now_ms())
    }

    fn lost(&self, conversation_id: i64) {
        // Only a lease still held here (run out locally, not yet renewed)
        // needs its runs back; one lost to another process is adopted there.
        if self.until().contains_key(&conversation_id) {
            self.mark_stale(conversation_id);
        }
    }
}

impl Lanes {
    pub fn new(
        store: SharedStore,
        owner: String,
        ttl: Duration,
        clock: SharedClock,
        runtimes: Vec<Arc<dyn Runtime>>,
    ) -> Arc<Lanes> {
        let lanes = Arc::new(Lanes {
            shared: !store.single_process(),
            store,
            owner,
            ttl_ms: ttl.as_millis() as i64,
            clock,
            runtimes: runtimes.into_iter().filter(|r| r.owns_lanes()).collect(),
            held: Mutex::new(HashMap::new()),
            until: std::sync::Mutex::new(HashMap::new()),
            stale: std::sync::Mutex::new(HashSet::new()),
        });
        if lanes.shared {
            let weak = Arc::downgrade(&lanes);
            let owner: Weak<dyn LaneOwnership> = weak;
            for runtime in &lanes.runtimes {
                runtime.attach_lanes(owner.clone());
            }
        }
        lanes
    }

    fn until(&self) -> std::sync::MutexGuard<'_, HashMap<i64, i64>> {
        self.until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stale(&self) -> std::sync::MutexGuard<'_, HashSet<i64>> {
        self.stale.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_stale(&self, conversation_id: i64) {
        self.stale().insert(conversation_id);
    }

    fn is_stale(&self, conversation_id: i64) -> bool {
        self.stale().contains(&conversation_id)
    }

    fn take_stale(&self, conversation_id: i64) -> bool {
        self.stale().remove(&conversation_id)
    }

    /// Record a (re)newed lease, or forget a lost or released one.
    fn set_until(&self, conversation_id: i64, until: Option<i64>) {
        match until {
            Some(until) => self.until().insert(conversation_id, until),
            None => self.until().remove(&conversation_id),
        };
    }

    /// Whether other processes may share the store (and lanes are leased).
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// This process's name in leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Make sure this process owns the conversation's lane: `true` when it
    /// does (renewing the lease when half of it is used up, and adopting
    /// the runs a previous owner left when it was not held here), `false`
    /// when another process holds it.
    pub async fn hold(&self, conversation_id: i64) -> StoreResult<bool> {
        if !self.shared {
            return Ok(true);
        }
        let mut held = self.held.lock().await;
        let now = self.clock.now_ms();
        if let Some(h) = held.get_mut(&conversation_id)
            && h.until - now > self.ttl_ms / 2
            && !self.is_stale(conversation_id)
        {
            h.used_at = now;
            return Ok(true);
        }
        let token = self
            .store
            .lease_acquire(
                &keys::lane_lease(conversation_id),
                &self.owner,
                self.ttl_ms,
                now,
            )
            .await?;
        if token.is_none() {
            self.set_until(conversation_id, None);
            self.take_stale(conversation_id);
            if held.remove(&conversation_id).is_some() {
                tracing::warn!(
                    conversation_id,
                    "lost the lease of a lane to another process (this one stalled past the lease)"
                );
            }
            return Ok(false);
        }
        // Newly held, or held again after the lease ran out here (the
        // runtime may have dropped the lane meanwhile): take the runs over.
        let fresh = held
            .insert(
                conversation_id,
                Held {
                    until: now + self.ttl_ms,
                    used_at: now,
                },
            )
            .is_none_or(|before| before.until <= now)
            | self.take_stale(conversation_id);
        self.set_until(conversation_id, Some(now + self.ttl_ms));
        if fresh && !self.adopt(conversation_id).await {
            // Without its earlier runs the lane would run out of order:
            // give it up and let a later try adopt them.
            held.remove(&conversation_id);
            self.set_until(conversation_id, None);
            self.store
                .lease_release(&keys::lane_lease(conversation_id), &self.owner)
                .await?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Take over the conversation's unfinished runs in every runtime that
    /// keeps lanes; `false` when one could not.
    async fn adopt(&self, conversation_id: i64) -> bool {
        for runtime in &self.runtimes {
            match runtime.adopt(conversation_id).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    conversation_id,
                    runtime = runtime.name(),
                    runs = n,
                    "took over runs another process left"
                ),
                Err(e) => {
                    tracing::warn!(conversation_id, runtime = runtime.name(), error = %e, "could not take over a lane's runs; retrying later");
                    return false;
                }
            }
        }
        true
    }

    /// How many lanes this process holds.
    pub async fn held(&self) -> usize {
        self.held.lock().await.len()
    }

    /// Renew the leases of busy and recently used lanes, release idle ones,
    /// and take over lanes whose owner died with runs unfinished; every
    /// third of the lease until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        if !self.shared {
            return;
        }
        let period = Duration::from_millis((self.ttl_ms / 3).max(100) as u64);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            self.maintain().await;
            if let Err(e) = self.sweep().await {
                tracing::warn!(error = %e, "could not look for lanes left by other processes; retrying");
            }
        }
    }

    async fn maintain(&self) {
        let mut held = self.held.lock().await;
        let ids: Vec<i64> = held.keys().copied().collect();
        for id in ids {
            // Read per lane: the round trips before this one took time.
            let now = self.clock.now_ms();
            let h = held[&id];
            let busy = self.runtimes.iter().any(|r| r.busy(id));
            let name = keys::lane_lease(id);
            if busy || now - h.used_at < self.ttl_ms {
                match self
                    .store
                    .lease_acquire(&name, &self.owner, self.ttl_ms, now)
                    .await
                {
                    Ok(Some(_)) => {
                        if let Some(h) = held.get_mut(&id) {
                            h.until = now + self.ttl_ms;
                        }
                        self.set_until(id, Some(now + self.ttl_ms));
                        // Renewed after it ran out here, or the runtime
                        // dropped the lane meanwhile: its runs may wait in
                        // the store only; take them back.
                        let stale = self.take_stale(id);
                        if (h.until <= now || stale) && !self.adopt(id).await {
                            self.mark_stale(id);
                        }
                    }
                    Ok(None) => {
                        tracing::warn!(
                            conversation_id = id,
                            "lost the lease of a lane to another process (this one stalled past the lease)"
                        );
                        held.remove(&id);
                        self.set_until(id, None);
                        self.take_stale(id);
                    }
                    Err(e) => {
                        tracing::warn!(conversation_id = id, error = %e, "could not renew a lane lease; retrying");
                    }
                }
            } else {
                self.set_until(id, None);
                self.take_stale(id);
                if let Err(e) = self.store.lease_release(&name, &self.owner).await {
                    tracing::warn!(conversation_id = id, error = %e, "could not release an idle lane; its lease runs out by itself");
                }
                held.remove(&id);
            }
        }
    }

    /// Unfinished runs of lanes nobody holds belong to a process that died:
    /// take their lanes (which adopts the runs).
    async fn sweep(&self) -> StoreResult<()> {
        const PAGE: usize = 512;
        if self.runtimes.is_empty() {
            return Ok(());
        }
        let ours: HashSet<&str> = self.runtimes.iter().map(|r| r.name()).collect();
        let mut tried: HashSet<i64> = HashSet::new();
        let mut after = 0;
        loop {
            let rows = self.store.runs_unfinished(after, PAGE).await?;
            for row in &rows {
                if !ours.contains(row.runtime.as_str()) || !tried.insert(row.conversation_id) {
                    continue;
                }
                if self.held.lock().await.contains_key(&row.conversation_id) {
                    continue;
                }
                self.hold(row.conversation_id).await?;
            }
            match rows.last() {
                Some(last) if rows.len() == PAGE => after = last.id,
                _ => return Ok(()),
            }
        }
    }

    /// Give every lane back (at shutdown, after the runtimes closed), so
    /// other processes take over at once instead of after the lease.
    pub async fn release_all(&self) {
        if !self.shared {
            return;
        }
        let mut held = self.held.lock().await;
        self.until().clear();
        self.stale().clear();
        let ids: Vec<i64> = held.drain().map(|(id, _)| id).collect();
        // Bounded: with the database gone, the leases run out by themselves
        // and shutdown must not wait for each release to time out.
        let release = async {
            for id in ids {
                if let Err(e) = self
                    .store
                    .lease_release(&keys::lane_lease(id), &self.owner)
                    .await
                {
                    tracing::warn!(conversation_id = id, error = %e, "could not release a lane lease; it runs out by itself");
                    return;
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(5), release)
            .await
            .is_err()
        {
            tracing::warn!("releasing lane leases took too long; the rest run out by themselves");
        }
    }
}
