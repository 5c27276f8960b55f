//! Following the network config in the store while weft runs.
//!
//! weft runs the network config it started with (read from the store at a cold start, handed
//! over by a takeover or a SIGHUP) until it is restarted; nothing of it changes in place. A
//! new backend needs a new data plane and peers that change with it, and a new `Network` or
//! `SubnetLen` would leave the held lease outside the network: a restart, host by host, is the
//! operator's step (docs/configuration.md, "Changing the network config"). What weft owes is
//! to say so.
//!
//! Contract:
//! - [`ConfigFollow::see`] (pure) takes each value the store's config key holds and answers
//!   what to tell, once per distinct state of the store: a valid config other than the running
//!   one (a [`Notice::Differs`] naming each difference, [`NetworkConfig::differences`]), an
//!   invalid one, none at all (WARNs, each saying that weft keeps running its config until a
//!   restart), or the running one again after any of those (an INFO). A value equal to the
//!   running config in any spelling is the running one; writing the same state again tells
//!   nothing.
//! - [`follow`] (the driver) watches the key ([`Store::watch_config`]), feeds every value to
//!   the follower, logs what it answers and keeps [`ConfigStatus`] (the gauge
//!   `weft_network_config_differs`, the counter `weft_network_config_changes_total` of WARNs,
//!   and a note for `/readyz`'s 200 body while the store differs: a host that runs the config
//!   it started with is ready). A watch that fails is set up again after 1 s, doubling to
//!   30 s; the store being unreachable is the lease plane's to report, so only DEBUG here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::config::NetworkConfig;
use crate::lease::store::Store;
use crate::metrics;

/// The first wait before watching again after a failed watch.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The longest wait before watching again.
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What the store's config key holds, measured against the running config.
#[derive(Clone, Debug, PartialEq, Eq)]
enum InStore {
    /// The running config, in whatever spelling.
    Running,
    /// Another valid config.
    Other(NetworkConfig),
    /// A value that does not parse: why.
    Invalid(String),
    /// No config key.
    Absent,
}

/// What to tell about the store's config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Notice {
    /// WARN: the store holds another valid config; each difference, ours first.
    Differs {
        /// `<field> <running> -> <store's>`, in flannel's field names.
        differences: Vec<String>,
        /// Whether the backend type differs: hosts then stop reaching each other as they
        /// restart.
        backend: bool,
    },
    /// WARN: the store's config does not parse.
    Invalid(String),
    /// WARN: the store has no config.
    Absent,
    /// INFO: the store holds the running config again.
    Agrees,
}

/// What weft does about a store that differs, said in every WARN.
const KEEPS: &str = "weft keeps running the config it started with until it is restarted (a \
                     SIGHUP keeps it too)";

impl Notice {
    /// Whether this is said at WARN (else INFO).
    pub(crate) fn is_warning(&self) -> bool {
        !matches!(self, Self::Agrees)
    }

    /// The log line.
    pub(crate) fn message(&self) -> String {
        match self {
            Self::Differs { differences, backend } => {
                let mut m = format!(
                    "the network config in the store differs from the one weft runs: {}. \
                     {KEEPS}; a restart takes the store's",
                    differences.join(", ")
                );
                if *backend {
                    m.push_str(
                        ". Hosts on different backends cannot reach each other: restart every \
                         host, and expect traffic between restarted hosts and the others to \
                         stop until then",
                    );
                }
                m
            }
            Self::Invalid(why) => format!(
                "the network config in the store is invalid ({why}): {KEEPS}; a restart would \
                 wait until the store's is valid"
            ),
            Self::Absent => format!(
                "the network config is gone from the store: {KEEPS}; a restart would wait \
                 until one is set"
            ),
            Self::Agrees => "the network config in the store is the one weft runs again".into(),
        }
    }

    /// The `/readyz` note while the store differs (`None`: it agrees).
    fn note(&self) -> Option<String> {
        match self {
            Self::Differs { differences, .. } => Some(format!(
                "the store's network config differs ({}); running this one until a restart",
                differences.join(", ")
            )),
            Self::Invalid(_) => {
                Some("the store's network config is invalid; running this one".to_owned())
            }
            Self::Absent => Some("the store has no network config; running this one".to_owned()),
            Self::Agrees => None,
        }
    }
}

/// The running config and what the store was last said to hold.
#[derive(Debug)]
pub(crate) struct ConfigFollow {
    running: NetworkConfig,
    last: InStore,
}

impl ConfigFollow {
    /// Following for a process that runs `running`; the store is taken to hold it until a
    /// value says otherwise.
    pub(crate) fn new(running: NetworkConfig) -> Self {
        Self { running, last: InStore::Running }
    }

    /// The store's config key holds `value` (`None`: absent): what to tell, if anything.
    pub(crate) fn see(&mut self, value: Option<&[u8]>) -> Option<Notice> {
        let now = match value.map(NetworkConfig::parse) {
            None => InStore::Absent,
            Some(Ok(cfg)) if cfg == self.running => InStore::Running,
            Some(Ok(cfg)) => InStore::Other(cfg),
            Some(Err(e)) => InStore::Invalid(e.to_string()),
        };
        if now == self.last {
            return None;
        }
        let notice = match &now {
            InStore::Running => Notice::Agrees,
            InStore::Other(cfg) => Notice::Differs {
                differences: self.running.differences(cfg),
                backend: cfg.backend.kind != self.running.backend.kind,
            },
            InStore::Invalid(why) => Notice::Invalid(why.clone()),
            InStore::Absent => Notice::Absent,
        };
        self.last = now;
        Some(notice)
    }
}

/// What the follower has found, for `/metrics` and `/readyz`.
#[derive(Debug, Default)]
pub(crate) struct ConfigStatus {
    /// The `/readyz` note while the store differs.
    note: Mutex<Option<String>>,
    /// WARNs said.
    changes: AtomicU64,
}

impl ConfigStatus {
    fn record(&self, notice: &Notice) {
        if notice.is_warning() {
            self.changes.fetch_add(1, Ordering::Relaxed);
        }
        *self.note.lock().unwrap_or_else(PoisonError::into_inner) = notice.note();
    }

    /// The note for `/readyz`'s 200 body while the store's config is not the running one.
    pub(crate) fn note(&self) -> Option<String> {
        self.note.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl Collector for ConfigStatus {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let differs = self.note.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        metrics::gauge(
            &mut e,
            "weft_network_config_differs",
            "1 while the network config in the store is not the one weft runs (another, \
             invalid or none); weft runs its own until it is restarted.",
            u64::from(differs),
        )?;
        metrics::counter(
            &mut e,
            "weft_network_config_changes_total",
            "Distinct network configs found in the store other than the one weft runs, each \
             said in a WARN.",
            self.changes.load(Ordering::Relaxed),
        )
    }
}

/// Watches the store's network config until `shutdown`, telling how it stands against
/// `running` (see the module docs).
pub(crate) async fn follow(
    store: Arc<dyn Store>,
    running: NetworkConfig,
    status: Arc<ConfigStatus>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut follower = ConfigFollow::new(running);
    let mut backoff = BACKOFF_MIN;
    while !*shutdown.borrow() {
        let watched = tokio::select! {
            w = store.watch_config() => w,
            _ = shutdown.changed() => return,
        };
        match watched {
            Ok(mut stream) => loop {
                let item = tokio::select! {
                    item = stream.next() => item,
                    _ = shutdown.changed() => return,
                };
                match item {
                    Some(Ok(value)) => {
                        backoff = BACKOFF_MIN;
                        if let Some(notice) = follower.see(value.as_deref()) {
                            status.record(&notice);
                            if notice.is_warning() {
                                warn!("{}", notice.message());
                            } else {
                                info!("{}", notice.message());
                            }
                        }
                    }
                    Some(Err(e)) => {
                        debug!(error = %e, "the network config watch failed");
                        break;
                    }
                    None => break,
                }
            },
            Err(e) => debug!(error = %e, "cannot watch the network config"),
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VXLAN: &[u8] = br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#;
    const HOST_GW: &[u8] = br#"{"Network":"10.244.0.0/16","Backend":{"Type":"host-gw"}}"#;
    const UDP: &[u8] = br#"{"Network":"10.244.0.0/16","Backend":{"Type":"udp"}}"#;

    fn follower() -> ConfigFollow {
        ConfigFollow::new(NetworkConfig::parse(VXLAN).unwrap())
    }

    /// A new backend in the store is said once, naming it and what weft does; the same
    /// config put again says nothing; the running config back is said once at INFO.
    #[test]
    fn a_changed_backend_is_told_once_and_its_return_too() {
        let mut f = follower();
        assert_eq!(f.see(Some(VXLAN)), None, "the running config");
        let differs = f.see(Some(HOST_GW)).expect("told");
        assert_eq!(
            differs,
            Notice::Differs {
                differences: vec!["Backend.Type vxlan -> host-gw".into()],
                backend: true
            }
        );
        assert!(differs.is_warning());
        let text = differs.message();
        assert!(text.contains("Backend.Type vxlan -> host-gw"), "{text}");
        assert!(text.contains("keeps running the config it started with"), "{text}");
        assert!(text.contains("restart every host"), "{text}");
        assert_eq!(f.see(Some(HOST_GW)), None, "the same config again");
        // Another spelling of the same config is the same config.
        let spelled = br#"{"network":"10.244.0.0/16","backend":{"type":"HOST-GW"}}"#;
        assert_eq!(f.see(Some(spelled)), None);
        // A third config is a change of its own.
        assert!(matches!(f.see(Some(UDP)), Some(Notice::Differs { .. })));
        let back = f.see(Some(VXLAN)).expect("told");
        assert_eq!(back, Notice::Agrees);
        assert!(!back.is_warning());
        assert_eq!(f.see(Some(VXLAN)), None);
    }

    /// An invalid config and a missing one are said once each, and say that weft keeps its
    /// own; a change that keeps the backend says nothing of restarting every host.
    #[test]
    fn an_invalid_or_missing_config_is_told_once() {
        let mut f = follower();
        let invalid = f.see(Some(b"{not json")).expect("told");
        assert!(matches!(invalid, Notice::Invalid(_)));
        assert!(invalid.message().contains("keeps running"), "{}", invalid.message());
        assert_eq!(f.see(Some(b"{not json")), None);
        assert_eq!(f.see(None), Some(Notice::Absent));
        assert_eq!(f.see(None), None);
        let vni = br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan","VNI":2}}"#;
        let n = f.see(Some(vni)).expect("told");
        assert!(!n.message().contains("restart every host"), "{}", n.message());
        assert!(n.message().contains("Backend.VNI 1 -> 2"), "{}", n.message());
    }

    /// The status counts each WARN and carries a note while the store differs.
    #[test]
    fn the_status_counts_warnings_and_notes_a_difference() {
        let mut f = follower();
        let status = ConfigStatus::default();
        for value in [Some(HOST_GW), Some(UDP), Some(VXLAN)] {
            let notice = f.see(value).expect("told");
            status.record(&notice);
            if value == Some(UDP) {
                let note = status.note().expect("a note");
                assert!(note.contains("Backend.Type vxlan -> udp"), "{note}");
            }
        }
        assert_eq!(status.changes.load(Ordering::Relaxed), 2);
        assert_eq!(status.note(), None);
    }

    /// The driver: a change written while it runs is told, and a re-put is not.
    #[tokio::test(start_paused = true)]
    async fn the_driver_tells_a_change_written_while_it_runs() {
        use crate::lease::memory::MemoryStore;
        use crate::time::ManualClock;
        let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
        let admin = store.client("admin");
        admin.set_config(VXLAN).await.unwrap();
        let status = Arc::new(ConfigStatus::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(follow(
            Arc::new(store.client("node")),
            NetworkConfig::parse(VXLAN).unwrap(),
            status.clone(),
            stop_rx,
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(status.changes.load(Ordering::Relaxed), 0);
        admin.set_config(HOST_GW).await.unwrap();
        admin.set_config(HOST_GW).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(status.changes.load(Ordering::Relaxed), 1);
        assert!(status.note().is_some());
        // A watch cut off is set up again, and tells nothing new for the same config.
        store.partition("node", true);
        tokio::time::sleep(Duration::from_millis(10)).await;
        store.partition("node", false);
        tokio::time::sleep(BACKOFF_MIN * 2).await;
        admin.set_config(VXLAN).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!((status.changes.load(Ordering::Relaxed), status.note()), (1, None));
        stop.send_replace(true);
        task.await.unwrap();
    }
}
