//! How replies take shape for each channel account: a final answer is split
//! at the platform's limit (each chunk its own outbox item, sharing a
//! group), and its first chunk is linked to the run's streaming preview, so
//! the preview is edited into the answer when one was shown.

use std::collections::HashMap;
use std::sync::Arc;

use switchboard_channel::ChannelAdapter;

use crate::keys;
use crate::store::{ItemKind, NewReply};

/// Reply shaping for every channel account of a daemon.
#[derive(Clone, Default)]
pub struct Shaper {
    adapters: HashMap<String, Arc<dyn ChannelAdapter>>,
}

impl Shaper {
    /// `adapters` by channel account store identity.
    pub fn new(adapters: HashMap<String, Arc<dyn ChannelAdapter>>) -> Self {
        Shaper { adapters }
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
        let run = run_id.to_string();
        let chunks = self.split(account, text);
        let chunks = if chunks.is_empty() {
            vec![String::new()]
        } else {
            chunks
        };
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, chunk)| NewReply {
                item_key: keys::answer_item_key(&run, i + 1),
                kind: ItemKind::Answer,
                text: chunk,
                group_key: Some(keys::answer_group(&run)),
                edits_key: (i == 0).then(|| keys::preview_item_key(&run)),
                attachments: Vec::new(),
            })
            .collect()
    }

    /// A notice that takes the place of the run's answer (a failure): it
    /// replaces the preview when one was shown.
    pub fn run_notice(&self, run_id: i64, what: &str, text: &str) -> NewReply {
        NewReply {
            item_key: keys::run_notice_key(run_id, what),
            kind: ItemKind::Notice,
            text: text.to_owned(),
            group_key: None,
            edits_key: Some(keys::preview_item_key(&run_id.to_string())),
            attachments: Vec::new(),
        }
    }

    /// A superseded run: its preview, if one was shown, becomes `marker`;
    /// nothing is sent otherwise.
    pub fn discard(&self, run_id: i64, marker: &str) -> NewReply {
        NewReply {
            item_key: keys::run_notice_key(run_id, "discarded"),
            kind: ItemKind::Discard,
            text: marker.to_owned(),
            group_key: None,
            edits_key: Some(keys::preview_item_key(&run_id.to_string())),
            attachments: Vec::new(),
        }
    }
}
