//! Netlink watches for the daemon's tasks (the underlay follower, the TUN addresser): started
//! on a blocking thread, and awaited as "something changed" or never.

use std::time::Duration;

use tokio::sync::watch;
use tracing::warn;

use crate::dataplane::{KernelWatch, NetlinkError};

/// How long a burst of netlink notifications is let settle before the link is read: `ip link
/// set down` alone sends one for the link and one per route it takes away.
pub(super) const LINK_SETTLE: Duration = Duration::from_millis(20);

/// Starts a netlink watch (its start makes a netlink request, so on a blocking thread). When it
/// cannot be started, says so at WARN: the caller then polls `what` every `every`.
pub(super) async fn start_watch<F>(
    start: F,
    what: &'static str,
    every: Duration,
) -> Option<(KernelWatch, watch::Receiver<u64>)>
where
    F: FnOnce() -> Result<(KernelWatch, watch::Receiver<u64>), NetlinkError> + Send + 'static,
{
    let started = tokio::task::spawn_blocking(start)
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    match started {
        Ok(watch) => Some(watch),
        Err(e) => {
            warn!(error = %e, ?every, "cannot watch {what} over netlink: polling instead");
            None
        }
    }
}

/// The next netlink notification a watch keeps; never, without a watch.
pub(super) async fn next_netlink_change(
    changes: &mut Option<watch::Receiver<u64>>,
) -> Result<(), watch::error::RecvError> {
    match changes {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}
