//! flannel's node annotations and what a Node says (pure): the names under a prefix, the lease
//! another node announces, and the patch that makes this node announce its own.
//!
//! Contract (flannel's `pkg/subnet/kube`, read for meaning):
//! - [`AnnotationNames::new`] takes `--kube-annotation-prefix` as flannel does: at most one
//!   `/`; without one, `/` is added; a prefix not ending in `/` or `-` gets `-`; the result must
//!   look like `fqdn/[a-z0-9_-]*` and is refused otherwise.
//! - [`node_lease`]: a Node is a peer only once it says `kube-subnet-manager: "true"`. Its
//!   subnet is `spec.podCIDRs` (or `spec.podCIDR`: at most two, one per family), which must be a
//!   lease of the network (inside it, of its subnet length); its `PublicIP` is `public-ip`, its
//!   backend `backend-type` and `backend-data`, and on a dual-stack network `public-ipv6` and
//!   `backend-v6-data` with the IPv6 podCIDR. Anything that does not parse is a
//!   [`NodeProblem`], never a panic.
//! - [`own_patch`]: the annotations this node must carry for `attrs`, as a strategic-merge
//!   patch body, or `None` when it already carries them. A `public-ip-overwrite` (or
//!   `public-ipv6-overwrite`) annotation an operator set wins over the detected address.
//! - [`network_up_patch`]: the `NetworkUnavailable=False` condition (reason `FlannelIsUp`)
//!   a node gets once it forwards.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde_json::{Value, json};

use crate::config::NetworkConfig;
use crate::lease::record::LeaseAttrs;
use crate::vocab::{ForeignSubnet, Ipv6Subnet, LeaseName, Subnet};

/// flannel's default annotation prefix (`--kube-annotation-prefix`).
pub const DEFAULT_PREFIX: &str = "flannel.alpha.coreos.com";

/// The longest annotation value read (backend data is a few dozen bytes; a node's annotations
/// are limited to 256 KiB by the API server as a whole).
const MAX_VALUE_LEN: usize = 4096;

/// The full names of flannel's annotations under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnotationNames {
    /// `kube-subnet-manager`: `"true"` on every node a kube subnet manager runs on.
    pub subnet_manager: String,
    /// `backend-type`.
    pub backend_type: String,
    /// `backend-data`.
    pub backend_data: String,
    /// `backend-v6-data`.
    pub backend_v6_data: String,
    /// `public-ip`.
    pub public_ip: String,
    /// `public-ipv6`.
    pub public_ipv6: String,
    /// `public-ip-overwrite`: set by an operator, published as `public-ip`.
    pub public_ip_overwrite: String,
    /// `public-ipv6-overwrite`.
    pub public_ipv6_overwrite: String,
}

/// Why `--kube-annotation-prefix` was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    /// More than one `/`.
    #[error("the annotation prefix {0:?} has more than one '/'")]
    TooManySlashes(String),
    /// Not `fqdn/[a-z0-9_-]*`.
    #[error("the annotation prefix {0:?} is not of the form fqdn/[a-z0-9_-]* (lower case)")]
    Malformed(String),
}

impl AnnotationNames {
    /// The names under `prefix` (see the module docs).
    pub fn new(prefix: &str) -> Result<Self, PrefixError> {
        let mut p = prefix.to_owned();
        match p.matches('/').count() {
            0 => p.push('/'),
            1 => {}
            _ => return Err(PrefixError::TooManySlashes(prefix.to_owned())),
        }
        if !p.ends_with('/') && !p.ends_with('-') {
            p.push('-');
        }
        if !well_formed(&p) {
            return Err(PrefixError::Malformed(prefix.to_owned()));
        }
        let n = |s: &str| format!("{p}{s}");
        Ok(Self {
            subnet_manager: n("kube-subnet-manager"),
            backend_type: n("backend-type"),
            backend_data: n("backend-data"),
            backend_v6_data: n("backend-v6-data"),
            public_ip: n("public-ip"),
            public_ipv6: n("public-ipv6"),
            public_ip_overwrite: n("public-ip-overwrite"),
            public_ipv6_overwrite: n("public-ipv6-overwrite"),
        })
    }
}

/// `(?:[a-z0-9_-]+\.)+[a-z0-9_-]+/(?:[a-z0-9_-]+-)?` as a whole: a dotted name of at least two
/// labels, a `/`, then nothing or a name ending in `-`.
fn well_formed(p: &str) -> bool {
    let word = |s: &str| {
        !s.is_empty() && s.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'))
    };
    let Some((host, rest)) = p.split_once('/') else { return false };
    let labels: Vec<&str> = host.split('.').collect();
    labels.len() >= 2
        && labels.iter().all(|l| word(l))
        && (rest.is_empty() || (rest.ends_with('-') && word(rest)))
}

/// A Node as the subnet manager reads it: plain data, so the rules here are pure (the driver
/// fills it from the API's object).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`: a node deleted and re-created under one name has a new one.
    pub uid: String,
    /// `metadata.creationTimestamp`, in seconds since the epoch (0: not given).
    pub created: i64,
    /// `spec.podCIDRs`, or `[spec.podCIDR]` when that list is empty, or nothing.
    pub pod_cidrs: Vec<String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
}

/// Why a Node that says it runs a subnet manager is no peer (it is skipped, named once).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NodeProblem {
    /// No podCIDR yet (the controller manager has not assigned one).
    #[error("it has no podCIDR")]
    NoPodCidr,
    /// More than two podCIDRs, or two of one family.
    #[error("its podCIDRs {0:?} are neither one family nor dual-stack")]
    PodCidrs(Vec<String>),
    /// A podCIDR that is not a CIDR, or has host bits.
    #[error("its podCIDR {0:?} is not a subnet")]
    BadPodCidr(String),
    /// No podCIDR of a family the network leases.
    #[error("it has no {0} podCIDR, which the network needs")]
    MissingFamily(&'static str),
    /// A podCIDR that is no lease of the network.
    #[error("{0}")]
    Foreign(ForeignSubnet),
    /// An annotation that is missing or does not parse.
    #[error("annotation {name}: {why}")]
    Annotation {
        /// The annotation's full name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
}

/// The podCIDRs of `node`, one per family.
fn pod_subnets(node: &NodeView) -> Result<(Option<Subnet>, Option<Ipv6Subnet>), NodeProblem> {
    if node.pod_cidrs.is_empty() {
        return Err(NodeProblem::NoPodCidr);
    }
    if node.pod_cidrs.len() > 2 {
        return Err(NodeProblem::PodCidrs(node.pod_cidrs.clone()));
    }
    let (mut v4, mut v6) = (None, None);
    for text in &node.pod_cidrs {
        let net: IpNet = text.parse().map_err(|_| NodeProblem::BadPodCidr(text.clone()))?;
        if net.network() != net.addr() {
            return Err(NodeProblem::BadPodCidr(text.clone()));
        }
        let twice = match net {
            IpNet::V4(n) => v4
                .replace(
                    Subnet::from_parts(n.addr(), n.prefix_len())
                        .map_err(|_| NodeProblem::BadPodCidr(text.clone()))?,
                )
                .is_some(),
            IpNet::V6(n) => v6
                .replace(Ipv6Subnet::new(n).map_err(|_| NodeProblem::BadPodCidr(text.clone()))?)
                .is_some(),
        };
        if twice {
            return Err(NodeProblem::PodCidrs(node.pod_cidrs.clone()));
        }
    }
    Ok((v4, v6))
}

/// This node's lease name from its podCIDRs, checked against the network (see the module
/// docs): what [`node_lease`] reads for every node, and the subnet manager for its own.
pub fn pod_lease_name(network: &NetworkConfig, node: &NodeView) -> Result<LeaseName, NodeProblem> {
    let (v4, v6) = pod_subnets(node)?;
    let name = match (network.leases_ipv4(), network.ipv6.is_some()) {
        (true, dual) => {
            let subnet = v4.ok_or(NodeProblem::MissingFamily("IPv4"))?;
            let ipv6 =
                if dual { Some(v6.ok_or(NodeProblem::MissingFamily("IPv6"))?) } else { None };
            LeaseName { subnet, ipv6 }
        }
        (false, _) => {
            LeaseName::single(Subnet::from(v6.ok_or(NodeProblem::MissingFamily("IPv6"))?))
        }
    };
    network.check_lease(name.subnet).map_err(NodeProblem::Foreign)?;
    if let (Some(half), Some(v6cfg)) = (name.ipv6, network.ipv6.as_ref())
        && network.leases_ipv4()
        && !(v6cfg.network.contains(&half.net()) && half.prefix_len() == v6cfg.subnet_len)
    {
        return Err(NodeProblem::Foreign(ForeignSubnet::OutsideNetwork {
            subnet: Subnet::from(half),
            network: IpNet::V6(v6cfg.network),
        }));
    }
    Ok(name)
}

fn annotation<'a>(node: &'a NodeView, name: &str) -> Result<&'a str, NodeProblem> {
    let value = node.annotations.get(name).map(String::as_str).unwrap_or_default();
    if value.is_empty() {
        return Err(NodeProblem::Annotation { name: name.to_owned(), why: "missing".into() });
    }
    if value.len() > MAX_VALUE_LEN {
        return Err(NodeProblem::Annotation {
            name: name.to_owned(),
            why: format!("{} bytes, more than {MAX_VALUE_LEN}", value.len()),
        });
    }
    Ok(value)
}

fn parsed<T: std::str::FromStr>(node: &NodeView, name: &str, what: &str) -> Result<T, NodeProblem> {
    let text = annotation(node, name)?;
    text.parse().map_err(|_| NodeProblem::Annotation {
        name: name.to_owned(),
        why: format!("{:?} is not {what}", shorten(text)),
    })
}

fn json_of(node: &NodeView, name: &str) -> Result<Option<Value>, NodeProblem> {
    let Some(text) = node.annotations.get(name).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    if text.len() > MAX_VALUE_LEN {
        return Err(NodeProblem::Annotation {
            name: name.to_owned(),
            why: format!("{} bytes, more than {MAX_VALUE_LEN}", text.len()),
        });
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Null) => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            Err(NodeProblem::Annotation { name: name.to_owned(), why: format!("not JSON: {e}") })
        }
    }
}

fn shorten(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The lease `node` announces: `Ok(None)` until it says a subnet manager runs on it (see the
/// module docs).
pub fn node_lease(
    names: &AnnotationNames,
    network: &NetworkConfig,
    node: &NodeView,
) -> Result<Option<(LeaseName, LeaseAttrs)>, NodeProblem> {
    if node.annotations.get(&names.subnet_manager).map(String::as_str) != Some("true") {
        return Ok(None);
    }
    let name = pod_lease_name(network, node)?;
    let backend_type = annotation(node, &names.backend_type)?.to_owned();
    let public_ip: Ipv4Addr = if network.leases_ipv4() {
        parsed(node, &names.public_ip, "an IPv4 address")?
    } else {
        Ipv4Addr::UNSPECIFIED
    };
    let (public_ipv6, backend_v6_data) = if network.ipv6.is_some() {
        (
            Some(parsed::<Ipv6Addr>(node, &names.public_ipv6, "an IPv6 address")?),
            json_of(node, &names.backend_v6_data)?,
        )
    } else {
        (None, None)
    };
    let attrs = LeaseAttrs {
        public_ip,
        public_ipv6,
        backend_type: Some(backend_type),
        backend_data: if network.leases_ipv4() {
            json_of(node, &names.backend_data)?
        } else {
            None
        },
        backend_v6_data,
        node_id: None,
        incarnation: None,
    };
    Ok(Some((name, attrs)))
}

/// The strategic-merge patch of `nodes/<name>/status` that makes `current` (this node's
/// annotations) announce `attrs`, or `None` when it already does. Returns the patch and the
/// `PublicIP` it announces (an operator's overwrite, where set and valid, else `attrs`').
pub fn own_patch(
    names: &AnnotationNames,
    attrs: &LeaseAttrs,
    current: &BTreeMap<String, String>,
    ipv4: bool,
) -> (Option<Value>, Option<IpAddr>) {
    let mut want: BTreeMap<&str, String> = BTreeMap::new();
    want.insert(&names.subnet_manager, "true".to_owned());
    want.insert(&names.backend_type, attrs.backend_type.clone().unwrap_or_else(|| "udp".into()));
    let mut announced = None;
    if ipv4 {
        let ip =
            overwrite::<Ipv4Addr>(current, &names.public_ip_overwrite).unwrap_or(attrs.public_ip);
        announced = Some(IpAddr::V4(ip));
        want.insert(&names.public_ip, ip.to_string());
        want.insert(&names.backend_data, json_text(attrs.backend_data.as_ref()));
    }
    if let Some(v6) = attrs.public_ipv6 {
        let ip = overwrite::<Ipv6Addr>(current, &names.public_ipv6_overwrite).unwrap_or(v6);
        announced.get_or_insert(IpAddr::V6(ip));
        want.insert(&names.public_ipv6, ip.to_string());
        want.insert(&names.backend_v6_data, json_text(attrs.backend_v6_data.as_ref()));
    }
    let changed: serde_json::Map<String, Value> = want
        .into_iter()
        .filter(|(k, v)| current.get(*k) != Some(v))
        .map(|(k, v)| (k.to_owned(), Value::String(v)))
        .collect();
    if changed.is_empty() {
        (None, announced)
    } else {
        (Some(json!({ "metadata": { "annotations": changed } })), announced)
    }
}

fn overwrite<T: std::str::FromStr>(current: &BTreeMap<String, String>, name: &str) -> Option<T> {
    current.get(name).and_then(|v| v.trim().parse().ok())
}

/// Backend data as flannel writes it: compact JSON, `null` for none.
fn json_text(v: Option<&Value>) -> String {
    v.map_or_else(|| "null".to_owned(), Value::to_string)
}

/// The strategic-merge patch of `nodes/<name>/status` that says this node's network is up,
/// at `now` (RFC 3339, UTC): `NetworkUnavailable` `False`, reason `FlannelIsUp`, as flannel.
pub fn network_up_patch(now_rfc3339: &str) -> Value {
    json!({
        "status": {
            "conditions": [{
                "type": "NetworkUnavailable",
                "status": "False",
                "reason": "FlannelIsUp",
                "message": "weft is running on this node",
                "lastTransitionTime": now_rfc3339,
                "lastHeartbeatTime": now_rfc3339,
            }]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(json: &str) -> NetworkConfig {
        NetworkConfig::parse(json.as_bytes()).unwrap()
    }

    fn v4net() -> NetworkConfig {
        net(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#)
    }

    fn names() -> AnnotationNames {
        AnnotationNames::new(DEFAULT_PREFIX).unwrap()
    }

    fn node(cidrs: &[&str], ann: &[(&str, &str)]) -> NodeView {
        let p = "flannel.alpha.coreos.com/";
        NodeView {
            name: "n1".into(),
            uid: "uid-0001".into(),
            created: 1,
            pod_cidrs: cidrs.iter().map(|s| (*s).to_owned()).collect(),
            annotations: ann.iter().map(|(k, v)| (format!("{p}{k}"), (*v).to_owned())).collect(),
        }
    }

    const VXLAN: &[(&str, &str)] = &[
        ("kube-subnet-manager", "true"),
        ("backend-type", "vxlan"),
        ("backend-data", r#"{"VNI":1,"VtepMAC":"8e:1c:00:00:00:01"}"#),
        ("public-ip", "192.0.2.1"),
    ];

    #[test]
    fn prefixes_are_completed_and_checked_as_flannel_does() {
        assert_eq!(names().backend_type, "flannel.alpha.coreos.com/backend-type");
        let a = AnnotationNames::new("example.com/weft").unwrap();
        assert_eq!(a.public_ip, "example.com/weft-public-ip");
        let b = AnnotationNames::new("example.com/x-").unwrap();
        assert_eq!(b.public_ip, "example.com/x-public-ip");
        assert!(matches!(AnnotationNames::new("a/b/c"), Err(PrefixError::TooManySlashes(_))));
        for bad in ["localhost", "Example.com", "example.com/UP", "", ".com/", "a..b/"] {
            assert!(AnnotationNames::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_flannel_node_is_read_as_its_lease() {
        let (name, attrs) =
            node_lease(&names(), &v4net(), &node(&["10.244.3.0/24"], VXLAN)).unwrap().unwrap();
        assert_eq!(name, LeaseName::single("10.244.3.0/24".parse().unwrap()));
        assert_eq!(attrs.public_ip, Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(attrs.backend_type.as_deref(), Some("vxlan"));
        assert_eq!(attrs.backend_data, Some(json!({"VNI":1,"VtepMAC":"8e:1c:00:00:00:01"})));
    }

    #[test]
    fn a_node_without_the_manager_annotation_is_no_peer_yet() {
        let n = node(&["10.244.3.0/24"], &VXLAN[1..]);
        assert_eq!(node_lease(&names(), &v4net(), &n), Ok(None));
    }

    #[test]
    fn bad_nodes_are_problems_never_panics() {
        type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);
        let cases: Vec<Case> = vec![
            (vec![], VXLAN.to_vec()),
            (vec!["10.244.3.1/24"], VXLAN.to_vec()),
            (vec!["10.245.3.0/24"], VXLAN.to_vec()),
            (vec!["10.244.3.0/25"], VXLAN.to_vec()),
            (vec!["10.244.3.0/24", "10.244.4.0/24"], VXLAN.to_vec()),
            (vec!["a", "b", "c"], VXLAN.to_vec()),
            (vec!["fd00::/64"], VXLAN.to_vec()),
            (
                vec!["10.244.3.0/24"],
                vec![("kube-subnet-manager", "true"), ("public-ip", "192.0.2.1")],
            ),
            (
                vec!["10.244.3.0/24"],
                vec![
                    ("kube-subnet-manager", "true"),
                    ("backend-type", "vxlan"),
                    ("public-ip", "x"),
                ],
            ),
            (
                vec!["10.244.3.0/24"],
                vec![
                    ("kube-subnet-manager", "true"),
                    ("backend-type", "vxlan"),
                    ("public-ip", "192.0.2.1"),
                    ("backend-data", "{"),
                ],
            ),
        ];
        for (cidrs, ann) in cases {
            let r = node_lease(&names(), &v4net(), &node(&cidrs, &ann));
            assert!(r.is_err(), "{cidrs:?} {ann:?} gave {r:?}");
        }
    }

    #[test]
    fn dual_stack_nodes_carry_both_halves() {
        let dual = net(
            r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#,
        );
        let mut ann = VXLAN.to_vec();
        ann.push(("public-ipv6", "2001:db8::1"));
        ann.push(("backend-v6-data", r#"{"VNI":1,"VtepMAC":"8e:1c:00:00:00:02"}"#));
        let n = node(&["10.244.3.0/24", "fd00:10:244:3::/64"], &ann);
        let (name, attrs) = node_lease(&names(), &dual, &n).unwrap().unwrap();
        assert_eq!(name.ipv6, Some("fd00:10:244:3::/64".parse().unwrap()));
        assert_eq!(attrs.public_ipv6, Some("2001:db8::1".parse().unwrap()));
        let v4_only = node(&["10.244.3.0/24"], &ann);
        assert_eq!(node_lease(&names(), &dual, &v4_only), Err(NodeProblem::MissingFamily("IPv6")));
    }

    #[test]
    fn the_own_patch_says_only_what_differs_and_honours_the_overwrite() {
        let n = names();
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 0, 2, 1),
            public_ipv6: None,
            backend_type: Some("vxlan".into()),
            backend_data: Some(json!({"VNI":1,"VtepMAC":"8e:1c:00:00:00:01"})),
            backend_v6_data: None,
            node_id: None,
            incarnation: None,
        };
        let (patch, ip) = own_patch(&n, &attrs, &BTreeMap::new(), true);
        let patch = patch.unwrap();
        let ann = &patch["metadata"]["annotations"];
        assert_eq!(ann[&n.public_ip], "192.0.2.1");
        assert_eq!(ann[&n.subnet_manager], "true");
        assert_eq!(ann[&n.backend_data], r#"{"VNI":1,"VtepMAC":"8e:1c:00:00:00:01"}"#);
        assert_eq!(ip, Some(IpAddr::V4(attrs.public_ip)));
        // Applied, nothing more to say.
        let applied: BTreeMap<String, String> = ann
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
            .collect();
        assert_eq!(own_patch(&n, &attrs, &applied, true).0, None);
        // And what it announces reads back as the lease.
        let me = NodeView {
            pod_cidrs: vec!["10.244.9.0/24".into()],
            annotations: applied.clone(),
            ..NodeView::default()
        };
        let (_, read) = node_lease(&n, &v4net(), &me).unwrap().unwrap();
        assert_eq!(read, attrs);
        // An operator's overwrite is announced instead.
        let mut with = applied;
        with.insert(n.public_ip_overwrite.clone(), "203.0.113.7".into());
        let (patch, ip) = own_patch(&n, &attrs, &with, true);
        assert_eq!(patch.unwrap()["metadata"]["annotations"][&n.public_ip], "203.0.113.7");
        assert_eq!(ip, Some("203.0.113.7".parse().unwrap()));
    }

    #[test]
    fn the_network_up_condition_is_flannels() {
        let p = network_up_patch("2026-12-05T12:00:00Z");
        let c = &p["status"]["conditions"][0];
        assert_eq!(
            (c["type"].as_str(), c["status"].as_str(), c["reason"].as_str()),
            (Some("NetworkUnavailable"), Some("False"), Some("FlannelIsUp"))
        );
    }
}
