//! The Kubernetes API for the subnet manager: the client (as flanneld's flags make it), the
//! Node feed the route watcher reads, and this node's own Node. The only kube code that does
//! I/O.
//!
//! Contract:
//! - [`connect`]: `--kubeconfig-file` (with `--kube-api-url` overriding its server, as
//!   flanneld's client does), else `--kube-api-url` alone (no credentials), else the pod's
//!   in-cluster service account. Credentials are the client's: never logged, never written.
//! - [`node_name`]: `NODE_NAME`, else the node of the pod `POD_NAMESPACE`/`POD_NAME` runs on.
//! - [`NodeFeed`] is a [`LeaseFeed`]: a list of the Nodes is a [`Listing`], a watch of them from
//!   that list's resource version is a stream of [`WatchBatch`]es (see [`super::nodes`]). A
//!   watch the server ends is an error the route watcher answers with a re-list; `410 Gone` is
//!   [`StoreError::Compacted`]. A Node that announces another's subnet, or that is no peer for
//!   a problem, is named at WARN once (INFO when it is over), and counted.
//! - Errors map onto the store's kinds: 401 and 403 are [`StoreError::Auth`] (an expired or
//!   revoked token, a missing RBAC rule), a server that cannot be reached
//!   [`StoreError::Unavailable`], anything else [`StoreError::Protocol`].

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent as KubeEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing::{info, warn};

use super::annotations::{AnnotationNames, NodeView};
use super::nodes::NodeSet;
use crate::config::NetworkConfig;
use crate::lease::record::{LeaseName, Revision};
use crate::lease::store::{BoxError, LeaseFeed, Listing, StoreError, WatchBatch, WatchStream};
use crate::metrics;

/// How weft reaches the API server, from flanneld's flags.
#[derive(Clone, Debug, Default)]
pub struct KubeSettings {
    /// `--kubeconfig-file`.
    pub kubeconfig: Option<PathBuf>,
    /// `--kube-api-url`.
    pub api_url: Option<String>,
}

/// The longest one call to the API server may take (a watch: its set-up); an API server that
/// hangs is one that cannot be reached.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `call`, bounded by [`CALL_TIMEOUT`], its error mapped.
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => r.map_err(map_err),
        Err(_) => Err(StoreError::Timeout(CALL_TIMEOUT)),
    }
}

/// A plain-text error, boxed as the source of a [`StoreError`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Message(String);

fn boxed(text: impl Into<String>) -> BoxError {
    Box::new(Message(text.into()))
}

/// The client for `settings` (see the module docs).
pub async fn connect(settings: &KubeSettings) -> Result<Client, StoreError> {
    let setup =
        |what: &str, e: &dyn std::fmt::Display| StoreError::Setup(boxed(format!("{what}: {e}")));
    let url = match settings.api_url.as_deref().filter(|u| !u.is_empty()) {
        Some(u) => {
            Some(u.parse::<http::Uri>().map_err(|e| setup(&format!("--kube-api-url {u:?}"), &e))?)
        }
        None => None,
    };
    let config = match (&settings.kubeconfig, url) {
        (Some(path), url) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| setup(&format!("reading the kubeconfig {}", path.display()), &e))?;
            let mut c = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| setup(&format!("the kubeconfig {}", path.display()), &e))?;
            if let Some(url) = url {
                c.cluster_url = url;
            }
            c
        }
        (None, Some(url)) => Config::new(url),
        (None, None) => Config::incluster().map_err(|e| {
            setup(
                "no --kubeconfig-file or --kube-api-url, and not in a pod (in-cluster config)",
                &e,
            )
        })?,
    };
    Client::try_from(config).map_err(|e| setup("making the Kubernetes client", &e))
}

/// This node's name: `NODE_NAME`, else the node of the pod `POD_NAMESPACE`/`POD_NAME`.
pub async fn node_name(client: &Client) -> Result<String, StoreError> {
    if let Some(name) = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()) {
        return Ok(name);
    }
    let (Ok(pod), Ok(ns)) = (std::env::var("POD_NAME"), std::env::var("POD_NAMESPACE")) else {
        return Err(StoreError::Setup(boxed(
            "set NODE_NAME (the downward API's spec.nodeName), or POD_NAME and POD_NAMESPACE",
        )));
    };
    let got = bounded(Api::<Pod>::namespaced(client.clone(), &ns).get(&pod)).await?;
    got.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty()).ok_or_else(|| {
        StoreError::Setup(boxed(format!("the pod {ns}/{pod} names no node (spec.nodeName)")))
    })
}

/// Maps a client error onto the store's kinds (see the module docs).
pub(crate) fn map_err(e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(status) => {
            let text = format!(
                "the API server said {} {}: {}",
                status.code, status.reason, status.message
            );
            match status.code {
                401 | 403 => StoreError::Auth(boxed(text)),
                410 => {
                    StoreError::Compacted { requested: Revision(0), compact_revision: Revision(0) }
                }
                429 | 500..=599 => StoreError::Unavailable(boxed(text)),
                _ => StoreError::Protocol(boxed(text)),
            }
        }
        kube::Error::HyperError(e) => StoreError::Unavailable(boxed(innermost(&e))),
        kube::Error::Service(e) => StoreError::Unavailable(boxed(innermost(&*e))),
        other => StoreError::Protocol(boxed(other.to_string())),
    }
}

/// An error and its innermost cause, in one line.
fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e;
    while let Some(next) = last.source() {
        last = next;
    }
    let (head, tail) = (e.to_string(), last.to_string());
    if head.contains(&tail) { head } else { format!("{head}: {tail}") }
}

/// What the subnet manager reads of a Node.
pub fn view(node: &Node) -> NodeView {
    let meta = &node.metadata;
    let spec = node.spec.as_ref();
    let mut pod_cidrs = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
    if pod_cidrs.is_empty()
        && let Some(one) = spec.and_then(|s| s.pod_cidr.clone()).filter(|c| !c.is_empty())
    {
        pod_cidrs.push(one);
    }
    NodeView {
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        created: meta.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second()),
        pod_cidrs,
        annotations: meta.annotations.clone().unwrap_or_default(),
    }
}

/// What [`NodeFeed`] has said and counted.
#[derive(Debug, Default)]
pub struct NodeFeedStats {
    /// Nodes announcing a subnet an older Node holds, now.
    conflicts: AtomicU64,
    /// Nodes that say a subnet manager runs on them but are no peer, now.
    unreadable: AtomicU64,
    /// Watch events applied.
    events: AtomicU64,
}

impl Collector for NodeFeedStats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        metrics::gauge(
            &mut encoder,
            "weft_kube_node_subnet_conflicts",
            "Nodes announcing a subnet an older Node holds (not routed to)",
            self.conflicts.load(Ordering::Relaxed),
        )?;
        metrics::gauge(
            &mut encoder,
            "weft_kube_unreadable_nodes",
            "Nodes running a subnet manager whose lease does not read (not routed to)",
            self.unreadable.load(Ordering::Relaxed),
        )?;
        metrics::counter(
            &mut encoder,
            "weft_kube_node_events_total",
            "Node watch events applied",
            self.events.load(Ordering::Relaxed),
        )
    }
}

struct FeedState {
    set: NodeSet,
    /// The resource version to watch from.
    resume: String,
    /// Conflicts and problems already said, as text.
    told: BTreeSet<String>,
}

/// Every Node's lease, listed and watched (see the module docs).
#[derive(Clone)]
pub struct NodeFeed {
    nodes: Api<Node>,
    state: Arc<Mutex<FeedState>>,
    stats: Arc<NodeFeedStats>,
}

impl NodeFeed {
    /// A feed of `client`'s Nodes, read with `names` under `network`.
    pub fn new(client: Client, names: AnnotationNames, network: NetworkConfig) -> Self {
        Self {
            nodes: Api::all(client),
            state: Arc::new(Mutex::new(FeedState {
                set: NodeSet::new(names, network),
                resume: String::new(),
                told: BTreeSet::new(),
            })),
            stats: Arc::default(),
        }
    }

    /// Its metrics.
    pub fn stats(&self) -> Arc<NodeFeedStats> {
        self.stats.clone()
    }

    fn apply(&self, event: KubeEvent<Node>) -> Option<Result<WatchBatch, StoreError>> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let batch = match event {
            KubeEvent::Added(n) | KubeEvent::Modified(n) => {
                if let Some(rv) = n.metadata.resource_version.clone() {
                    st.resume = rv;
                }
                st.set.upsert(&view(&n))
            }
            KubeEvent::Deleted(n) => {
                if let Some(rv) = n.metadata.resource_version.clone() {
                    st.resume = rv;
                }
                st.set.remove(n.metadata.name.as_deref().unwrap_or_default())
            }
            KubeEvent::Bookmark(b) => {
                st.resume = b.metadata.resource_version;
                return None;
            }
            KubeEvent::Error(status) => return Some(Err(map_err(kube::Error::Api(status)))),
        };
        self.stats.events.fetch_add(1, Ordering::Relaxed);
        self.tell(&mut st);
        (!batch.events.is_empty()).then_some(Ok(batch))
    }

    /// Names each new conflict and problem once, and each that is over.
    fn tell(&self, st: &mut FeedState) {
        let conflicts = st.set.conflicts();
        let problems = st.set.problems();
        self.stats
            .conflicts
            .store(conflicts.iter().map(|c| c.others.len() as u64).sum(), Ordering::Relaxed);
        self.stats.unreadable.store(problems.len() as u64, Ordering::Relaxed);
        let mut now = BTreeSet::new();
        for c in &conflicts {
            for other in &c.others {
                let key = format!("conflict {} {other}", c.subnet);
                if !st.told.contains(&key) {
                    warn!(subnet = %c.subnet, node = %other, holder = %c.holder, "the Node {other} announces the subnet {} that the older Node {} holds: no route to {other} (two nodes must never share a podCIDR)", c.subnet, c.holder);
                }
                now.insert(key);
            }
        }
        for (node, problem) in &problems {
            let key = format!("problem {node} {problem}");
            if !st.told.contains(&key) {
                warn!(%node, %problem, "the Node {node} runs a subnet manager but is no peer: {problem}");
            }
            now.insert(key);
        }
        for gone in st.told.difference(&now) {
            info!(what = %gone, "over");
        }
        st.told = now;
    }
}

#[async_trait::async_trait]
impl LeaseFeed for NodeFeed {
    async fn list(&self) -> Result<Listing, StoreError> {
        let list = bounded(self.nodes.list(&ListParams::default())).await?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.resume = list.metadata.resource_version.clone().unwrap_or_default();
        let listing = st.set.replace_all(list.items.iter().map(view));
        self.tell(&mut st);
        Ok(listing)
    }

    async fn watch(
        &self,
        _from: Revision,
        only: Option<LeaseName>,
    ) -> Result<WatchStream, StoreError> {
        if only.is_some() {
            return Err(StoreError::Setup(boxed(
                "the Node feed watches every Node, not one lease",
            )));
        }
        let resume = self.state.lock().unwrap_or_else(PoisonError::into_inner).resume.clone();
        let stream = bounded(self.nodes.watch(&WatchParams::default(), &resume)).await?;
        let feed = self.clone();
        Ok(Box::pin(stream.filter_map(move |item| {
            let out = match item {
                Ok(event) => feed.apply(event),
                Err(e) => Some(Err(map_err(e))),
            };
            futures::future::ready(out)
        })))
    }
}

/// This node's Node: read, announced on, watched.
#[derive(Clone)]
pub struct OwnNode {
    nodes: Api<Node>,
    /// Its name.
    pub name: String,
}

impl OwnNode {
    /// The Node `name` of `client`.
    pub fn new(client: Client, name: String) -> Self {
        Self { nodes: Api::all(client), name }
    }

    /// The Node now; `Ok(None)` when there is none of that name.
    pub async fn get(&self) -> Result<Option<NodeView>, StoreError> {
        bounded(self.nodes.get_opt(&self.name)).await.map(|n| n.as_ref().map(view))
    }

    /// Applies a strategic-merge patch to the Node's status subresource (annotations and
    /// conditions both go there, as flannel writes them: RBAC `nodes/status: patch`).
    pub async fn patch_status(&self, patch: &serde_json::Value) -> Result<(), StoreError> {
        bounded(self.nodes.patch_status(
            &self.name,
            &PatchParams::default(),
            &Patch::Strategic(patch),
        ))
        .await
        .map(|_| ())
    }
}

impl OwnNode {
    /// A stream that yields whenever the Node changes (or is created or deleted), first once at
    /// once; it ends when the server ends the watch.
    pub async fn changes(&self) -> Result<futures::stream::BoxStream<'static, ()>, StoreError> {
        let wp = WatchParams::default().fields(&format!("metadata.name={}", self.name));
        let stream = bounded(self.nodes.watch(&wp, "0")).await?;
        Ok(stream.map(|_| ()).boxed())
    }
}
