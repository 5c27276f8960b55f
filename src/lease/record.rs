//! Lease records as they sit in the store: flannel's `LeaseAttrs` value, revisions, node
//! identity and weft's allocation history. The subnets and lease names they are keyed by are
//! vocabulary of the whole crate ([`crate::vocab`]), re-exported here.
//!
//! Contract: everything here is pure parsing and formatting. Parsers take bytes from the store
//! (untrusted: another tool, an operator or an older weft may have written them) and return a
//! typed error naming the problem; they never panic.

#![forbid(unsafe_code)]

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

pub use crate::vocab::{ForeignSubnet, Ipv6Subnet, LeaseName, Subnet, SubnetError};

/// An etcd revision: the cluster's own logical clock. weft orders events by revisions, never by
/// hosts' wall clocks, which skew.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Revision(pub i64);

/// An etcd lease ID (the TTL handle a key is attached to). `0` means "no lease": a key that
/// never expires, which flannel calls a reservation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StoreLeaseId(pub i64);

/// A node's persistent identity, generated once and kept in `--state-dir`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct NodeId(String);

/// One process start of a node: random per start, written into the lease value so that a write by
/// this node's identity but not by this process is visible (a clone, or a second daemon).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Incarnation(String);

/// Why a node ID or incarnation text was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected 8 to 64 characters of [0-9a-z-]")]
pub struct IdError;

fn check_id(s: &str) -> Result<(), IdError> {
    let ok = (8..=64).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-');
    if ok { Ok(()) } else { Err(IdError) }
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl NodeId {
    /// A fresh random node ID (128 bits, hex).
    pub fn generate() -> Self {
        Self(random_hex(16))
    }

    /// A node ID from text (the state dir file, or a test's chosen name).
    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_id(s)?;
        Ok(Self(s.to_owned()))
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Incarnation {
    /// A fresh random incarnation (64 bits, hex).
    pub fn generate() -> Self {
        Self(random_hex(8))
    }

    /// An incarnation from text.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_id(s)?;
        Ok(Self(s.to_owned()))
    }

    /// The incarnation as text.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for NodeId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        check_id(&s)?;
        Ok(Self(s))
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> Self {
        id.0
    }
}

impl TryFrom<String> for Incarnation {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        check_id(&s)?;
        Ok(Self(s))
    }
}

impl From<Incarnation> for String {
    fn from(id: Incarnation) -> Self {
        id.0
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// flannel's `LeaseAttrs`: the JSON value of a subnet key.
///
/// Field names and shapes are flannel's, so flannel reads weft's leases and weft reads flannel's.
/// weft adds `WeftNodeID` and `WeftIncarnation` (flannel ignores unknown fields). A lease
/// without them was written by flannel or by hand and belongs to no weft node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseAttrs {
    /// The holder's underlay address; flannel always writes it.
    #[serde(rename = "PublicIP")]
    pub public_ip: Ipv4Addr,
    /// flannel writes `null` on IPv4-only nodes (no omitempty), so weft does too.
    #[serde(rename = "PublicIPv6", default)]
    pub public_ipv6: Option<Ipv6Addr>,
    /// `vxlan`; absent for flannel's udp backend.
    #[serde(rename = "BackendType", default, skip_serializing_if = "Option::is_none")]
    pub backend_type: Option<String>,
    /// Backend data, e.g. `{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}` for vxlan.
    #[serde(rename = "BackendData", default, skip_serializing_if = "Option::is_none")]
    pub backend_data: Option<serde_json::Value>,
    /// IPv6 backend data, on a dual-stack vxlan lease: `{"VNI":1,"VtepMAC":"…"}`, the MAC of
    /// the holder's IPv6 VTEP (flannel's `flannel-v6.<VNI>` device has its own).
    #[serde(rename = "BackendV6Data", default, skip_serializing_if = "Option::is_none")]
    pub backend_v6_data: Option<serde_json::Value>,
    /// The holder's node identity (weft only).
    #[serde(rename = "WeftNodeID", default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// The holder's process incarnation (weft only).
    #[serde(rename = "WeftIncarnation", default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<Incarnation>,
}

/// Why a stored value did not parse.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    /// Not JSON, or JSON of the wrong shape.
    #[error("value is not valid JSON for this key: {0}")]
    Json(#[from] serde_json::Error),
}

impl LeaseAttrs {
    /// Parses a subnet key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ValueError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The JSON written to the store.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing a struct of plain fields and a `Value` cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The holder's address for people to read (logs, hooks): [`shown_addr`].
    pub fn public_addr(&self) -> IpAddr {
        shown_addr(self.public_ip, self.public_ipv6)
    }

    /// Whether this value was written by `node` (any incarnation).
    pub(crate) fn is_node(&self, node: &NodeId) -> bool {
        self.node_id.as_ref() == Some(node)
    }

    /// Whether this value was written by exactly this process.
    pub(crate) fn is_incarnation(&self, node: &NodeId, incarnation: &Incarnation) -> bool {
        self.is_node(node) && self.incarnation.as_ref() == Some(incarnation)
    }
}

/// A node's address for people to read (logs, hooks, errors): its `PublicIP`, or on an
/// IPv6-only network, where `PublicIP` is `0.0.0.0`, its `PublicIPv6`.
pub(crate) fn shown_addr(public_ip: Ipv4Addr, public_ipv6: Option<Ipv6Addr>) -> IpAddr {
    match public_ipv6 {
        Some(v6) if public_ip.is_unspecified() => IpAddr::V6(v6),
        _ => IpAddr::V4(public_ip),
    }
}

/// A subnet key as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredLease {
    /// The subnet named by the key.
    pub subnet: Subnet,
    /// The key's IPv6 half, on a dual-stack lease.
    pub ipv6: Option<Ipv6Subnet>,
    /// The parsed value.
    pub attrs: LeaseAttrs,
    /// The key's create revision: when this key was created. Unlike the mod revision, no
    /// renewal or rewrite of the key moves it, so it orders keys by who came first (route
    /// watchers give a contested IPv6 half to the first, `route::set`).
    pub create_revision: Revision,
    /// The key's mod revision: renew and adopt compare on it.
    pub mod_revision: Revision,
    /// The etcd lease the key is attached to (`0`: none, a reservation).
    pub lease_id: StoreLeaseId,
}

impl StoredLease {
    /// The key's full name: both halves.
    pub fn name(&self) -> LeaseName {
        LeaseName { subnet: self.subnet, ipv6: self.ipv6 }
    }
}

/// What weft's allocation history says about one subnet (`<prefix>/weft/history/<key>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HistoryState {
    /// Last written by a holder's create or renew; if the subnet key is gone now, the lease
    /// expired (or was revoked) after `HistoryEntry::mod_revision`.
    Held,
    /// Released by a clean shutdown with `--relinquish-on-exit`.
    Relinquished,
    /// Deleted by an operator (`weft lease revoke`): peers unroute it; the allocation policy
    /// treats it like an expired subnet, and a holder that still runs reclaims it.
    Revoked,
}

/// The JSON value of a history key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryRecord {
    /// Held or relinquished.
    pub state: HistoryState,
    /// The node that last held the subnet.
    pub node: NodeId,
    /// That node's public IP at the time.
    pub public_ip: Ipv4Addr,
    /// The IPv6 half the subnet was leased with, on a dual-stack network: whoever takes the
    /// subnet next takes it with this half, so the halves move together. Absent from records
    /// of IPv4-only leases (and from every record an older weft wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Subnet>,
}

impl HistoryRecord {
    /// The record a create, renew or refresh writes for `attrs`: `Held` by its node. `None`
    /// for a lease without a node identity (a test's or a tool's): it has no history.
    pub(crate) fn held(attrs: &LeaseAttrs, ipv6: Option<Ipv6Subnet>) -> Option<Self> {
        let node = attrs.node_id.clone()?;
        Some(Self { state: HistoryState::Held, node, public_ip: attrs.public_ip, ipv6 })
    }

    /// Parses a history key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ValueError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The JSON written to the store.
    pub fn to_json(&self) -> Vec<u8> {
        // Plain fields only: cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A history key as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// The subnet the history is about.
    pub subnet: Subnet,
    /// The parsed record.
    pub record: HistoryRecord,
    /// When it was last written, in the cluster's logical time: the lower the older.
    pub mod_revision: Revision,
}

/// A presence key in a listing: a running process of `node` (`PresenceRecord`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresenceEntry {
    /// The node whose process it is.
    pub node: NodeId,
    /// When the key was created: the order in which the running processes came (a beat
    /// rewrites the key but keeps this).
    pub create_revision: Revision,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_records_carry_the_ipv6_half_and_older_ones_still_read() {
        let half: Ipv6Subnet = "fd00:10:244:1::/64".parse().unwrap();
        // History records carry the half, and records without one (older wefts) still read.
        let json = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1","ipv6":"fd00:10:244:1::/64"}"#;
        assert_eq!(HistoryRecord::from_json(json).unwrap().ipv6, Some(half));
        let old = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1"}"#;
        let old = HistoryRecord::from_json(old).unwrap();
        assert_eq!(old.ipv6, None);
        assert!(!String::from_utf8(old.to_json()).unwrap().contains("ipv6"));
        let bad =
            br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1","ipv6":"fd00::1/64"}"#;
        assert!(HistoryRecord::from_json(bad).is_err());
    }

    #[test]
    fn lease_attrs_read_flannel_values() {
        let v = br#"{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#;
        let a = LeaseAttrs::from_json(v).unwrap();
        assert_eq!(a.public_ip, Ipv4Addr::new(192, 168, 64, 3));
        assert_eq!(a.backend_type.as_deref(), Some("vxlan"));
        assert!(a.node_id.is_none());
        // flannel's udp backend writes no BackendType.
        let u = LeaseAttrs::from_json(br#"{"PublicIP":"192.0.2.1","PublicIPv6":null}"#).unwrap();
        assert!(u.backend_type.is_none());
        assert!(LeaseAttrs::from_json(b"not json").is_err());
        assert!(LeaseAttrs::from_json(br#"{"PublicIP":"nope"}"#).is_err());
        // A weft field that is not a valid ID makes the value unreadable, never trusted.
        assert!(
            LeaseAttrs::from_json(br#"{"PublicIP":"192.0.2.1","WeftNodeID":"BAD ID"}"#).is_err()
        );
    }

    #[test]
    fn lease_attrs_write_flannel_shape() {
        let a = LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 0, 2, 1),
            public_ipv6: None,
            backend_type: Some("vxlan".into()),
            backend_data: Some(serde_json::json!({"VNI":1,"VtepMAC":"02:00:00:00:00:01"})),
            backend_v6_data: None,
            node_id: Some(NodeId::parse("node-aaaa").unwrap()),
            incarnation: Some(Incarnation::parse("inc-0001").unwrap()),
        };
        let text = String::from_utf8(a.to_json()).unwrap();
        assert!(
            text.starts_with(r#"{"PublicIP":"192.0.2.1","PublicIPv6":null,"BackendType":"vxlan""#)
        );
        assert_eq!(LeaseAttrs::from_json(text.as_bytes()).unwrap(), a);
    }
}
