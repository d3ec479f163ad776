//! How replies take shape for each channel account: a final answer is split
//! at the platform's limit (each chunk its own outbox item, sharing a
//! group), and its first chunk is linked to the run's streaming preview, so
//! the preview is edited into the answer when one was shown.

use std::collections::HashMap;
use std::sync::Arc;

use switchboard_channel::{AttachmentRef, ChannelAdapter};

use crate::keys;
use crate::store::{ItemKind, NewReply};

/// Reply shaping for every channel account of a daemon.
#[derive(Clone, Default)]
pub struct Shaper {
    adapters: HashMap<String, Arc<dyn ChannelAdapter>>,
    /// Runs answer elsewhere (`switchboard runtime serve`): no reply items.
    detached: bool,
}

impl Shaper {
    /// For a runtime served over the protocol: its answers leave as events,
    /// so runs write no reply items.
    pub fn detached() -> Self {
        Shaper {
            adapters: HashMap::new(),
            detached: true,
        }
    }

    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// `adapters` by channel account store identity.
    pub fn new(adapters: HashMap<String, Arc<dyn ChannelAdapter>>) -> Self {
        Shaper {
            adapters,
            detached: false,
        }
    }

    /// Split text at the account's limit (unsplit for an unknown account).
    pub fn split(&self, account: &str, text: &str) -> Vec<String> {
        match self.adapters.get(account) {
            Some(adapter) => adapter.split(text),
            None => vec![text.to_owned()],
        }
    }

    /// A run's final answer as reply items: one per chunk, the first one
    /// editing the run's preview when it was shown.
    pub fn answer(&self, account: &str, run_id: i64, text: &str) -> Vec<NewReply> {
        self.answer_with(account, &run_id.to_string(), text, Vec::new(), None)
    }

    /// [`Shaper::answer`] for any run key, with files (carried by the last
    /// chunk) and, for remote runtimes, the durable event id the items are
    /// keyed by.
    pub fn answer_with(
        &self,
        account: &str,
        run: &str,
        text: &str,
        attachments: Vec<AttachmentRef>,
        event_id: Option<i64>,
    ) -> Vec<NewReply> {
        let chunks = self.split(account, text);
        let chunks = if chunks.is_empty() {
            vec![String::new()]
        } else {
            chunks
        };
        let last = chunks.len() - 1;
        let mut attachments = Some(attachments);
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, chunk)| NewReply {
                item_key: match event_id {
                    Some(event) => keys::event_item_key(run, event, i + 1),
                    None => keys::answer_item_key(run, i + 1),
                },
                kind: ItemKind::Answer,
                text: chunk,
                group_key: Some(keys::answer_group(run)),
                edits_key: (i == 0).then(|| keys::preview_item_key(run)),
                attachments: if i == last {
                    attachments.take().unwrap_or_default()
                } else {
                    Vec::new()
                },
            })
            .collect()
    }

    /// A notice that takes the place of the run's answer (a failure): it
    /// replaces the preview when one was shown.
    pub fn run_notice(&self, run_id: i64, what: &str, text: &str) -> NewReply {
        self.run_notice_for(&run_id.to_string(), what, text)
    }

    /// [`Shaper::run_notice`] for any run key.
    pub fn run_notice_for(&self, run: &str, what: &str, text: &str) -> NewReply {
        NewReply {
            item_key: keys::run_notice_key_for(run, what),
            kind: ItemKind::Notice,
            text: text.to_owned(),
            group_key: None,
            edits_key: Some(keys::preview_item_key(run)),
            attachments: Vec::new(),
        }
    }

    /// A superseded run: its preview, if one was shown, becomes `marker`;
    /// nothing is sent otherwise.
    pub fn discard(&self, run_id: i64, marker: &str) -> NewReply {
        self.discard_for(&run_id.to_string(), marker)
    }

    /// [`Shaper::discard`] for any run key.
    pub fn discard_for(&self, run: &str, marker: &str) -> NewReply {
        NewReply {
            item_key: keys::run_notice_key_for(run, "discarded"),
            kind: ItemKind::Discard,
            text: marker.to_owned(),
            group_key: None,
            edits_key: Some(keys::preview_item_key(run)),
            attachments: Vec::new(),
        }
    }
}
