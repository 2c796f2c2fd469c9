//! Waiting for a condition: poll it with a deadline, never sleep a fixed time and hope.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is asked again.
const EVERY: Duration = Duration::from_millis(10);

/// Ask `probe` every 10 ms until it answers `Some`, and return that; panic naming `what` once
/// `within` has passed. `what` is formatted only then (see [`Lazy`]).
pub async fn poll<T, F, Fut>(within: Duration, what: impl fmt::Display, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// [`poll`] for a yes/no condition.
pub async fn eventually<F, Fut>(within: Duration, what: impl fmt::Display, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(within, what, || {
        let c = cond();
        async move { c.await.then_some(()) }
    })
    .await
}

/// A description computed when it is shown: what a timed-out [`poll`] reports can be the
/// state at the deadline.
pub struct Lazy<F>(pub F);

impl<F: Fn() -> String> fmt::Display for Lazy<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&(self.0)())
    }
}
