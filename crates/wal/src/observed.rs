//! An append whose outcome is observed even when its caller stops waiting.
//!
//! A batch handed to the writer is written whether or not anyone still awaits its
//! answer: a caller that goes away (an HTTP client that disconnected, so its handler's
//! future was dropped) leaves a durable batch that nothing has counted. [`Observed`] is
//! [`crate::Wal::append_observed`]'s answer: it calls its `on_durable` with the batch's
//! offsets once the batch is durable, on the caller's task when the caller is there to
//! see it, and otherwise on a task spawned on the runtime that dropped it.
//!
//! Invariants:
//! - `on_durable` is called at most once, and only for a batch that is durable
//!   (resolved `Ok`): never for one that failed or whose writer went away.
//! - On the caller's task it is called before the future resolves, so what it counts is
//!   counted before the caller answers.
//! - Dropped before its answer inside a Tokio runtime, the answer is awaited on a task
//!   of that runtime, which calls `on_durable` if the batch became durable. Dropped
//!   outside any runtime, or while its runtime shuts down (which runs no new task),
//!   `on_durable` is dropped uncalled: nothing is left to run it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::{Appended, Result, WalError};

/// The answer of [`crate::Wal::append_observed`]; see the module comment.
pub struct Observed<F: FnOnce(&Appended) + Send + 'static> {
    answer: Option<oneshot::Receiver<Result<Appended>>>,
    on_durable: Option<F>,
}

impl<F: FnOnce(&Appended) + Send + 'static> Observed<F> {
    pub(crate) fn new(answer: oneshot::Receiver<Result<Appended>>, on_durable: F) -> Observed<F> {
        Observed { answer: Some(answer), on_durable: Some(on_durable) }
    }
}

// Never pinned structurally: `on_durable` is only ever moved out whole, and the
// receiver is `Unpin`.
impl<F: FnOnce(&Appended) + Send + 'static> Unpin for Observed<F> {}

impl<F: FnOnce(&Appended) + Send + 'static> Future for Observed<F> {
    type Output = Result<Appended>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Appended>> {
        let this = self.get_mut();
        let Some(answer) = this.answer.as_mut() else {
            return Poll::Ready(Err(WalError::Closed));
        };
        let result = match Pin::new(answer).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r.map_err(|_| WalError::Closed).and_then(|r| r),
        };
        this.answer = None;
        let on_durable = this.on_durable.take();
        if let (Ok(appended), Some(f)) = (&result, on_durable) {
            f(appended);
        }
        Poll::Ready(result)
    }
}

impl<F: FnOnce(&Appended) + Send + 'static> Drop for Observed<F> {
    fn drop(&mut self) {
        let (Some(answer), Some(on_durable)) = (self.answer.take(), self.on_durable.take()) else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Ok(Ok(appended)) = answer.await {
                    on_durable(&appended);
                }
            });
        }
    }
}
