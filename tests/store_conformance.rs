//! The store conformance suite: what every backend must do, written once
//! against the `Store` traits and run against each backend on a real
//! database (a real SQLite file here; PostgreSQL joins with its backend).

use std::sync::Arc;

mod pg;

use switchboard::config::{StoreConfig, Synchronous};
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{self, SharedStore};

mod suite {
    use switchboard::store::*;
    use switchboard::surface::SurfaceKind;
    use switchboard_channel::ChatKind;

    pub fn inbound(account: &str, key: &str, chat: &str, thread: Option<&str>) -> NewInbound {
        NewInbound {
            account: account.into(),
            update_key: key.into(),
            chat_id: chat.into(),
            chat_kind: ChatKind::Private,
            thread_id: thread.map(Into::into),
            surface: SurfaceKind::Webhook,
            sender_id: Some("u".into()),
            sender_name: None,
            message_id: Some(format!("msg-{key}")),
            payload: format!(r#"{{"type":"message","text":"{key}"}}"#),
            disposition: Disposition::Pending,
            reason: None,
            submission_key: switchboard::keys::submission_key(account, key),
            input_policy: None,
            closes_conversation: false,
            migrates_to: None,
            space: None,
            addressed: true,
            received_at: 1_000,
        }
    }

    fn ids(outcome: JournalOutcome) -> (bool, i64, i64) {
        match outcome {
            JournalOutcome::Accepted {
                inbound_id,
                conversation_id,
            } => (true, inbound_id, conversation_id),
            JournalOutcome::Duplicate {
                inbound_id,
                conversation_id,
            } => (false, inbound_id, conversation_id),
        }
    }

    pub async fn journal_deduplicates_within_and_across_batches(store: SharedStore) {
        let batch = vec![
            inbound("webhook:a", "1", "c", None),
            inbound("webhook:a", "1", "c", None),
            inbound("webhook:b", "1", "c", None),
        ];
        let out: Vec<_> = store
            .journal_insert(&batch)
            .await
            .unwrap()
            .into_iter()
            .map(ids)
            .collect();
        assert!(out[0].0, "first is new");
        assert_eq!(
            out[1],
            (false, out[0].1, out[0].2),
            "same key in one batch is a duplicate of the first"
        );
        assert!(
            out[2].0,
            "the same update key under another account is a different update"
        );
        let again = store.journal_insert(&batch[..1]).await.unwrap();
        assert_eq!(
            ids(again[0]),
            (false, out[0].1, out[0].2),
            "a later batch sees the committed row"
        );
    }

    pub async fn journal_resolves_conversations_by_chat_and_thread(store: SharedStore) {
        let out: Vec<_> = store
            .journal_insert(&[
                inbound("webhook:a", "1", "c1", None),
                inbound("webhook:a", "2", "c1", None),
                inbound("webhook:a", "3", "c1", Some("t")),
                inbound("webhook:a", "4", "c2", None),
                inbound("webhook:b", "5", "c1", None),
            ])
            .await
            .unwrap()
            .into_iter()
            .map(ids)
            .collect();
        assert_eq!(out[0].2, out[1].2, "same chat, same conversation");
        assert_ne!(out[0].2, out[2].2, "a thread is its own conversation");
        assert_ne!(out[0].2, out[3].2);
        assert_ne!(
            out[0].2, out[4].2,
            "another account's chat is another conversation"
        );
    }

    pub async fn journal_pending_in_order_and_admission_settles(store: SharedStore) {
        let batch: Vec<_> = (0..10)
            .map(|i| inbound("webhook:a", &i.to_string(), "c", None))
            .collect();
        store.journal_insert(&batch).await.unwrap();
        let mut ignored = inbound("webhook:a", "ignored", "c", None);
        ignored.disposition = Disposition::Ignored;
        ignored.reason = Some("unsupported".into());
        store.journal_insert(&[ignored]).await.unwrap();

        let pending = store.journal_pending(4).await.unwrap();
        let keys: Vec<_> = pending.iter().map(|r| r.update_key.as_str()).collect();
        assert_eq!(
            keys,
            ["0", "1", "2", "3"],
            "oldest first, bounded by the limit"
        );
        store
            .journal_admit(
                &pending
                    .iter()
                    .map(|r| Admitted {
                        inbound_id: r.id,
                        run_id: format!("r{}", r.id),
                    })
                    .collect::<Vec<_>>(),
                2_000,
            )
            .await
            .unwrap();
        let next = store.journal_pending(100).await.unwrap();
        assert_eq!(next.len(), 6, "admitted and ignored rows are not pending");
        assert_eq!(next[0].update_key, "4");

        let row = store.journal_get(pending[0].id).await.unwrap().unwrap();
        assert_eq!(row.disposition, Disposition::Admitted);
        assert_eq!(row.run_id.as_deref(), Some(format!("r{}", row.id).as_str()));
        assert_eq!(row.settled_at, Some(2_000));

        // A settled row does not change again.
        assert!(
            !store
                .journal_settle(row.id, Disposition::Failed, "late", None, 3_000)
                .await
                .unwrap()
        );
        assert!(
            store
                .journal_settle(next[0].id, Disposition::Rejected, "no", None, 3_000)
                .await
                .unwrap()
        );
        let counts: std::collections::HashMap<_, _> =
            store.journal_counts().await.unwrap().into_iter().collect();
        assert_eq!(counts[&Disposition::Admitted], 4);
        assert_eq!(counts[&Disposition::Ignored], 1);
        assert_eq!(counts[&Disposition::Rejected], 1);
        assert_eq!(counts[&Disposition::Pending], 5);
    }

    pub fn run_of(conversation_id: i64, mode: RunMode) -> NewRun {
        NewRun {
            conversation_id,
            runtime: "default".into(),
            account: "webhook:a".into(),
            chat_id: "c".into(),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: Some("m1".into()),
            mode,
            created_at: 1_000,
        }
    }

    pub fn admit(key: &str, conversation_id: i64, target: AdmitTarget) -> Admit {
        Admit {
            idempotency_key: key.into(),
            conversation_id,
            inbound_id: None,
            input: format!(r#"{{"text":"{key}"}}"#),
            target,
            interrupt: None,
            created_at: 1_000,
        }
    }

    pub fn new_run(key: &str, conversation_id: i64) -> Admit {
        admit(
            key,
            conversation_id,
            AdmitTarget::NewRun(run_of(conversation_id, RunMode::Ordinary)),
        )
    }

    pub async fn runs_admit_is_idempotent(store: SharedStore) {
        let first = store
            .runs_admit(&[new_run("k1", 1), new_run("k2", 1), new_run("k1", 1)])
            .await
            .unwrap();
        assert!(first[0].new && first[1].new);
        assert_eq!(
            first[2],
            AdmitOutcome {
                run_id: first[0].run_id,
                new: false,
                state: RunState::Queued,
                absorbed_by: None
            }
        );
        let again = store.runs_admit(&[new_run("k2", 1)]).await.unwrap();
        assert_eq!(again[0].run_id, first[1].run_id);
        assert!(!again[0].new);
    }

    pub async fn runs_coalesce_into_a_queued_run_only(store: SharedStore) {
        let out = store
            .runs_admit(&[
                new_run("a", 1),
                admit("b", 1, AdmitTarget::JoinBatch { index: 0 }),
            ])
            .await
            .unwrap();
        assert_eq!(
            out[1].run_id, out[0].run_id,
            "joined the run admitted just before"
        );
        let later = store
            .runs_admit(&[admit(
                "c",
                1,
                AdmitTarget::Join {
                    run_id: out[0].run_id,
                },
            )])
            .await
            .unwrap();
        assert_eq!(later[0].run_id, out[0].run_id);
        let inputs = store.run_inputs(out[0].run_id).await.unwrap();
        assert_eq!(
            inputs
                .iter()
                .map(|i| i.idempotency_key.as_str())
                .collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        // Once the run started, a join gets a run of its own.
        store.runs_start(&[out[0].run_id], 2_000).await.unwrap();
        let late = store
            .runs_admit(&[admit(
                "d",
                1,
                AdmitTarget::Join {
                    run_id: out[0].run_id,
                },
            )])
            .await
            .unwrap();
        assert_ne!(late[0].run_id, out[0].run_id);
        assert!(late[0].new);
        let row = store.run_get(late[0].run_id).await.unwrap().unwrap();
        assert_eq!(
            (row.mode, row.state, row.reply_to.as_deref()),
            (RunMode::Ordinary, RunState::Queued, Some("m1"))
        );
    }

    pub async fn runs_interrupt_requests_and_recovery_scan(store: SharedStore) {
        let a = store.runs_admit(&[new_run("a", 1)]).await.unwrap()[0].run_id;
        store.runs_start(&[a], 2_000).await.unwrap();
        let mut next = admit("b", 1, AdmitTarget::NewRun(run_of(1, RunMode::Urgent)));
        next.interrupt = Some((a, RunState::Superseded));
        let b = store.runs_admit(&[next]).await.unwrap()[0].run_id;
        let a_row = store.run_get(a).await.unwrap().unwrap();
        assert_eq!(
            (a_row.state, a_row.end_as),
            (RunState::InterruptRequested, Some(RunState::Superseded))
        );
        let b_row = store.run_get(b).await.unwrap().unwrap();
        assert_eq!((b_row.mode, b_row.priority), (RunMode::Urgent, 1));
        let unfinished: Vec<i64> = store
            .runs_unfinished(0, 10)
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(unfinished, [a, b]);
    }

    fn finish(run_id: i64, key: &str, text: &str) -> RunFinish {
        RunFinish {
            run_id,
            state: RunState::Completed,
            answer: Some(text.into()),
            prompt: Some(format!(r#"["q {text}"]"#)),
            reason: None,
            replies: vec![NewReply {
                item_key: key.into(),
                kind: ItemKind::Answer,
                text: text.into(),
                group_key: None,
                edits_key: None,
                attachments: Vec::new(),
            }],
            absorb: vec![],
            now: 5_000,
        }
    }

    pub async fn runs_finish_writes_reply_items_once(store: SharedStore) {
        let runs = store
            .runs_admit(&[new_run("k1", 7), new_run("k2", 7)])
            .await
            .unwrap();
        store.runs_start(&[runs[0].run_id], 2_000).await.unwrap();
        let row = store.run_get(runs[0].run_id).await.unwrap().unwrap();
        assert_eq!(row.state, RunState::Running);
        assert_eq!(row.started_at, Some(2_000));

        let done = store
            .runs_finish(&[
                finish(runs[0].run_id, "a1", "one"),
                finish(runs[1].run_id, "a2", "two"),
            ])
            .await
            .unwrap();
        assert_eq!(done, [true, true]);
        // Finishing again changes nothing and writes no second item.
        assert_eq!(
            store
                .runs_finish(&[finish(runs[0].run_id, "a1-again", "x")])
                .await
                .unwrap(),
            [false]
        );
        // A late start does not resurrect a finished run.
        store.runs_start(&[runs[1].run_id], 9_000).await.unwrap();
        assert_eq!(
            store.run_get(runs[1].run_id).await.unwrap().unwrap().state,
            RunState::Completed
        );

        let items = store
            .outbox_list(&OutboxFilter {
                conversation_id: Some(7),
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(items.len(), 2);
        let mut by_ordinal: Vec<_> = items
            .iter()
            .map(|i| (i.ordinal, i.item_key.as_str(), i.text.as_str()))
            .collect();
        by_ordinal.sort();
        assert_eq!(by_ordinal, [(1, "a1", "one"), (2, "a2", "two")]);
        let first = items.iter().find(|i| i.ordinal == 1).unwrap();
        assert_eq!(
            first.reply_to.as_deref(),
            Some("m1"),
            "the reply item is routed like its run"
        );
        assert_eq!(first.state, DispatchState::NotDispatched);
        assert_eq!(first.run_id, Some(runs[0].run_id.to_string()));
    }

    pub async fn runs_unfinished_pages_in_id_order(store: SharedStore) {
        let keys: Vec<String> = (0..7).map(|i| format!("k{i}")).collect();
        let runs = store
            .runs_admit(&keys.iter().map(|k| new_run(k, 1)).collect::<Vec<_>>())
            .await
            .unwrap();
        store
            .runs_finish(&[finish(runs[2].run_id, "x", "x")])
            .await
            .unwrap();
        let page1 = store.runs_unfinished(0, 3).await.unwrap();
        let page2 = store
            .runs_unfinished(page1.last().unwrap().id, 3)
            .await
            .unwrap();
        let page3 = store
            .runs_unfinished(page2.last().unwrap().id, 3)
            .await
            .unwrap();
        let all: Vec<i64> = page1
            .iter()
            .chain(&page2)
            .chain(&page3)
            .map(|r| r.id)
            .collect();
        let expected: Vec<i64> = runs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, r)| r.run_id)
            .collect();
        assert_eq!(all, expected);
    }

    pub async fn runs_unfinished_in_one_conversation(store: SharedStore) {
        let runs = store
            .runs_admit(&[new_run("a1", 1), new_run("b1", 2), new_run("a2", 1)])
            .await
            .unwrap();
        store
            .runs_finish(&[finish(runs[0].run_id, "a1", "done")])
            .await
            .unwrap();
        let of_1: Vec<i64> = store
            .runs_unfinished_in(1)
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(
            of_1,
            [runs[2].run_id],
            "finished runs and other conversations are left out"
        );
        assert!(store.runs_unfinished_in(3).await.unwrap().is_empty());
    }

    pub async fn leases_expire_and_fence_takeovers(store: SharedStore) {
        let t1 = store
            .lease_acquire("poller:x", "a", 1_000, 0)
            .await
            .unwrap();
        assert_eq!(t1, Some(1), "a free lease is taken with the first token");
        assert_eq!(
            store
                .lease_acquire("poller:x", "b", 1_000, 500)
                .await
                .unwrap(),
            None,
            "held and unexpired: another owner is refused"
        );
        assert_eq!(
            store
                .lease_acquire("poller:x", "a", 1_000, 900)
                .await
                .unwrap(),
            Some(1),
            "the owner renews under the same token"
        );
        assert_eq!(
            store
                .lease_acquire("poller:x", "b", 1_000, 1_800)
                .await
                .unwrap(),
            None,
            "the renewal moved the expiry to 1900"
        );
        assert_eq!(
            store
                .lease_acquire("poller:x", "b", 1_000, 1_900)
                .await
                .unwrap(),
            Some(2),
            "expired: another owner takes over with a newer token"
        );
        assert_eq!(
            store
                .lease_acquire("poller:x", "a", 1_000, 2_000)
                .await
                .unwrap(),
            None,
            "the old owner cannot take it back while the new one holds it"
        );
        assert_eq!(
            store
                .lease_acquire("poller:y", "a", 1_000, 2_000)
                .await
                .unwrap(),
            Some(1),
            "leases are independent by name"
        );
        store.lease_release("poller:x", "a").await.unwrap();
        assert_eq!(
            store
                .lease_acquire("poller:x", "a", 1_000, 2_100)
                .await
                .unwrap(),
            None,
            "only the holder can release"
        );
        store.lease_release("poller:x", "b").await.unwrap();
        assert!(
            store
                .lease_acquire("poller:x", "a", 1_000, 2_100)
                .await
                .unwrap()
                .is_some(),
            "released: free at once"
        );
    }

    pub async fn journal_pending_for_skips_lanes_held_elsewhere(store: SharedStore) {
        let out = store
            .journal_insert(&[
                inbound("webhook:a", "1", "c1", None),
                inbound("webhook:a", "2", "c2", None),
                inbound("webhook:a", "3", "c3", None),
            ])
            .await
            .unwrap();
        let conv: Vec<i64> = out.into_iter().map(|o| ids(o).2).collect();
        let lane = |i: usize| switchboard::keys::lane_lease(conv[i]);
        assert!(
            store
                .lease_acquire(&lane(0), "other", 1_000, 0)
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            store
                .lease_acquire(&lane(1), "me", 1_000, 0)
                .await
                .unwrap()
                .is_some()
        );
        let keys =
            |rows: Vec<InboundRow>| rows.into_iter().map(|r| r.update_key).collect::<Vec<_>>();
        assert_eq!(
            keys(store.journal_pending_for("me", 500, 10).await.unwrap()),
            ["2", "3"],
            "rows of a lane another process holds are left to it; own and free lanes are read"
        );
        assert_eq!(
            keys(store.journal_pending_for("other", 500, 10).await.unwrap()),
            ["1", "3"]
        );
        assert_eq!(
            keys(store.journal_pending_for("me", 1_000, 10).await.unwrap()),
            ["1", "2", "3"],
            "an expired lease holds nothing back"
        );
        assert_eq!(
            keys(store.journal_pending_for("me", 1_000, 2).await.unwrap()),
            ["1", "2"],
            "bounded by the limit"
        );
    }

    pub async fn runs_absorb_only_when_completing(store: SharedStore) {
        let out = store
            .runs_admit(&[
                new_run("a", 3),
                admit("b", 3, AdmitTarget::NewRun(run_of(3, RunMode::Inject))),
                admit("c", 3, AdmitTarget::NewRun(run_of(3, RunMode::Inject))),
            ])
            .await
            .unwrap();
        let (a, b, c) = (out[0].run_id, out[1].run_id, out[2].run_id);
        // An interrupted run absorbs nothing.
        let mut cut = finish(a, "a-answer", "half");
        cut.state = RunState::Interrupted;
        cut.absorb = vec![b];
        assert_eq!(store.runs_finish(&[cut]).await.unwrap(), [true]);
        assert_eq!(
            store.run_get(b).await.unwrap().unwrap().state,
            RunState::Queued
        );
        // A completing run absorbs, and the absorbed key names it.
        let mut done = finish(b, "b-answer", "both");
        done.absorb = vec![c];
        assert_eq!(store.runs_finish(&[done]).await.unwrap(), [true]);
        let c_row = store.run_get(c).await.unwrap().unwrap();
        assert_eq!(
            (c_row.state, c_row.absorbed_by),
            (RunState::Absorbed, Some(b))
        );
        let again = store
            .runs_admit(&[admit(
                "c",
                3,
                AdmitTarget::NewRun(run_of(3, RunMode::Inject)),
            )])
            .await
            .unwrap();
        assert_eq!(
            again[0],
            AdmitOutcome {
                run_id: c,
                new: false,
                state: RunState::Absorbed,
                absorbed_by: Some(b)
            }
        );
    }

    pub async fn runs_stop_cancels_queued_and_interrupts_running(store: SharedStore) {
        // Journal rows for the inputs, so their dispositions can be checked.
        let rows: Vec<i64> = store
            .journal_insert(&[
                inbound("webhook:a", "1", "c", None),
                inbound("webhook:a", "2", "c", None),
                inbound("webhook:a", "3", "c", None),
            ])
            .await
            .unwrap()
            .into_iter()
            .map(|o| match o {
                JournalOutcome::Accepted { inbound_id, .. } => inbound_id,
                other => panic!("{other:?}"),
            })
            .collect();
        let conversation = store
            .journal_get(rows[0])
            .await
            .unwrap()
            .unwrap()
            .conversation_id;
        let admits: Vec<Admit> = rows
            .iter()
            .enumerate()
            .map(|(i, id)| Admit {
                inbound_id: Some(*id),
                ..new_run(&format!("k{i}"), conversation)
            })
            .collect();
        let runs: Vec<i64> = store
            .runs_admit(&admits)
            .await
            .unwrap()
            .iter()
            .map(|o| o.run_id)
            .collect();
        store
            .journal_admit(
                &rows
                    .iter()
                    .zip(&runs)
                    .map(|(i, r)| Admitted {
                        inbound_id: *i,
                        run_id: r.to_string(),
                    })
                    .collect::<Vec<_>>(),
                1_500,
            )
            .await
            .unwrap();
        store.runs_start(&[runs[0]], 2_000).await.unwrap();

        let notice = |key: &str| NewOutboxItem {
            text: "Stopped.".into(),
            ..item(key, conversation)
        };
        let outcome = store
            .runs_stop(&StopRequest {
                conversation_id: conversation,
                reason: "/stop".into(),
                notice: Some(notice("stop-1")),
                now: 3_000,
            })
            .await
            .unwrap();
        assert_eq!(
            outcome,
            StopOutcome {
                interrupted: Some(runs[0]),
                cancelled: vec![runs[1], runs[2]]
            }
        );
        for (id, want) in rows.iter().zip([
            Disposition::Admitted,
            Disposition::Cancelled,
            Disposition::Cancelled,
        ]) {
            assert_eq!(
                store.journal_get(*id).await.unwrap().unwrap().disposition,
                want
            );
        }
        // The confirmation waits for the interrupted run's last words.
        assert!(
            store
                .outbox_list(&OutboxFilter {
                    conversation_id: Some(conversation),
                    limit: 10,
                    ..Default::default()
                })
                .await
                .unwrap()
                .is_empty()
        );
        let mut cut = finish(runs[0], "partial", "half an answer [interrupted]");
        cut.state = RunState::Interrupted;
        store.runs_finish(&[cut]).await.unwrap();
        let mut items = store
            .outbox_list(&OutboxFilter {
                conversation_id: Some(conversation),
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        items.sort_by_key(|i| i.ordinal);
        assert_eq!(
            items
                .iter()
                .map(|i| i.item_key.as_str())
                .collect::<Vec<_>>(),
            ["partial", "stop-1"]
        );

        // With nothing running, the confirmation is written at once.
        let outcome = store
            .runs_stop(&StopRequest {
                conversation_id: conversation,
                reason: "/stop".into(),
                notice: Some(notice("stop-2")),
                now: 4_000,
            })
            .await
            .unwrap();
        assert_eq!(outcome, StopOutcome::default());
        assert!(
            store
                .outbox_list(&OutboxFilter {
                    limit: 10,
                    ..Default::default()
                })
                .await
                .unwrap()
                .iter()
                .any(|i| i.item_key == "stop-2")
        );
    }

    pub async fn runs_history_is_recent_turns_that_reach_prompts(store: SharedStore) {
        let runs: Vec<i64> = store
            .runs_admit(
                &(0..5)
                    .map(|i| new_run(&format!("h{i}"), 9))
                    .collect::<Vec<_>>(),
            )
            .await
            .unwrap()
            .iter()
            .map(|o| o.run_id)
            .collect();
        // They finish out of id order (an urgent run overtaking older ones).
        let finishes = [
            (runs[4], RunState::Completed, 5_000),
            (runs[1], RunState::Superseded, 5_100),
            (runs[0], RunState::Completed, 5_200),
            (runs[3], RunState::Failed, 5_300),
            (runs[2], RunState::Interrupted, 5_400),
        ];
        for (run, state, at) in finishes {
            let mut f = finish(run, &format!("r{run}"), "x");
            f.state = state;
            f.now = at;
            store.runs_finish(&[f]).await.unwrap();
        }
        let history: Vec<(i64, RunState)> = store
            .runs_history(9, 10)
            .await
            .unwrap()
            .iter()
            .map(|r| (r.id, r.state))
            .collect();
        assert_eq!(
            history,
            [
                (runs[2], RunState::Interrupted),
                (runs[0], RunState::Completed),
                (runs[4], RunState::Completed)
            ],
            "the last to finish first, only turns that reach prompts"
        );
        assert_eq!(
            store.runs_history(9, 1).await.unwrap().len(),
            1,
            "bounded by the limit"
        );
    }

    pub async fn journal_new_closes_the_conversation(store: SharedStore) {
        let mut new = inbound("webhook:a", "2", "c", None);
        new.closes_conversation = true;
        let out: Vec<_> = store
            .journal_insert(&[
                inbound("webhook:a", "1", "c", None),
                new,
                inbound("webhook:a", "3", "c", None),
            ])
            .await
            .unwrap()
            .into_iter()
            .map(ids)
            .collect();
        assert_eq!(
            out[0].2, out[1].2,
            "/new itself belongs to the old conversation"
        );
        assert_ne!(out[1].2, out[2].2, "the next update starts a new one");
    }

    fn new_schedule(kind: ScheduleKind, due: i64) -> NewSchedule {
        NewSchedule {
            kind,
            spec: "spec".into(),
            cron: (kind == ScheduleKind::Every).then(|| "* * * * *".into()),
            timezone: Some("UTC".into()),
            action: ScheduleAction::Message,
            text: "hi".into(),
            target: Target {
                account: "webhook:a".into(),
                chat_id: "c".into(),
                thread_id: None,
                chat_kind: ChatKind::Private,
                surface: SurfaceKind::Webhook,
            },
            first_due_at: due,
            missed: MissedPolicy::FireOnce,
            max_attempts: 2,
            created_by: "test".into(),
            created_at: 0,
        }
    }

    fn plan(id: i64, from_due: i64, slots: &[i64], next: Option<i64>) -> Materialize {
        Materialize {
            schedule_id: id,
            from_due,
            slots: slots
                .iter()
                .map(|s| Slot {
                    slot_at: *s,
                    state: OccurrenceState::Pending,
                    reason: None,
                })
                .collect(),
            next_due_at: next,
            skipped_uncounted: 0,
            complete: false,
            now: from_due,
        }
    }

    pub async fn schedules_advance_once_per_slot(store: SharedStore) {
        let id = store
            .schedule_create(&new_schedule(ScheduleKind::Every, 60_000))
            .await
            .unwrap();
        assert!(store.schedules_due(59_999, 10).await.unwrap().is_empty());
        assert_eq!(store.schedules_due(60_000, 10).await.unwrap()[0].id, id);
        // Two workers planned from the same due slot: only one advances.
        let first = store
            .schedules_materialize(&[plan(id, 60_000, &[60_000], Some(120_000))])
            .await
            .unwrap();
        let second = store
            .schedules_materialize(&[plan(id, 60_000, &[60_000], Some(120_000))])
            .await
            .unwrap();
        assert_eq!((first, second), (vec![true], vec![false]));
        let o = store.occurrences_list(id, 10).await.unwrap();
        assert_eq!(o.len(), 1, "one occurrence per (schedule, slot)");
        assert_eq!(o[0].key, format!("sched-{id}-60000"));
        // A slot recorded again by a later plan is not duplicated either.
        store
            .schedules_materialize(&[plan(id, 120_000, &[60_000, 120_000], Some(180_000))])
            .await
            .unwrap();
        assert_eq!(store.occurrences_list(id, 10).await.unwrap().len(), 2);
        // A paused schedule is not due and cannot be advanced.
        store
            .schedule_transition(id, &[ScheduleState::Active], ScheduleState::Paused, 1)
            .await
            .unwrap();
        assert!(store.schedules_due(i64::MAX, 10).await.unwrap().is_empty());
        assert_eq!(
            store
                .schedules_materialize(&[plan(id, 180_000, &[180_000], Some(240_000))])
                .await
                .unwrap(),
            [false]
        );
    }

    pub async fn occurrences_are_claimed_once_and_settled_fenced(store: SharedStore) {
        let id = store
            .schedule_create(&new_schedule(ScheduleKind::At, 1_000))
            .await
            .unwrap();
        store
            .schedules_materialize(&[plan(id, 1_000, &[1_000], None)])
            .await
            .unwrap();
        let first = store
            .occurrences_claim("w1", 1_000, 61_000, 10)
            .await
            .unwrap();
        assert_eq!(first.len(), 1);
        assert!(
            store
                .occurrences_claim("w2", 1_000, 61_000, 10)
                .await
                .unwrap()
                .is_empty(),
            "claimed once"
        );
        let (o, sched) = &first[0];
        assert_eq!(
            (sched.id, o.state, o.fencing_token),
            (id, OccurrenceState::Claimed, 1)
        );
        // The claim's worker dies: its lease runs out and the occurrence is
        // claimable again under a new token; the stale worker's word is void.
        assert_eq!(store.occurrences_release_expired(60_999).await.unwrap(), 0);
        assert_eq!(store.occurrences_release_expired(61_000).await.unwrap(), 1);
        let again = store
            .occurrences_claim("w2", 61_000, 121_000, 10)
            .await
            .unwrap();
        assert_eq!(again[0].0.fencing_token, 3);
        let fired = Fire::Fired {
            run_id: Some("r".into()),
            item: Some(Box::new(item(&o.key, 1))),
        };
        assert!(
            !store
                .occurrence_settle(o.id, 1, &fired, 62_000)
                .await
                .unwrap(),
            "stale token"
        );
        assert!(
            store
                .occurrence_settle(o.id, 3, &fired, 62_000)
                .await
                .unwrap()
        );
        let done = &store.occurrences_list(id, 1).await.unwrap()[0];
        assert_eq!(
            (done.state, done.run_id.as_deref(), done.attempts),
            (OccurrenceState::Fired, Some("r"), 1)
        );
        // The message went out in the same transaction, under the key.
        assert!(store.outbox_get_by_key(&o.key).await.unwrap().is_some());
        assert_eq!(
            store.schedule_get(id).await.unwrap().unwrap().state,
            ScheduleState::Completed,
            "a one-off is done"
        );
    }

    pub async fn chats_and_accounts_are_remembered(store: SharedStore) {
        assert_eq!(store.chat_timezone("webhook:a", "c").await.unwrap(), None);
        store
            .set_chat_timezone("webhook:a", "c", "Europe/Berlin", 1)
            .await
            .unwrap();
        store
            .set_chat_timezone("webhook:a", "c", "Asia/Tokyo", 2)
            .await
            .unwrap();
        assert_eq!(
            store
                .chat_timezone("webhook:a", "c")
                .await
                .unwrap()
                .as_deref(),
            Some("Asia/Tokyo")
        );
        store
            .channel_account_register("main", "webhook:main", "webhook", 1)
            .await
            .unwrap();
        assert_eq!(
            store.channel_account("main").await.unwrap(),
            Some(("webhook:main".into(), "webhook".into()))
        );
        assert_eq!(store.channel_account("other").await.unwrap(), None);
        let target = Target {
            account: "webhook:a".into(),
            chat_id: "c".into(),
            thread_id: None,
            chat_kind: ChatKind::Private,
            surface: SurfaceKind::Webhook,
        };
        let conversation = store.conversation_current(&target, 1).await.unwrap();
        assert_eq!(
            store.conversation_current(&target, 2).await.unwrap(),
            conversation
        );
        let journaled = store
            .journal_insert(&[inbound("webhook:a", "9", "c", None)])
            .await
            .unwrap();
        assert_eq!(
            ids(journaled[0]).2,
            conversation,
            "a schedule's conversation is the chat's"
        );
    }

    pub fn item(key: &str, conversation_id: i64) -> NewOutboxItem {
        NewOutboxItem {
            item_key: key.into(),
            conversation_id,
            account: "webhook:a".into(),
            chat_id: format!("chat-{conversation_id}"),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
            run_id: None,
            kind: ItemKind::Notice,
            text: key.into(),
            group_key: None,
            edits_key: None,
            attachments: Vec::new(),
            created_at: 1_000,
        }
    }

    pub async fn chat_migration_moves_conversations_replies_and_access(store: SharedStore) {
        // A group with an open conversation, an unsent reply, a delivered
        // one and a schedule.
        let first = store
            .journal_insert(&[inbound("telegram:1", "-5:1", "-5", None)])
            .await
            .unwrap();
        let (_, _, conversation) = ids(first[0]);
        let attachment = switchboard_channel::AttachmentRef {
            reference: "file-1".into(),
            media_type: Some("image/png".into()),
            size: Some(3),
            filename: None,
        };
        let unsent = NewOutboxItem {
            account: "telegram:1".into(),
            chat_id: "-5".into(),
            attachments: vec![attachment.clone()],
            ..item("unsent", conversation)
        };
        let sent = NewOutboxItem {
            account: "telegram:1".into(),
            chat_id: "-5".into(),
            ..item("sent", conversation)
        };
        store.outbox_enqueue(&[sent, unsent]).await.unwrap();
        let claimed = store.outbox_claim(&claim(2_000, 10)).await.unwrap();
        assert_eq!(claimed.len(), 1, "only the lane head is claimed");
        store
            .outbox_settle(&[ack(&claimed[0], 2_000)])
            .await
            .unwrap();

        let migration = NewInbound {
            disposition: Disposition::Ignored,
            reason: Some("migrated".into()),
            migrates_to: Some("-1009".into()),
            ..inbound("telegram:1", "-5:2", "-5", None)
        };
        store.journal_insert(&[migration]).await.unwrap();

        // The next update of the new chat continues the same conversation.
        let next = store
            .journal_insert(&[inbound("telegram:1", "-1009:3", "-1009", None)])
            .await
            .unwrap();
        assert_eq!(ids(next[0]).2, conversation);
        let items = store
            .outbox_list(&OutboxFilter {
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        let chat_of = |key: &str| {
            items
                .iter()
                .find(|i| i.item_key == key)
                .map(|i| (i.chat_id.clone(), i.attachments.clone()))
                .unwrap()
        };
        assert_eq!(chat_of("unsent"), ("-1009".into(), vec![attachment]));
        assert_eq!(
            chat_of("sent"),
            ("-5".into(), vec![]),
            "delivered items keep the chat they were delivered to"
        );
        assert_eq!(
            store.chat_origins("telegram:1", "-1009").await.unwrap(),
            ["-5"]
        );
        assert!(
            store
                .chat_origins("telegram:1", "-5")
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            store
                .chat_origins("telegram:2", "-1009")
                .await
                .unwrap()
                .is_empty()
        );
    }

    pub async fn retention_prunes_old_settled_data_in_bounded_batches(store: SharedStore) {
        // Journal rows at t = 1_000 (old) and one pending; a run finished at
        // 5_000 with its reply acknowledged at 6_000.
        let mut rows = Vec::new();
        for i in 0..5 {
            rows.push(inbound("webhook:a", &format!("old-{i}"), "c", None));
        }
        let row_ids: Vec<i64> = store
            .journal_insert(&rows)
            .await
            .unwrap()
            .into_iter()
            .map(|o| ids(o).1)
            .collect();
        for id in &row_ids[..4] {
            store
                .journal_settle(*id, Disposition::Ignored, "done", None, 1_500)
                .await
                .unwrap();
        }
        let runs = store.runs_admit(&[new_run("r1", 9)]).await.unwrap();
        store.runs_start(&[runs[0].run_id], 4_000).await.unwrap();
        store
            .runs_finish(&[finish(runs[0].run_id, "ans", "the answer")])
            .await
            .unwrap();
        let claimed = store.outbox_claim(&claim(6_000, 10)).await.unwrap();
        store
            .outbox_settle(&[ack(&claimed[0], 6_000)])
            .await
            .unwrap();

        // Payloads only, two rows per pass: bounded, oldest first.
        let payloads_only = PruneRules {
            payloads_before: 2_000,
            keys_before: 0,
            outbox_before: 0,
            runs_before: 0,
            batch: 2,
        };
        let first = store.prune(&payloads_only).await.unwrap();
        assert_eq!(first.payloads, 2);
        let second = store.prune(&payloads_only).await.unwrap();
        assert_eq!(second.payloads, 2);
        let third = store.prune(&payloads_only).await.unwrap();
        assert_eq!(
            third,
            PruneReport::default(),
            "the pending row keeps its payload"
        );
        let row = store.journal_get(row_ids[0]).await.unwrap().unwrap();
        assert_eq!((row.payload, row.update_key.as_str()), (None, "old-0"));
        assert!(
            store
                .journal_get(row_ids[4])
                .await
                .unwrap()
                .unwrap()
                .payload
                .is_some()
        );
        // Keys and the journal's deduplication survive until keys_before.
        let again = store.journal_insert(&rows[..1]).await.unwrap();
        assert!(!ids(again[0]).0, "a pruned payload still deduplicates");

        // Everything old: keys (not the pending row), the reply, the run.
        let all = PruneRules {
            payloads_before: 10_000,
            keys_before: 10_000,
            outbox_before: 10_000,
            runs_before: 10_000,
            batch: 100,
        };
        let report = store.prune(&all).await.unwrap();
        assert_eq!((report.keys, report.outbox, report.runs), (4, 1, 1));
        assert!(store.journal_get(row_ids[0]).await.unwrap().is_none());
        assert!(store.journal_get(row_ids[4]).await.unwrap().is_some());
        assert!(store.run_get(runs[0].run_id).await.unwrap().is_none());
        assert_eq!(store.prune(&all).await.unwrap(), PruneReport::default());
    }

    pub async fn outbox_previews_never_follow_their_answer(store: SharedStore) {
        let preview = NewOutboxItem {
            kind: ItemKind::Preview,
            ..item("run-1-preview", 1)
        };
        assert!(store.outbox_enqueue_preview(&preview).await.unwrap());
        let answer = NewOutboxItem {
            edits_key: Some("run-1-preview".into()),
            attachments: Vec::new(),
            ..item("run-1-answer-1", 1)
        };
        store.outbox_enqueue(&[answer]).await.unwrap();
        assert!(store.outbox_replaced("run-1-preview").await.unwrap());
        assert!(!store.outbox_replaced("run-2-preview").await.unwrap());
        // Run 2 answered (here by a remote runtime's event-keyed item)
        // before its first delta was seen: no preview.
        store
            .outbox_enqueue(&[NewOutboxItem {
                edits_key: Some("run-2-preview".into()),
                ..item("run-2-ev9-1", 2)
            }])
            .await
            .unwrap();
        let late = NewOutboxItem {
            kind: ItemKind::Preview,
            ..item("run-2-preview", 2)
        };
        assert!(!store.outbox_enqueue_preview(&late).await.unwrap());
        assert!(
            store
                .outbox_get_by_key("run-2-preview")
                .await
                .unwrap()
                .is_none()
        );
        let got = store
            .outbox_get_by_key("run-1-answer-1")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (got.ordinal, got.edits_key.as_deref()),
            (2, Some("run-1-preview"))
        );
    }

    pub async fn outbox_operators_resolve_held_items_only(store: SharedStore) {
        store
            .outbox_enqueue(&[item("a", 1), item("b", 2), item("c", 3)])
            .await
            .unwrap();
        let claimed = store.outbox_claim(&claim(2_000, 10)).await.unwrap();
        let holds: Vec<Reconcile> = claimed
            .iter()
            .map(|i| Reconcile {
                item_id: i.id,
                fencing_token: i.fencing_token,
                action: ReconcileAction::Hold,
                now: 3_000,
            })
            .collect();
        store.outbox_expire_all_leases(3_000).await.unwrap();
        store.outbox_reconcile(&holds).await.unwrap();
        let id = |k: &str| claimed.iter().find(|i| i.item_key == k).unwrap().id;
        assert!(
            store
                .outbox_resolve(id("a"), Resolution::AsSent, 4_000)
                .await
                .unwrap()
        );
        assert!(
            store
                .outbox_resolve(id("b"), Resolution::Drop, 4_000)
                .await
                .unwrap()
        );
        assert!(
            store
                .outbox_resolve(id("c"), Resolution::Resend, 4_000)
                .await
                .unwrap()
        );
        assert!(
            !store
                .outbox_resolve(id("a"), Resolution::Drop, 4_001)
                .await
                .unwrap(),
            "only held items"
        );
        let state = |k: &'static str| {
            let store = store.clone();
            async move { store.outbox_get_by_key(k).await.unwrap().unwrap() }
        };
        assert_eq!(state("a").await.state, DispatchState::Acknowledged);
        assert_eq!(state("b").await.state, DispatchState::Dropped);
        let c = state("c").await;
        assert_eq!((c.state, c.resends), (DispatchState::NotDispatched, 1));
        let again = store.outbox_claim(&claim(4_000, 10)).await.unwrap();
        assert_eq!(
            again
                .iter()
                .map(|i| i.item_key.as_str())
                .collect::<Vec<_>>(),
            ["c"],
            "a resend is claimable at once"
        );
        assert!(again[0].fencing_token > c.fencing_token - 1);
    }

    pub async fn outbox_stats_count_what_waits(store: SharedStore) {
        assert_eq!(store.outbox_stats().await.unwrap(), OutboxStats::default());
        store
            .outbox_enqueue(&[
                NewOutboxItem {
                    created_at: 500,
                    ..item("a1", 1)
                },
                item("a2", 1),
                item("b1", 2),
            ])
            .await
            .unwrap();
        store.outbox_claim(&claim(2_000, 1)).await.unwrap();
        let stats = store.outbox_stats().await.unwrap();
        assert_eq!(
            (stats.not_dispatched, stats.possibly_dispatched, stats.held),
            (2, 1, 0)
        );
        assert_eq!(
            stats.oldest_unsent_created_at,
            Some(1_000),
            "a1 was claimed; a2 and b1 wait"
        );
    }

    fn claim(now: i64, limit: usize) -> Claim {
        Claim {
            owner: "test".into(),
            now,
            lease_until: now + 60_000,
            limit,
        }
    }

    fn ack(item: &OutboxItem, now: i64) -> Settlement {
        Settlement {
            item_id: item.id,
            fencing_token: item.fencing_token,
            outcome: Outcome::Acknowledged {
                receipt: r#"{"message_ids":["m"]}"#.into(),
            },
            now,
        }
    }

    pub async fn outbox_ordinals_and_duplicate_keys(store: SharedStore) {
        let added = store
            .outbox_enqueue(&[item("a", 1), item("b", 1), item("a", 1), item("c", 2)])
            .await
            .unwrap();
        assert_eq!(
            added,
            [true, true, false, true],
            "an item key is added once"
        );
        let items = store
            .outbox_list(&OutboxFilter {
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut got: Vec<_> = items
            .iter()
            .map(|i| (i.conversation_id, i.ordinal, i.item_key.clone()))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [(1, 1, "a".into()), (1, 2, "b".into()), (2, 1, "c".into())]
        );
    }

    pub async fn outbox_claims_only_lane_heads(store: SharedStore) {
        store
            .outbox_enqueue(&[
                item("a1", 1),
                item("a2", 1),
                item("a3", 1),
                item("b1", 2),
                item("b2", 2),
            ])
            .await
            .unwrap();
        let first = store.outbox_claim(&claim(2_000, 100)).await.unwrap();
        let mut keys: Vec<_> = first.iter().map(|i| i.item_key.as_str()).collect();
        keys.sort();
        assert_eq!(keys, ["a1", "b1"], "one item per conversation: the head");
        assert!(
            first
                .iter()
                .all(|i| i.state == DispatchState::PossiblyDispatched && i.fencing_token == 1)
        );
        assert!(
            first
                .iter()
                .all(|i| i.dispatched_at == Some(2_000) && i.lease_expires_at == Some(62_000))
        );
        // While the heads are in flight, nothing else is claimable.
        assert!(
            store
                .outbox_claim(&claim(2_001, 100))
                .await
                .unwrap()
                .is_empty()
        );

        let a1 = first.iter().find(|i| i.item_key == "a1").unwrap();
        assert_eq!(
            store.outbox_settle(&[ack(a1, 2_100)]).await.unwrap(),
            [true]
        );
        let next = store.outbox_claim(&claim(2_200, 100)).await.unwrap();
        assert_eq!(
            next.iter().map(|i| i.item_key.as_str()).collect::<Vec<_>>(),
            ["a2"],
            "ack releases the lane to the next ordinal"
        );

        let acked = store.outbox_get(a1.id).await.unwrap().unwrap();
        assert_eq!(acked.state, DispatchState::Acknowledged);
        assert_eq!(acked.settled_at, Some(2_100));
        assert!(acked.receipt.unwrap().contains("message_ids"));
        assert_eq!(acked.lease_owner, None);
    }

    pub async fn outbox_claim_respects_limit_and_due_time(store: SharedStore) {
        let items: Vec<_> = (0..5).map(|c| item(&format!("x{c}"), c)).collect();
        store.outbox_enqueue(&items).await.unwrap();
        assert_eq!(store.outbox_claim(&claim(2_000, 2)).await.unwrap().len(), 2);
        assert_eq!(
            store.outbox_claim(&claim(2_000, 10)).await.unwrap().len(),
            3
        );
        // Items created after `now` are not due yet.
        store
            .outbox_enqueue(&[NewOutboxItem {
                created_at: 10_000,
                ..item("late", 99)
            }])
            .await
            .unwrap();
        assert!(
            store
                .outbox_claim(&claim(9_999, 10))
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            store.outbox_claim(&claim(10_000, 10)).await.unwrap().len(),
            1
        );
    }

    pub async fn outbox_retry_keeps_the_lane_and_waits(store: SharedStore) {
        store
            .outbox_enqueue(&[item("a1", 1), item("a2", 1)])
            .await
            .unwrap();
        let a1 = store
            .outbox_claim(&claim(2_000, 10))
            .await
            .unwrap()
            .remove(0);
        let retry = |counts| Settlement {
            item_id: a1.id,
            fencing_token: a1.fencing_token,
            outcome: Outcome::Retry {
                next_attempt_at: 5_000,
                counts,
                reason: "busy".into(),
            },
            now: 2_100,
        };
        assert_eq!(store.outbox_settle(&[retry(true)]).await.unwrap(), [true]);
        assert!(
            store
                .outbox_claim(&claim(4_999, 10))
                .await
                .unwrap()
                .is_empty(),
            "a2 must wait behind a1"
        );
        let again = store.outbox_claim(&claim(5_000, 10)).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].item_key, "a1");
        assert_eq!(again[0].attempts, 1, "NotSent counts an attempt");
        assert_eq!(again[0].fencing_token, 2, "every claim takes a new token");
        assert_eq!(again[0].reason.as_deref(), Some("busy"));
        // RetryAfter does not count.
        let retry_after = Settlement {
            item_id: again[0].id,
            fencing_token: again[0].fencing_token,
            outcome: Outcome::Retry {
                next_attempt_at: 6_000,
                counts: false,
                reason: "429".into(),
            },
            now: 5_100,
        };
        store.outbox_settle(&[retry_after]).await.unwrap();
        assert_eq!(store.outbox_get(a1.id).await.unwrap().unwrap().attempts, 1);
    }

    pub async fn outbox_fencing_rejects_stale_writes(store: SharedStore) {
        store.outbox_enqueue(&[item("a1", 1)]).await.unwrap();
        let stale = store
            .outbox_claim(&claim(2_000, 10))
            .await
            .unwrap()
            .remove(0);
        // The lease runs out: reconciliation resends under a new token.
        assert!(store.outbox_expired(61_999, 10).await.unwrap().is_empty());
        let expired = store.outbox_expired(62_000, 10).await.unwrap();
        assert_eq!(expired.len(), 1);
        let resend = Reconcile {
            item_id: stale.id,
            fencing_token: stale.fencing_token,
            action: ReconcileAction::Resend {
                possible_duplicate: false,
            },
            now: 62_000,
        };
        assert_eq!(
            store
                .outbox_reconcile(std::slice::from_ref(&resend))
                .await
                .unwrap(),
            [true]
        );
        assert_eq!(
            store.outbox_reconcile(&[resend]).await.unwrap(),
            [false],
            "a reconcile is fenced too"
        );
        let fresh = store
            .outbox_claim(&claim(62_001, 10))
            .await
            .unwrap()
            .remove(0);
        assert!(fresh.fencing_token > stale.fencing_token);

        // The stale worker's late outcome changes nothing.
        let late = Settlement {
            item_id: stale.id,
            fencing_token: stale.fencing_token,
            outcome: Outcome::Failed {
                reason: "late".into(),
            },
            now: 62_002,
        };
        assert_eq!(store.outbox_settle(&[late]).await.unwrap(), [false]);
        assert_eq!(
            store.outbox_get(stale.id).await.unwrap().unwrap().state,
            DispatchState::PossiblyDispatched
        );
        assert_eq!(
            store.outbox_settle(&[ack(&fresh, 62_003)]).await.unwrap(),
            [true]
        );
        assert_eq!(
            store.outbox_settle(&[ack(&stale, 62_004)]).await.unwrap(),
            [false],
            "no second ack"
        );
    }

    pub async fn outbox_failed_held_and_ambiguous(store: SharedStore) {
        store
            .outbox_enqueue(&[item("a1", 1), item("a2", 1), item("a3", 1), item("b1", 2)])
            .await
            .unwrap();
        let heads = store.outbox_claim(&claim(2_000, 10)).await.unwrap();
        let a1 = heads.iter().find(|i| i.item_key == "a1").unwrap();
        let b1 = heads.iter().find(|i| i.item_key == "b1").unwrap();
        let failed = Settlement {
            item_id: a1.id,
            fencing_token: a1.fencing_token,
            outcome: Outcome::Failed {
                reason: "chat gone".into(),
            },
            now: 2_100,
        };
        let ambiguous = Settlement {
            item_id: b1.id,
            fencing_token: b1.fencing_token,
            outcome: Outcome::Ambiguous {
                reason: "timeout".into(),
                reconcile_at: 9_000,
            },
            now: 2_100,
        };
        assert_eq!(
            store.outbox_settle(&[failed, ambiguous]).await.unwrap(),
            [true, true]
        );
        let row = store.outbox_get(a1.id).await.unwrap().unwrap();
        assert_eq!(
            (row.state, row.reason.as_deref()),
            (DispatchState::Failed, Some("chat gone"))
        );
        // A failed item releases its lane; an ambiguous one keeps it blocked.
        let next = store.outbox_claim(&claim(2_200, 10)).await.unwrap();
        assert_eq!(
            next.iter().map(|i| i.item_key.as_str()).collect::<Vec<_>>(),
            ["a2"]
        );
        assert!(
            store
                .outbox_expired(8_999, 10)
                .await
                .unwrap()
                .iter()
                .all(|i| i.item_key != "b1")
        );
        let b1_expired = store.outbox_expired(9_000, 10).await.unwrap();
        let b1_now = b1_expired.iter().find(|i| i.item_key == "b1").unwrap();
        let hold = Reconcile {
            item_id: b1_now.id,
            fencing_token: b1_now.fencing_token,
            action: ReconcileAction::Hold,
            now: 9_000,
        };
        assert_eq!(store.outbox_reconcile(&[hold]).await.unwrap(), [true]);
        let held = store
            .outbox_list(&OutboxFilter {
                state: Some(DispatchState::Held),
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].item_key, "b1");
    }

    pub async fn outbox_expire_all_leases_frees_orphans(store: SharedStore) {
        store
            .outbox_enqueue(&[item("a1", 1), item("b1", 2)])
            .await
            .unwrap();
        store.outbox_claim(&claim(2_000, 10)).await.unwrap();
        assert!(store.outbox_expired(3_000, 10).await.unwrap().is_empty());
        assert_eq!(store.outbox_expire_all_leases(3_000).await.unwrap(), 2);
        assert_eq!(store.outbox_expired(3_000, 10).await.unwrap().len(), 2);
        let counts: std::collections::HashMap<_, _> =
            store.outbox_counts().await.unwrap().into_iter().collect();
        assert_eq!(counts[&DispatchState::PossiblyDispatched], 2);
    }

    pub async fn outbox_backlog_in_one_lane_does_not_hide_other_lanes(store: SharedStore) {
        let mut items: Vec<_> = (0..2_000).map(|i| item(&format!("big-{i}"), 1)).collect();
        items.push(item("small", 2));
        store.outbox_enqueue(&items).await.unwrap();
        let heads = store.outbox_claim(&claim(2_000, 2)).await.unwrap();
        let mut keys: Vec<_> = heads.iter().map(|i| i.item_key.as_str()).collect();
        keys.sort();
        assert_eq!(keys, ["big-0", "small"]);
    }
}

/// Run one suite function against a fresh store of each backend.
macro_rules! conformance {
    ($backend:ident, $open:ident; $($test:ident),+ $(,)?) => {
        mod $backend {
            $(
                #[tokio::test]
                async fn $test() {
                    let Some((store, _guard)) = super::$open().await else {
                        return;
                    };
                    super::suite::$test(store.clone()).await;
                    store.close().await;
                }
            )+
        }
    };
}

async fn open_sqlite() -> Option<(SharedStore, Arc<tempfile::TempDir>)> {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let config = StoreConfig {
        url: format!("sqlite://{}", dir.path().join("store.db").display()),
        synchronous: Synchronous::Full,
        batch_size: 512,
        ..Default::default()
    };
    let store = store::open(&config, OpenMode::Daemon).await.unwrap();
    Some((store, dir))
}

async fn open_postgres() -> Option<(SharedStore, ())> {
    let url = pg::fresh_database().await?;
    let config = StoreConfig {
        url,
        synchronous: Synchronous::Full,
        batch_size: 512,
        ..Default::default()
    };
    Some((store::open(&config, OpenMode::Daemon).await.unwrap(), ()))
}

macro_rules! every_test {
    ($backend:ident, $open:ident) => {
        conformance!($backend, $open;
    journal_deduplicates_within_and_across_batches,
    journal_resolves_conversations_by_chat_and_thread,
    journal_pending_in_order_and_admission_settles,
    runs_admit_is_idempotent,
    runs_coalesce_into_a_queued_run_only,
    runs_interrupt_requests_and_recovery_scan,
    runs_absorb_only_when_completing,
    runs_stop_cancels_queued_and_interrupts_running,
    runs_history_is_recent_turns_that_reach_prompts,
    journal_new_closes_the_conversation,
    runs_finish_writes_reply_items_once,
    runs_unfinished_pages_in_id_order,
    runs_unfinished_in_one_conversation,
    leases_expire_and_fence_takeovers,
    journal_pending_for_skips_lanes_held_elsewhere,
    outbox_ordinals_and_duplicate_keys,
    outbox_claims_only_lane_heads,
    outbox_claim_respects_limit_and_due_time,
    outbox_retry_keeps_the_lane_and_waits,
    outbox_fencing_rejects_stale_writes,
    outbox_failed_held_and_ambiguous,
    outbox_expire_all_leases_frees_orphans,
    outbox_backlog_in_one_lane_does_not_hide_other_lanes,
    outbox_previews_never_follow_their_answer,
    outbox_operators_resolve_held_items_only,
    outbox_stats_count_what_waits,
    schedules_advance_once_per_slot,
    occurrences_are_claimed_once_and_settled_fenced,
    chats_and_accounts_are_remembered,
    chat_migration_moves_conversations_replies_and_access,
    retention_prunes_old_settled_data_in_bounded_batches,
        );
    };
}

every_test!(sqlite, open_sqlite);
every_test!(postgres, open_postgres);

#[tokio::test]
async fn sqlite_refuses_a_second_daemon_on_the_same_file() {
    let (first, dir) = open_sqlite().await.unwrap();
    let config = StoreConfig {
        url: format!("sqlite://{}", dir.path().join("store.db").display()),
        synchronous: Synchronous::Full,
        batch_size: 512,
        ..Default::default()
    };
    let err = store::open(&config, OpenMode::Daemon)
        .await
        .err()
        .expect("a second daemon must be refused");
    assert!(
        err.to_string().contains("another switchboard daemon"),
        "{err}"
    );
    // Operator tools open it beside the daemon.
    let tool = store::open(&config, OpenMode::Tool).await.unwrap();
    tool.close().await;
    first.close().await;
}
