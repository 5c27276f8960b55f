//! Every Node's lease, one holder per subnet (pure): what the Node list and watch become for
//! the route watcher, as the store's listings and watch batches.
//!
//! Contract:
//! - [`NodeSet::replace_all`] takes a whole listing of Nodes and gives a [`Listing`] at a new
//!   revision; [`NodeSet::upsert`] and [`NodeSet::remove`] take one watch event each and give
//!   the [`WatchBatch`] of lease changes it makes (empty for a Node whose lease did not change:
//!   status heartbeats publish nothing).
//! - Revisions are this set's own counter, one per listing or event: the API server's
//!   resource versions are opaque and never compared here.
//! - One holder per subnet: Nodes whose podCIDRs overlap (a node deleted and re-created while
//!   the old object lingers, an operator's mistake) never both get the subnet. The oldest Node
//!   (creation time, then name) holds it; the others are [`Conflict`]s, for the driver to name.
//!   When the holder goes, the next one gets it.
//! - A Node that goes (deleted, its podCIDR changed, or no longer a peer) leaves cleanly: its
//!   delete comes with a [`WatchEvent::Departed`] marker, so its route goes rather than
//!   staying stale (flannel removes it too). An API server that cannot be reached changes
//!   nothing here.
//! - A Node that is no peer for a [`NodeProblem`] is kept as such, for the driver to name once.

use std::collections::{BTreeMap, BTreeSet};

use super::annotations::{AnnotationNames, NodeProblem, NodeView, node_lease};
use crate::config::NetworkConfig;
use crate::lease::record::{
    HistoryEntry, HistoryRecord, HistoryState, LeaseAttrs, NodeId, Revision, StoreLeaseId,
    StoredLease,
};
use crate::lease::store::{Listing, WatchBatch, WatchEvent};
use crate::vocab::{LeaseName, Subnet};

/// One Node, as far as leases go.
#[derive(Clone, Debug, PartialEq)]
struct Known {
    /// Creation time, then name: who holds a contested subnet.
    seniority: (i64, String),
    uid: String,
    lease: Result<Option<(LeaseName, LeaseAttrs)>, NodeProblem>,
}

impl Known {
    fn name(&self) -> Option<LeaseName> {
        self.lease.as_ref().ok().and_then(|l| l.as_ref()).map(|(n, _)| *n)
    }
}

/// Nodes that announce one subnet: `holder` has it, `others` are not routed to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The subnet.
    pub subnet: Subnet,
    /// The Node that holds it (the oldest).
    pub holder: String,
    /// The other Nodes announcing it.
    pub others: Vec<String>,
}

/// Every Node's lease (see the module docs).
#[derive(Debug)]
pub struct NodeSet {
    names: AnnotationNames,
    network: NetworkConfig,
    nodes: BTreeMap<String, Known>,
    /// Each announced subnet's claimants, oldest first.
    claims: BTreeMap<Subnet, BTreeSet<(i64, String)>>,
    revision: i64,
}

impl NodeSet {
    /// An empty set reading `names` under `network`.
    pub fn new(names: AnnotationNames, network: NetworkConfig) -> Self {
        Self { names, network, nodes: BTreeMap::new(), claims: BTreeMap::new(), revision: 0 }
    }

    /// The revision of the last listing or event.
    pub fn revision(&self) -> Revision {
        Revision(self.revision)
    }

    /// Replaces every Node with `nodes` (a listing).
    pub fn replace_all(&mut self, nodes: impl IntoIterator<Item = NodeView>) -> Listing {
        self.revision += 1;
        self.nodes.clear();
        self.claims.clear();
        for node in nodes {
            self.insert(&node);
        }
        let leases = self.claims.keys().filter_map(|s| self.held(*s)).collect();
        Listing { revision: self.revision(), leases, ..Listing::default() }
    }

    /// A Node added or changed.
    pub fn upsert(&mut self, node: &NodeView) -> WatchBatch {
        self.revision += 1;
        let before = self.nodes.get(&node.name).and_then(Known::name);
        let after = node_lease(&self.names, &self.network, node).ok().flatten().map(|(n, _)| n);
        let touched = self.touched(before, after);
        let held_before = self.held_map(&touched);
        self.forget(&node.name);
        self.insert(node);
        self.diff(held_before, &touched)
    }

    /// A Node deleted.
    pub fn remove(&mut self, name: &str) -> WatchBatch {
        self.revision += 1;
        let before = self.nodes.get(name).and_then(Known::name);
        let touched = self.touched(before, None);
        let held_before = self.held_map(&touched);
        self.forget(name);
        self.diff(held_before, &touched)
    }

    /// Nodes that announce a subnet another, older Node holds.
    pub fn conflicts(&self) -> Vec<Conflict> {
        self.claims
            .iter()
            .filter(|(_, c)| c.len() > 1)
            .map(|(subnet, c)| {
                let mut it = c.iter().map(|(_, n)| n.clone());
                let holder = it.next().unwrap_or_default();
                Conflict { subnet: *subnet, holder, others: it.collect() }
            })
            .collect()
    }

    /// Nodes that say a subnet manager runs on them but are no peer, and why.
    pub fn problems(&self) -> Vec<(String, NodeProblem)> {
        self.nodes
            .iter()
            .filter_map(|(n, k)| k.lease.as_ref().err().map(|e| (n.clone(), e.clone())))
            .collect()
    }

    /// The Node holding `subnet`, if any.
    pub fn holder(&self, subnet: Subnet) -> Option<&str> {
        self.claims.get(&subnet).and_then(|c| c.first()).map(|(_, n)| n.as_str())
    }

    fn touched(&self, a: Option<LeaseName>, b: Option<LeaseName>) -> BTreeSet<Subnet> {
        a.into_iter().chain(b).map(|n| n.subnet).collect()
    }

    fn held_map(&self, subnets: &BTreeSet<Subnet>) -> BTreeMap<Subnet, (String, StoredLease)> {
        subnets
            .iter()
            .filter_map(|s| {
                let holder = self.holder(*s)?.to_owned();
                Some((*s, (holder, self.held(*s)?)))
            })
            .collect()
    }

    fn insert(&mut self, node: &NodeView) -> Option<LeaseName> {
        let lease = node_lease(&self.names, &self.network, node);
        let known =
            Known { seniority: (node.created, node.name.clone()), uid: node.uid.clone(), lease };
        let name = known.name();
        if let Some(n) = name {
            self.claims.entry(n.subnet).or_default().insert(known.seniority.clone());
        }
        self.nodes.insert(node.name.clone(), known);
        name
    }

    fn forget(&mut self, name: &str) {
        let Some(known) = self.nodes.remove(name) else { return };
        if let Some(n) = known.name()
            && let Some(c) = self.claims.get_mut(&n.subnet)
        {
            c.remove(&known.seniority);
            if c.is_empty() {
                self.claims.remove(&n.subnet);
            }
        }
    }

    /// The lease record of `subnet`'s holder.
    fn held(&self, subnet: Subnet) -> Option<StoredLease> {
        let holder = self.holder(subnet)?;
        let known = self.nodes.get(holder)?;
        let (name, attrs) = known.lease.as_ref().ok()?.as_ref()?;
        Some(StoredLease {
            subnet: name.subnet,
            ipv6: name.ipv6,
            attrs: attrs.clone(),
            create_revision: Revision(known.seniority.0),
            mod_revision: self.revision(),
            lease_id: StoreLeaseId(0),
        })
    }

    fn diff(
        &self,
        before: BTreeMap<Subnet, (String, StoredLease)>,
        touched: &BTreeSet<Subnet>,
    ) -> WatchBatch {
        let rev = self.revision();
        let mut events = Vec::new();
        for subnet in touched {
            let was = before.get(subnet);
            let now = self.holder(*subnet).map(str::to_owned).zip(self.held(*subnet));
            match (was, now) {
                (Some((h0, l0)), Some((h1, l1)))
                    if *h0 == h1 && l0.name() == l1.name() && l0.attrs == l1.attrs => {}
                (_, Some((_, lease))) => events.push(WatchEvent::Put(lease)),
                (Some((holder, lease)), None) => {
                    events.push(WatchEvent::Delete { subnet: *subnet, revision: rev });
                    events.push(WatchEvent::Departed(self.departure(holder, lease)));
                }
                (None, None) => {}
            }
        }
        WatchBatch { revision: rev, events }
    }

    /// The clean-leave marker for `lease`, held by Node `holder` until now.
    fn departure(&self, holder: &str, lease: &StoredLease) -> HistoryEntry {
        // The history names a node by a weft node ID; a Node's is its name when that is one,
        // else a stand-in (the record only says the leave was clean).
        let node = NodeId::parse(holder)
            .or_else(|_| NodeId::parse("kubernetes-node"))
            .unwrap_or_else(|_| NodeId::generate());
        HistoryEntry {
            subnet: lease.subnet,
            record: HistoryRecord {
                state: HistoryState::Relinquished,
                node,
                public_ip: lease.attrs.public_ip,
                ipv6: lease.ipv6,
            },
            mod_revision: self.revision(),
        }
    }

    /// The uid of Node `name`, if known.
    pub fn uid(&self, name: &str) -> Option<&str> {
        self.nodes.get(name).map(|k| k.uid.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::super::annotations::DEFAULT_PREFIX;
    use super::*;

    fn set() -> NodeSet {
        let net =
            NetworkConfig::parse(br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#)
                .unwrap();
        NodeSet::new(AnnotationNames::new(DEFAULT_PREFIX).unwrap(), net)
    }

    fn node(name: &str, created: i64, cidr: &str, ip: &str) -> NodeView {
        let p = "flannel.alpha.coreos.com/";
        let ann = [
            ("kube-subnet-manager", "true"),
            ("backend-type", "vxlan"),
            ("backend-data", r#"{"VNI":1,"VtepMAC":"8e:1c:00:00:00:01"}"#),
            ("public-ip", ip),
        ];
        NodeView {
            name: name.into(),
            uid: format!("uid-{name}"),
            created,
            pod_cidrs: vec![cidr.into()],
            annotations: ann.iter().map(|(k, v)| (format!("{p}{k}"), (*v).to_owned())).collect(),
        }
    }

    fn puts(b: &WatchBatch) -> Vec<String> {
        b.events
            .iter()
            .map(|e| match e {
                WatchEvent::Put(l) => format!("put {} {}", l.subnet, l.attrs.public_ip),
                WatchEvent::Delete { subnet, .. } => format!("delete {subnet}"),
                WatchEvent::Departed(h) => format!("departed {}", h.subnet),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn nodes_become_leases_and_a_heartbeat_changes_nothing() {
        let mut s = set();
        let l = s.replace_all([node("a", 1, "10.244.1.0/24", "192.0.2.1")]);
        assert_eq!(l.leases.len(), 1);
        let b = s.upsert(&node("b", 2, "10.244.2.0/24", "192.0.2.2"));
        assert_eq!(puts(&b), ["put 10.244.2.0/24 192.0.2.2"]);
        assert!(b.revision > l.revision);
        assert!(s.upsert(&node("b", 2, "10.244.2.0/24", "192.0.2.2")).events.is_empty());
        let moved = s.upsert(&node("b", 2, "10.244.2.0/24", "192.0.2.9"));
        assert_eq!(puts(&moved), ["put 10.244.2.0/24 192.0.2.9"]);
    }

    #[test]
    fn a_deleted_node_or_a_changed_podcidr_leaves_cleanly() {
        let mut s = set();
        s.replace_all([node("a", 1, "10.244.1.0/24", "192.0.2.1")]);
        let b = s.upsert(&node("a", 1, "10.244.7.0/24", "192.0.2.1"));
        assert_eq!(
            puts(&b),
            ["delete 10.244.1.0/24", "departed 10.244.1.0/24", "put 10.244.7.0/24 192.0.2.1"]
        );
        let gone = s.remove("a");
        assert_eq!(puts(&gone), ["delete 10.244.7.0/24", "departed 10.244.7.0/24"]);
        assert!(s.remove("a").events.is_empty());
    }

    #[test]
    fn two_nodes_on_one_subnet_never_both_hold_it() {
        let mut s = set();
        s.replace_all([node("old", 1, "10.244.1.0/24", "192.0.2.1")]);
        let b = s.upsert(&node("new", 5, "10.244.1.0/24", "192.0.2.5"));
        assert!(b.events.is_empty(), "the newer claimant took the route: {:?}", puts(&b));
        assert_eq!(
            s.conflicts(),
            [Conflict {
                subnet: "10.244.1.0/24".parse().unwrap(),
                holder: "old".into(),
                others: vec!["new".into()]
            }]
        );
        let b = s.remove("old");
        assert_eq!(puts(&b), ["put 10.244.1.0/24 192.0.2.5"], "the next claimant gets it");
        assert!(s.conflicts().is_empty());
        // A listing says the same.
        let l = s.replace_all([
            node("x", 9, "10.244.4.0/24", "192.0.2.9"),
            node("w", 3, "10.244.4.0/24", "192.0.2.3"),
        ]);
        assert_eq!(l.leases.len(), 1);
        assert_eq!(l.leases[0].attrs.public_ip.to_string(), "192.0.2.3");
    }

    #[test]
    fn a_node_that_stops_being_a_peer_leaves_and_its_problem_is_kept() {
        let mut s = set();
        s.replace_all([node("a", 1, "10.244.1.0/24", "192.0.2.1")]);
        let mut bad = node("a", 1, "10.244.1.0/24", "192.0.2.1");
        bad.pod_cidrs = vec!["10.99.0.0/24".into()];
        assert_eq!(puts(&s.upsert(&bad)), ["delete 10.244.1.0/24", "departed 10.244.1.0/24"]);
        assert_eq!(s.problems().len(), 1);
    }
}
