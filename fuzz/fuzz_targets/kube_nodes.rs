//! The Kubernetes subnet manager's node reading: arbitrary Nodes (names, podCIDRs, flannel's
//! annotations with any values) added, changed and deleted in any order. Nothing panics, and
//! the leases the watch batches build up are always the leases a fresh listing of the same
//! Nodes gives (one holder per subnet, whatever the order).
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use weft::config::NetworkConfig;
use weft::lease::kube::annotations::{AnnotationNames, DEFAULT_PREFIX, NodeView, own_patch};
use weft::lease::kube::nodes::NodeSet;
use weft::lease::record::{LeaseAttrs, Subnet};
use weft::lease::store::WatchEvent;

const KEYS: [&str; 6] = [
    "kube-subnet-manager",
    "backend-type",
    "backend-data",
    "public-ip",
    "public-ipv6",
    "backend-v6-data",
];

fn node(op: &[u8]) -> NodeView {
    let text = String::from_utf8_lossy(op);
    let mut fields = text.split('\0');
    let name = format!("n{}", fields.next().unwrap_or_default().len() % 4);
    let created = i64::from(op.first().copied().unwrap_or(0) % 3);
    let cidrs = fields.next().unwrap_or_default();
    let pod_cidrs =
        if cidrs.is_empty() { vec![] } else { cidrs.split(',').map(str::to_owned).collect() };
    let mut annotations = BTreeMap::new();
    for (i, v) in fields.enumerate() {
        annotations.insert(format!("{DEFAULT_PREFIX}/{}", KEYS[i % KEYS.len()]), v.to_owned());
    }
    NodeView { uid: format!("uid-{name}"), name, created, pod_cidrs, annotations }
}

fuzz_target!(|data: &[u8]| {
    let dual = data.first().is_some_and(|b| b & 1 == 1);
    let cfg: &[u8] = if dual {
        br#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00::/56","Backend":{"Type":"vxlan"}}"#
    } else {
        br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#
    };
    let network = NetworkConfig::parse(cfg).unwrap();
    let names = AnnotationNames::new(DEFAULT_PREFIX).unwrap();
    let mut set = NodeSet::new(names.clone(), network.clone());
    let attrs = LeaseAttrs {
        public_ip: [192, 0, 2, 1].into(),
        public_ipv6: dual.then(|| "2001:db8::1".parse().unwrap()),
        backend_type: Some("vxlan".into()),
        backend_data: None,
        backend_v6_data: None,
        node_id: None,
        incarnation: None,
    };
    let mut nodes: BTreeMap<String, NodeView> = BTreeMap::new();
    let mut routes: BTreeMap<Subnet, String> = BTreeMap::new();
    for op in data.split(|b| *b == 0xff) {
        let n = node(op);
        let batch = if op.first().is_some_and(|b| b & 0x80 != 0) {
            nodes.remove(&n.name);
            set.remove(&n.name)
        } else {
            let _ = own_patch(&names, &attrs, &n.annotations, !dual);
            nodes.insert(n.name.clone(), n.clone());
            set.upsert(&n)
        };
        assert_eq!(batch.revision, set.revision());
        for e in batch.events {
            match e {
                WatchEvent::Put(l) => {
                    routes.insert(l.subnet, format!("{:?}", l.attrs));
                }
                WatchEvent::Delete { subnet, .. } => {
                    assert!(routes.remove(&subnet).is_some(), "a delete of nothing");
                }
                _ => {}
            }
        }
        let mut fresh = NodeSet::new(names.clone(), network.clone());
        let listed: BTreeMap<Subnet, String> = fresh
            .replace_all(nodes.values().cloned())
            .leases
            .into_iter()
            .map(|l| (l.subnet, format!("{:?}", l.attrs)))
            .collect();
        assert_eq!(routes, listed, "the watch and a listing disagree");
    }
});
