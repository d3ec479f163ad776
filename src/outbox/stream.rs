//! Streaming delivery (DESIGN.md §4): what users see while a run is still
//! answering.
//!
//! On a streaming surface whose platform can edit messages, the first delta
//! of a run creates its durable *preview* item (the dispatcher sends it like
//! any other item, in the conversation's lane, and its receipt keeps the
//! message id). Later deltas become *transient* edits of that message, at
//! most one per `outbox.edit_interval_ms` per chat, drawn from the same rate
//! limit buckets as sends, never persisted and never replayed. The run's
//! final answer is a durable item that edits the preview into the exact
//! final text; transient edits stop once it exists, and never overlap it
//! (the chat's lock). In private chats of a platform with drafts (Telegram
//! `sendMessageDraft`, when the account enables them) the preview is a
//! transient draft instead: nothing durable exists until the final answer,
//! which is sent as a new message, and no draft follows it. On terminal-only
//! surfaces a typing indicator is shown instead, renewed while the run is
//! producing output.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use switchboard_channel::{
    ChannelAdapter, DeliveryError, OutboundMessage, OutboundMeta, Receipt, SendAction,
};
use tokio::sync::{Mutex, Notify, broadcast};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::ChatLocks;
use super::rate::RateLimiter;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::keys;
use crate::runtime::{Route, RunDelta};
use crate::store::{DispatchState, ItemKind, NewOutboxItem, SharedStore};
use crate::surface::Delivery;

/// How often pending edits are looked at.
const TICK: Duration = Duration::from_millis(100);
/// A stream with no delta for this long is forgotten (its run ended or died).
const IDLE: Duration = Duration::from_secs(120);

/// What the streaming side knows of a run's preview.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Preview {
    /// Not yet created.
    None,
    /// Created; waiting for its receipt.
    Created,
    /// Shown: edits go to this message.
    Shown(String),
    /// Streamed as transient drafts (no durable preview).
    Drafting,
    /// Replaced by the final answer, or never shown: no more edits.
    Done,
}

struct Stream {
    run_id: String,
    conversation_id: i64,
    route: Arc<Route>,
    delivery: Delivery,
    preview: Preview,
    /// The whole answer so far, and what the preview shows.
    text: String,
    shown: String,
    last_edit: Option<Instant>,
    last_typing: Option<Instant>,
    last_delta: Instant,
    /// An edit of this stream is in flight.
    editing: Arc<AtomicBool>,
    /// The outcome of the last edit, when it finished.
    edited: Arc<Mutex<Option<EditResult>>>,
}

#[derive(Debug)]
enum EditResult {
    Shown(String),
    Replaced,
    Skipped,
}

pub struct Streamer {
    pub store: SharedStore,
    pub adapters: HashMap<String, Arc<dyn ChannelAdapter>>,
    pub config: Arc<Config>,
    /// Configured account names, by store identity.
    pub account_names: HashMap<String, String>,
    pub rate: Arc<RateLimiter>,
    pub chat_locks: Arc<ChatLocks>,
    pub clock: SharedClock,
    pub dispatcher_wake: Arc<Notify>,
}

impl Streamer {
    /// Follow one runtime's deltas until `stop`.
    pub async fn run(
        self: Arc<Self>,
        mut deltas: broadcast::Receiver<RunDelta>,
        stop: CancellationToken,
    ) {
        let mut streams: HashMap<String, Stream> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                delta = deltas.recv() => match delta {
                    Ok(delta) => self.on_delta(&mut streams, delta).await,
                    // A missed delta costs nothing: the next one carries the
                    // whole text.
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick() => self.flush(&mut streams).await,
            }
        }
    }

    async fn on_delta(&self, streams: &mut HashMap<String, Stream>, delta: RunDelta) {
        let now = Instant::now();
        let stream = streams.entry(delta.run_id.clone()).or_insert_with(|| {
            let name = self
                .account_names
                .get(&delta.route.account)
                .map(String::as_str)
                .unwrap_or_default();
            let delivery = self
                .config
                .surface_for(name, delta.route.surface, &delta.route.chat_id)
                .delivery;
            Stream {
                run_id: delta.run_id.clone(),
                conversation_id: delta.conversation_id,
                route: delta.route.clone(),
                delivery,
                preview: Preview::None,
                text: String::new(),
                shown: String::new(),
                last_edit: None,
                last_typing: None,
                last_delta: now,
                editing: Arc::new(AtomicBool::new(false)),
                edited: Arc::new(Mutex::new(None)),
            }
        });
        stream.text = delta.text;
        stream.last_delta = now;
        let Some(adapter) = self.adapters.get(&stream.route.account).cloned() else {
            return;
        };
        let capabilities = adapter.capabilities();
        match stream.delivery {
            Delivery::TerminalOnly => {
                let due = stream.last_typing.is_none_or(|t| {
                    now.duration_since(t)
                        >= Duration::from_millis(self.config.outbox.typing_interval_ms)
                });
                if capabilities.typing && due {
                    stream.last_typing = Some(now);
                    let route = stream.route.clone();
                    if self.rate.try_acquire(
                        &route.account,
                        &route.chat_id,
                        route.surface.is_group(),
                    ) {
                        tokio::spawn(async move {
                            if let Err(e) = adapter
                                .typing(&route.chat_id, route.thread_id.as_deref())
                                .await
                            {
                                tracing::debug!(chat = %route.chat_id, error = %e, "typing indicator not shown");
                            }
                        });
                    }
                }
            }
            Delivery::Streaming
                if capabilities.drafts
                    && !stream.route.surface.is_group()
                    && stream.preview == Preview::None =>
            {
                stream.preview = Preview::Drafting;
            }
            Delivery::Streaming if capabilities.edit && stream.preview == Preview::None => {
                self.create_preview(stream, adapter.as_ref()).await;
            }
            Delivery::Streaming => {}
        }
    }

    /// The run's first words: its durable preview item, unless its answer
    /// already exists (a preview must never follow its answer).
    async fn create_preview(&self, stream: &mut Stream, adapter: &dyn ChannelAdapter) {
        let first = adapter
            .split(&stream.text)
            .into_iter()
            .next()
            .unwrap_or_default();
        let item = NewOutboxItem {
            item_key: keys::preview_item_key(&stream.run_id),
            conversation_id: stream.conversation_id,
            account: stream.route.account.clone(),
            chat_id: stream.route.chat_id.clone(),
            thread_id: stream.route.thread_id.clone(),
            surface: stream.route.surface,
            reply_to: stream.route.reply_to.clone(),
            run_id: Some(stream.run_id.clone()),
            kind: ItemKind::Preview,
            text: first.clone(),
            group_key: None,
            edits_key: None,
            attachments: Vec::new(),
            created_at: self.clock.now_ms(),
        };
        match self.store.outbox_enqueue_preview(&item).await {
            Ok(true) => {
                stream.preview = Preview::Created;
                stream.shown = first;
                stream.last_edit = Some(Instant::now());
                self.dispatcher_wake.notify_one();
            }
            // The preview exists (a re-run after a restart) or its answer
            // does: find out which when edits are due.
            Ok(false) => stream.preview = Preview::Created,
            Err(e) => {
                tracing::warn!(run = %stream.run_id, error = %e, "could not create a streaming preview")
            }
        }
    }

    /// Send the edits that are due, and forget finished streams.
    async fn flush(self: &Arc<Self>, streams: &mut HashMap<String, Stream>) {
        let now = Instant::now();
        let interval = Duration::from_millis(self.config.outbox.edit_interval_ms);
        for stream in streams.values_mut() {
            if let Ok(mut edited) = stream.edited.try_lock()
                && let Some(result) = edited.take()
            {
                match result {
                    EditResult::Shown(text) => {
                        stream.shown = text;
                    }
                    EditResult::Replaced => stream.preview = Preview::Done,
                    EditResult::Skipped => {}
                }
            }
            if stream.preview == Preview::Created {
                stream.preview = match self
                    .store
                    .outbox_get_by_key(&keys::preview_item_key(&stream.run_id))
                    .await
                {
                    Ok(Some(item)) if item.state == DispatchState::Acknowledged => item
                        .receipt
                        .and_then(|r| serde_json::from_str::<Receipt>(&r).ok())
                        .and_then(|r| r.message_ids.into_iter().next())
                        .map_or(Preview::Done, Preview::Shown),
                    Ok(Some(item))
                        if matches!(
                            item.state,
                            DispatchState::NotDispatched | DispatchState::PossiblyDispatched
                        ) =>
                    {
                        Preview::Created
                    }
                    Ok(Some(_)) => Preview::Done,
                    // Never created: its answer came first.
                    Ok(None) => Preview::Done,
                    Err(_) => Preview::Created,
                };
            }
            let message_id = match &stream.preview {
                Preview::Shown(id) => Some(id.clone()),
                Preview::Drafting => None,
                _ => continue,
            };
            let due = stream
                .last_edit
                .is_none_or(|t| now.duration_since(t) >= interval);
            if !due || stream.editing.load(Ordering::SeqCst) {
                continue;
            }
            let Some(adapter) = self.adapters.get(&stream.route.account).cloned() else {
                continue;
            };
            let text = adapter
                .split(&stream.text)
                .into_iter()
                .next()
                .unwrap_or_default();
            if text == stream.shown {
                continue;
            }
            stream.last_edit = Some(now);
            stream.editing.store(true, Ordering::SeqCst);
            let this = self.clone();
            let run_id = stream.run_id.clone();
            let conversation_id = stream.conversation_id;
            let route = stream.route.clone();
            let editing = stream.editing.clone();
            let edited = stream.edited.clone();
            tokio::spawn(async move {
                let result = this
                    .edit(
                        adapter.as_ref(),
                        &run_id,
                        conversation_id,
                        &route,
                        message_id,
                        text,
                    )
                    .await;
                *edited.lock().await = Some(result);
                editing.store(false, Ordering::SeqCst);
            });
        }
        streams.retain(|_, s| {
            s.preview != Preview::Done
                && (now.duration_since(s.last_delta) < IDLE || s.editing.load(Ordering::SeqCst))
        });
    }

    /// One transient edit of a shown preview, or one draft when
    /// `message_id` is `None`.
    async fn edit(
        &self,
        adapter: &dyn ChannelAdapter,
        run_id: &str,
        conversation_id: i64,
        route: &Route,
        message_id: Option<String>,
        text: String,
    ) -> EditResult {
        let preview_key = keys::preview_item_key(run_id);
        // Under the chat's lock: the final answer's edit cannot overlap
        // this one, and once it exists no transient edit follows it.
        let _order = self.chat_locks.lock(&route.account, &route.chat_id).await;
        match self.store.outbox_replaced(&preview_key).await {
            Ok(true) => return EditResult::Replaced,
            Ok(false) => {}
            Err(_) => return EditResult::Skipped,
        }
        if !self
            .rate
            .try_acquire(&route.account, &route.chat_id, route.surface.is_group())
        {
            return EditResult::Skipped;
        }
        let Some(message_id) = message_id else {
            return match adapter
                .draft(
                    &route.chat_id,
                    route.thread_id.as_deref(),
                    draft_id(run_id),
                    &text,
                )
                .await
            {
                Ok(()) => EditResult::Shown(text),
                Err(DeliveryError::RetryAfter { after, scope }) => {
                    self.rate
                        .pause(&route.account, &route.chat_id, scope, after);
                    EditResult::Skipped
                }
                Err(e) => {
                    tracing::debug!(run = run_id, error = %e, "draft not shown; the final answer is still sent");
                    EditResult::Skipped
                }
            };
        };
        let message = OutboundMessage {
            // Transient: each edit its own key, never stored.
            item_key: format!("{preview_key}-edit-{}", self.clock.now_ms()),
            chat_id: route.chat_id.clone(),
            thread_id: route.thread_id.clone(),
            text: text.clone(),
            attachments: Vec::new(),
            reply_to: None,
            action: SendAction::Edit { message_id },
            meta: OutboundMeta {
                conversation_id,
                ordinal: 0,
                run_id: Some(run_id.to_owned()),
            },
        };
        match adapter.send(&message).await {
            Ok(_) => EditResult::Shown(text),
            Err(DeliveryError::RetryAfter { after, scope }) => {
                self.rate
                    .pause(&route.account, &route.chat_id, scope, after);
                EditResult::Skipped
            }
            Err(e) => {
                tracing::debug!(run = run_id, error = %e, "transient preview edit failed; the final answer still replaces the preview");
                EditResult::Skipped
            }
        }
    }
}

/// A run's draft id: non-zero, and the same for every draft of its answer.
fn draft_id(run_id: &str) -> i64 {
    match run_id.parse::<i64>() {
        Ok(id) if id > 0 => id,
        _ => {
            // Remote runtimes name runs with strings: FNV-1a, kept positive.
            let hash = run_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            (hash >> 1).max(1) as i64
        }
    }
}
