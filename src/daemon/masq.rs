//! `--ip-masq`: weft's masquerade tables ([`Masquerade`]) kept for this host's lease, beside
//! the data plane. Synced when the lease changes and every `--iptables-resync`; on a clean
//! exit removed unless the process handed everything to a successor (a takeover, the in-place
//! upgrade), which adopts them as they are. Their metrics and their say on `/readyz` (not
//! ready while the rules asked for are not in place: see docs/configuration.md) are
//! registered here.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::NetworkConfig;
use crate::dataplane::{MasqConfig, MasqInputs, Masquerade};
use crate::health::Health;
use crate::lease::record::{LeaseName, NodeId};

use super::RunOptions;

/// Starts keeping the tables, if `--ip-masq` asks for them.
pub(super) fn start(
    opts: &RunOptions,
    network: &NetworkConfig,
    node: &NodeId,
    health: &Arc<Health>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    shutdown_rx: watch::Receiver<bool>,
) -> Option<(Arc<Masquerade>, JoinHandle<()>)> {
    if !opts.ip_masq {
        return None;
    }
    let cfg = MasqConfig {
        inputs: MasqInputs {
            network: network.ipv4.as_ref().map(|v4| v4.network),
            subnet: None,
            network6: network.ipv6.as_ref().map(|v6| v6.network),
            subnet6: None,
            random_fully: opts.ip_masq_random_fully,
            forward: opts.iptables_forward_rules,
        },
        node: node.as_str().to_owned(),
    };
    let masq = Arc::new(Masquerade::new(cfg, *subnet_rx.borrow()));
    health.add_collector(masq.stats.clone());
    let stats = masq.stats.clone();
    health.add_check(Box::new(move || stats.problem().map_or(Ok(None), Err)));
    let task = tokio::spawn(run(masq.clone(), subnet_rx, opts.iptables_resync, shutdown_rx));
    Some((masq, task))
}

async fn run(
    masq: Arc<Masquerade>,
    mut subnet_rx: watch::Receiver<Option<LeaseName>>,
    resync: Duration,
    mut shutdown_rx: watch::Receiver<bool>,
) {
    let resync = resync.max(Duration::from_secs(1));
    let mut lease_open = true;
    loop {
        masq.set_lease(*subnet_rx.borrow_and_update());
        let m = masq.clone();
        let _ = tokio::task::spawn_blocking(move || m.sync()).await;
        tokio::select! {
            _ = shutdown_rx.wait_for(|s| *s) => return,
            r = subnet_rx.changed(), if lease_open => lease_open = r.is_ok(),
            () = tokio::time::sleep(resync) => {}
        }
    }
}

/// After the stop: removes the tables unless they were handed to a successor.
pub(super) async fn finish(masq: Option<(Arc<Masquerade>, JoinHandle<()>)>, handed_over: bool) {
    let Some((masq, task)) = masq else { return };
    let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    if !handed_over {
        let _ = tokio::task::spawn_blocking(move || masq.remove()).await;
    }
}
