//! Group commit: many callers, one transaction.
//!
//! A [`Batcher`] owns one task that takes every request waiting in its queue
//! (up to a maximum), hands them to one store call that writes them in one
//! transaction, and answers each caller with its own outcome after the
//! commit. While one batch commits, the next one gathers, so the number of
//! commits per second stays near what the disk allows while the items per
//! second grow with the load. A lone caller waits for no one: a batch of one
//! goes out at once.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::StoreError;

type Job<Req, Resp> = (Req, oneshot::Sender<Result<Resp, Arc<StoreError>>>);

/// A handle to a group-commit writer; cheap to clone.
pub struct Batcher<Req, Resp> {
    tx: mpsc::Sender<Job<Req, Resp>>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Batcher {
            tx: self.tx.clone(),
        }
    }
}

/// The batcher's task is gone (the daemon is stopping).
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("the {0} writer has stopped")]
    Closed(&'static str),
    #[error(transparent)]
    Store(Arc<StoreError>),
}

impl<Req: Send + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// Start the writer task. `write` must return one outcome per request,
    /// in order, or an error that fails the whole batch.
    pub fn spawn<F, Fut>(
        name: &'static str,
        max_batch: usize,
        write: F,
    ) -> (Self, tokio::task::JoinHandle<()>)
    where
        F: Fn(Vec<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<Resp>, StoreError>> + Send,
    {
        let (tx, mut rx) = mpsc::channel::<Job<Req, Resp>>(max_batch.max(1) * 4);
        let handle = tokio::spawn(async move {
            let mut jobs: Vec<Job<Req, Resp>> = Vec::with_capacity(max_batch);
            while rx.recv_many(&mut jobs, max_batch.max(1)).await > 0 {
                let (requests, replies): (Vec<Req>, Vec<_>) = jobs.drain(..).unzip();
                let count = requests.len();
                match write(requests).await {
                    Ok(outcomes) => {
                        debug_assert_eq!(outcomes.len(), count, "{name}: one outcome per request");
                        for (reply, outcome) in replies.into_iter().zip(outcomes) {
                            let _ = reply.send(Ok(outcome));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(writer = name, batch = count, error = %e, "group commit failed");
                        let e = Arc::new(e);
                        for reply in replies {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        });
        (Batcher { tx }, handle)
    }

    /// Queue one request and wait for its outcome (after the commit).
    pub async fn call(&self, request: Req, name: &'static str) -> Result<Resp, BatchError> {
        let (reply, outcome) = oneshot::channel();
        self.tx
            .send((request, reply))
            .await
            .map_err(|_| BatchError::Closed(name))?;
        match outcome.await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(BatchError::Store(e)),
            Err(_) => Err(BatchError::Closed(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_callers_share_commits_and_get_their_own_answer() {
        let commits = Arc::new(AtomicUsize::new(0));
        let c = commits.clone();
        let (batcher, _task) = Batcher::spawn("test", 64, move |reqs: Vec<u32>| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                // Simulate a commit's latency so callers pile up.
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                Ok(reqs.into_iter().map(|r| r * 2).collect())
            }
        });
        let mut tasks = Vec::new();
        for i in 0..200u32 {
            let b = batcher.clone();
            tasks.push(tokio::spawn(async move {
                (i, b.call(i, "test").await.unwrap())
            }));
        }
        for t in tasks {
            let (i, doubled) = t.await.unwrap();
            assert_eq!(doubled, i * 2);
        }
        let n = commits.load(Ordering::SeqCst);
        assert!(
            n < 200,
            "200 concurrent calls took {n} commits; they were not batched"
        );
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_caller_in_it() {
        let (batcher, _task) = Batcher::spawn("test", 8, |_reqs: Vec<u32>| async {
            Err::<Vec<u32>, _>(StoreError::Other("disk on fire".into()))
        });
        let err = batcher.call(1, "test").await.unwrap_err();
        assert!(err.to_string().contains("disk on fire"), "{err}");
    }
}
