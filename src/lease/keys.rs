//! The store's key layout, in one place: which key holds what, and how a key and its value are
//! read back into a lease, a history record or a deleted subnet. Both stores
//! ([`crate::lease::etcd`] and `crate::lease::memory`) build and parse every key here, so the
//! simulation reads the store exactly as production does: the same keys are leases, the same
//! keys are skipped, with the same words.
//!
//! # Layout (flannel-compatible)
//! - `<prefix>/config`: the network config JSON.
//! - `<prefix>/subnets/<a.b.c.d>-<len>`: one lease per subnet ([`LeaseAttrs`] JSON).
//! - `<prefix>/weft/history/<a.b.c.d>-<len>`: weft's allocation history ([`HistoryRecord`]).
//! - `<prefix>/weft/departures/<a.b.c.d>-<len>`: a departure marker ([`HistoryRecord`]), put
//!   by a release or an operator's revoke in the transaction that deletes the subnet key, and
//!   deleted by the next create of that subnet or the prune of its history.
//! - `<prefix>/weft/nodes/<node-id>`: presence of a running process of that node.
//!
//! Nothing of weft's lives under a name that starts with `<prefix>/subnets`: flannel lists that
//! prefix without a trailing slash.
//!
//! # The route watchers' range
//! Route watchers watch one key range ([`KeyLayout::route_watch_range`]): from
//! `<prefix>/subnets/` to just past `<prefix>/weft/departures/`. It holds the subnet keys and the
//! departure markers, and none of the keys a renewal writes (history, presence), so a
//! renewal wakes no watcher. A delete and the marker written with it share a revision, and etcd
//! never splits a revision's events over two watch responses: a watcher tells a clean leave
//! from an expiry (a delete without a marker) from the one batch, without a read.
//!
//! # Contract
//! Pure: no I/O. Parsers take keys and values from the store (untrusted: another tool, an
//! operator or an older weft may have written them) and return a [`BadEntry`] naming the key and
//! the [`KeyError`]; they never panic.

#![forbid(unsafe_code)]

use super::record::{
    HistoryEntry, HistoryRecord, Ipv6Subnet, LeaseAttrs, LeaseName, NodeId, PresenceEntry,
    Revision, StoreLeaseId, StoredLease, Subnet, SubnetError, ValueError,
};

/// The two revisions etcd keeps for a key, as [`KeyLayout::parse_lease`] takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRevisions {
    /// When the key was created (unchanged by later writes until it is deleted).
    pub create_revision: Revision,
    /// When the key was last written.
    pub mod_revision: Revision,
}

/// The directory of subnet leases, relative to the prefix (no trailing slash).
pub(crate) const SUBNETS: &str = "subnets";

/// The directory of weft's history records, relative to the prefix.
pub(crate) const HISTORY: &str = "weft/history";

/// The directory of departure markers, relative to the prefix. It must sort after `subnets/`
/// and before `weft/history/` and `weft/nodes/`: see [`KeyLayout::route_watch_range`].
pub(crate) const DEPARTURES: &str = "weft/departures";

/// The directory of presence keys, relative to the prefix.
pub(crate) const NODES: &str = "weft/nodes";

/// The network config key, relative to the prefix.
pub(crate) const CONFIG: &str = "config";

/// Why a key under the layout, or its value, does not make a lease or a history record.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KeyError {
    /// The key is not under the directory it was read from.
    #[error("not under {dir}")]
    NotUnder {
        /// The directory (`<prefix>/subnets/`, `<prefix>/weft/history/`).
        dir: String,
    },
    /// The key's last element names no subnet.
    #[error("bad key: {0}")]
    Name(#[from] SubnetError),
    /// The value does not parse.
    #[error("bad value: {0}")]
    Value(#[from] ValueError),
}

impl KeyError {
    /// The skipped entry this error makes of `key`.
    pub(crate) fn at(self, key: &str) -> BadEntry {
        BadEntry { key: key.to_owned(), problem: self.to_string() }
    }
}

/// Where weft's keys live under one prefix. Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyLayout {
    prefix: String,
    subnets_dir: String,
    history_dir: String,
    departures_dir: String,
}

impl KeyLayout {
    /// The layout under `prefix` (e.g. `/coreos.com/network`; a trailing `/` is ignored).
    pub fn new(prefix: &str) -> Self {
        let prefix = prefix.trim_end_matches('/').to_owned();
        Self {
            subnets_dir: format!("{prefix}/{SUBNETS}/"),
            history_dir: format!("{prefix}/{HISTORY}/"),
            departures_dir: format!("{prefix}/{DEPARTURES}/"),
            prefix,
        }
    }

    /// The prefix, without a trailing `/`.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `<prefix>/config`.
    pub fn config(&self) -> String {
        format!("{}/{CONFIG}", self.prefix)
    }

    /// `<prefix>/subnets/`: the trailing slash keeps `<prefix>/subnetsX` out of a range.
    pub(crate) fn subnets_dir(&self) -> &str {
        &self.subnets_dir
    }

    /// `<prefix>/weft/history/`.
    pub(crate) fn history_dir(&self) -> &str {
        &self.history_dir
    }

    /// `<prefix>/subnets/<a.b.c.d>-<len>`: an IPv4-only lease's key (or an IPv6-only lease's,
    /// `<prefix>/subnets/0.0.0.0-0&<v6>-<len>`).
    pub fn subnet(&self, subnet: Subnet) -> String {
        self.lease(LeaseName::single(subnet))
    }

    /// `<prefix>/subnets/<a.b.c.d>-<len>[&<v6>-<len>]`: the exact key of a lease.
    pub fn lease(&self, name: LeaseName) -> String {
        format!("{}{}", self.subnets_dir, name.key_name())
    }

    /// The key range `[start, end)` of every dual-stack key of `subnet`
    /// (`<prefix>/subnets/<a.b.c.d>-<len>&…`): a create compares it empty, with the IPv4-only
    /// key, so that no subnet ever has two keys.
    pub(crate) fn dual_stack_range(&self, subnet: Subnet) -> (String, String) {
        let base = self.subnet(subnet);
        // `'` is the byte after `&`: the end is just past every key that starts with `X&`.
        (format!("{base}&"), format!("{base}'"))
    }

    /// A key range `[start, end)` that holds every key of `subnet` in either form (`X` and
    /// `X&…`), and possibly other keys, which [`KeyLayout::is_key_of`] tells apart.
    pub(crate) fn keys_of_range(&self, subnet: Subnet) -> (String, String) {
        let base = self.subnet(subnet);
        let end = format!("{base}'");
        (base, end)
    }

    /// Whether `key` is `subnet`'s key, in either form. The IPv4-only form counts whatever
    /// else is wrong with the entry; a dual-stack form must parse.
    pub(crate) fn is_key_of(&self, key: &str, subnet: Subnet) -> bool {
        key == self.subnet(subnet) || self.name_of(key).is_ok_and(|n| n.subnet == subnet)
    }

    /// `<prefix>/weft/history/<a.b.c.d>-<len>`.
    pub fn history(&self, subnet: Subnet) -> String {
        format!("{}{}", self.history_dir, subnet.key_name())
    }

    /// `<prefix>/weft/departures/<a.b.c.d>-<len>`.
    pub fn departure(&self, subnet: Subnet) -> String {
        format!("{}{}", self.departures_dir, subnet.key_name())
    }

    /// The key range `[start, end)` route watchers watch: every subnet key and every departure
    /// marker, and no history or presence key (see the module docs). Other keys inside it
    /// (another tool's `<prefix>/subnetsX` or `<prefix>/weft/a`) are passed over.
    pub(crate) fn route_watch_range(&self) -> (String, String) {
        // Just past every key that starts with `<prefix>/weft/departures/`.
        let end = format!("{}/{DEPARTURES}0", self.prefix);
        (self.subnets_dir.clone(), end)
    }

    /// `<prefix>/weft/nodes/<node-id>`.
    pub(crate) fn node(&self, node: &NodeId) -> String {
        format!("{}/{NODES}/{}", self.prefix, node.as_str())
    }

    /// `<prefix>/weft/nodes/`.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn nodes_dir(&self) -> String {
        format!("{}/{NODES}/", self.prefix)
    }

    /// The key range `[start, end)` of every history record and every presence key, read in
    /// one range by a listing with presence: `<prefix>/weft/history/` sorts just before
    /// `<prefix>/weft/nodes/`, and nothing of weft's lies between them. Another tool's keys
    /// inside it (`<prefix>/weft/m`) are passed over.
    pub(crate) fn history_and_nodes_range(&self) -> (String, String) {
        // Just past every key that starts with `<prefix>/weft/nodes/`.
        (self.history_dir.clone(), format!("{}/{NODES}0", self.prefix))
    }

    /// A key under `<prefix>/weft/nodes/` read as a presence entry; `None` for any other key,
    /// and for one whose name is no node ID (no weft wrote it: it stands for no process).
    pub(crate) fn parse_presence(
        &self,
        key: &str,
        create_revision: Revision,
    ) -> Option<PresenceEntry> {
        let name = key.strip_prefix(&self.prefix)?.strip_prefix('/')?.strip_prefix(NODES)?;
        let node = NodeId::parse(name.strip_prefix('/')?).ok()?;
        Some(PresenceEntry { node, create_revision })
    }

    /// Whether `key` lies under `<prefix>/subnets/` (a lease, or garbage in its place).
    pub(crate) fn is_subnet_key(&self, key: &str) -> bool {
        key.starts_with(&self.subnets_dir)
    }

    /// What a key under `<prefix>/subnets/` names.
    fn name_of(&self, key: &str) -> Result<LeaseName, KeyError> {
        let name = key
            .strip_prefix(&self.subnets_dir)
            .ok_or_else(|| KeyError::NotUnder { dir: self.subnets_dir.clone() })?;
        Ok(LeaseName::parse(name)?)
    }

    /// A key under `<prefix>/subnets/` and its value, read as a lease.
    pub fn parse_lease(
        &self,
        key: &str,
        value: &[u8],
        revisions: KeyRevisions,
        lease_id: StoreLeaseId,
    ) -> Result<StoredLease, BadEntry> {
        let read = || -> Result<StoredLease, KeyError> {
            let LeaseName { subnet, ipv6 } = self.name_of(key)?;
            let attrs = LeaseAttrs::from_json(value)?;
            let KeyRevisions { create_revision, mod_revision } = revisions;
            Ok(StoredLease { subnet, ipv6, attrs, create_revision, mod_revision, lease_id })
        };
        read().map_err(|e| e.at(key))
    }

    /// A key under `<prefix>/weft/history/` and its value, read as a history record.
    pub fn parse_history(
        &self,
        key: &str,
        value: &[u8],
        mod_revision: Revision,
    ) -> Result<HistoryEntry, BadEntry> {
        let read = || -> Result<HistoryEntry, KeyError> {
            let name = key
                .strip_prefix(&self.history_dir)
                .ok_or_else(|| KeyError::NotUnder { dir: self.history_dir.clone() })?;
            let subnet = Subnet::parse_key_name(name)?;
            let record = HistoryRecord::from_json(value)?;
            Ok(HistoryEntry { subnet, record, mod_revision })
        };
        read().map_err(|e| e.at(key))
    }

    /// A key under `<prefix>/weft/departures/` and its value, read as the record of a release
    /// or revoke; `None` for any other key.
    pub(crate) fn parse_departure(
        &self,
        key: &str,
        value: &[u8],
        mod_revision: Revision,
    ) -> Option<Result<HistoryEntry, BadEntry>> {
        let name = key.strip_prefix(&self.departures_dir)?;
        let read = || -> Result<HistoryEntry, KeyError> {
            let subnet = Subnet::parse_key_name(name)?;
            let record = HistoryRecord::from_json(value)?;
            Ok(HistoryEntry { subnet, record, mod_revision })
        };
        Some(read().map_err(|e| e.at(key)))
    }

    /// Both halves a key under `<prefix>/subnets/` names.
    pub fn parse_deleted_name(&self, key: &str) -> Result<LeaseName, BadEntry> {
        self.name_of(key).map_err(|e| e.at(key))
    }

    /// The subnet of a deleted key under `<prefix>/subnets/` (a delete has no value).
    pub fn parse_deleted(&self, key: &str) -> Result<Subnet, BadEntry> {
        self.name_of(key).map(|n| n.subnet).map_err(|e| e.at(key))
    }
}

/// How a key under `subnets/` is shown without its prefix (`weft lease list`, `/metrics`
/// labels, logs): `subnets/<name>`.
pub fn relative_subnet_key(name: &str) -> String {
    format!("{SUBNETS}/{name}")
}

/// The last element of `key` if its parent directory is `.../subnets` (whatever the prefix):
/// what tells a skipped key under `subnets/` — a live key, occupied whatever its value — from
/// any other skipped key.
pub(crate) fn subnet_key_name(key: &str) -> Option<&str> {
    let (dir, name) = key.rsplit_once('/')?;
    dir.strip_suffix(SUBNETS).is_some_and(|rest| rest.ends_with('/')).then_some(name)
}

/// A key under `<prefix>/subnets` (or its history) that did not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadEntry {
    /// The full key.
    pub key: String,
    /// What was wrong, for logs and `weft lease list`.
    pub problem: String,
}

impl BadEntry {
    /// `Some` if this is a key under `<prefix>/subnets/` — still a live key, whatever its value
    /// — holding the subnet its name parses to, if it does.
    pub fn subnet_key(&self) -> Option<Option<Subnet>> {
        subnet_key_name(&self.key).map(|name| Subnet::parse_key_name(name).ok())
    }

    /// The IPv6 subnet this key names, if it is a subnet key with one (a dual-stack or
    /// IPv6-only key whose value does not parse): still a live key, so that subnet is occupied.
    pub fn ipv6_half(&self) -> Option<Ipv6Subnet> {
        subnet_key_name(&self.key).and_then(|name| LeaseName::parse(name).ok()?.ipv6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sn(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    /// A key created and last written at `rev`.
    fn revs(rev: i64) -> KeyRevisions {
        KeyRevisions { create_revision: Revision(rev), mod_revision: Revision(rev) }
    }

    #[test]
    fn keys_are_flannels_layout_under_the_prefix() {
        let k = KeyLayout::new("/coreos.com/network/");
        assert_eq!(k.prefix(), "/coreos.com/network");
        assert_eq!(k.config(), "/coreos.com/network/config");
        assert_eq!(k.subnets_dir(), "/coreos.com/network/subnets/");
        assert_eq!(k.subnet(sn("10.244.3.0/24")), "/coreos.com/network/subnets/10.244.3.0-24");
        assert_eq!(
            k.history(sn("10.244.3.0/24")),
            "/coreos.com/network/weft/history/10.244.3.0-24"
        );
        let node = NodeId::parse("node-aaaa").unwrap();
        assert_eq!(k.node(&node), "/coreos.com/network/weft/nodes/node-aaaa");
        assert!(k.is_subnet_key("/coreos.com/network/subnets/x"));
        assert!(!k.is_subnet_key("/coreos.com/network/subnetsx"));
    }

    #[test]
    fn leases_history_and_deletes_parse_back_or_name_the_problem() {
        let k = KeyLayout::new("/p");
        let value = br#"{"PublicIP":"192.0.2.1","PublicIPv6":null}"#;
        let revisions = KeyRevisions { create_revision: Revision(4), mod_revision: Revision(7) };
        let lease = k.parse_lease("/p/subnets/10.244.3.0-24", value, revisions, StoreLeaseId(9));
        let lease = lease.unwrap();
        assert_eq!(
            (lease.subnet, lease.create_revision, lease.mod_revision, lease.lease_id),
            (sn("10.244.3.0/24"), Revision(4), Revision(7), StoreLeaseId(9))
        );
        let bad = k.parse_lease("/p/subnets/bogus", value, revs(1), StoreLeaseId(0));
        assert_eq!(bad.as_ref().unwrap_err().key, "/p/subnets/bogus");
        assert!(bad.unwrap_err().problem.starts_with("bad key: "));
        let bad = k.parse_lease("/p/subnets/10.244.3.0-24", b"{", revs(1), StoreLeaseId(0));
        assert!(bad.unwrap_err().problem.starts_with("bad value: "));
        let bad = k.parse_lease("/q/subnets/10.244.3.0-24", value, revs(1), StoreLeaseId(0));
        assert_eq!(bad.unwrap_err().problem, "not under /p/subnets/");

        let record = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1"}"#;
        let h = k.parse_history("/p/weft/history/10.244.3.0-24", record, Revision(3)).unwrap();
        assert_eq!((h.subnet, h.mod_revision), (sn("10.244.3.0/24"), Revision(3)));
        let bad = k.parse_history("/p/weft/history/10.244.3.0-24", b"[]", Revision(3));
        assert!(bad.unwrap_err().problem.starts_with("bad value: "));

        assert_eq!(k.parse_deleted("/p/subnets/10.244.3.0-24"), Ok(sn("10.244.3.0/24")));
        assert!(
            k.parse_deleted("/p/subnets/10.244.3.1-24").unwrap_err().problem.contains("bad key")
        );
    }

    #[test]
    fn a_dual_stack_key_is_the_same_subnets_key_in_its_other_form() {
        let k = KeyLayout::new("/p");
        let value = br#"{"PublicIP":"192.0.2.1","PublicIPv6":"2001:db8::1"}"#;
        let key = "/p/subnets/10.244.3.0-24&fd00:0:0:3::-64";
        let lease = k.parse_lease(key, value, revs(7), StoreLeaseId(9)).unwrap();
        assert_eq!(lease.subnet, sn("10.244.3.0/24"));
        assert_eq!(lease.ipv6, Some("fd00:0:0:3::/64".parse().unwrap()));
        assert_eq!(k.lease(lease.name()), key);
        assert_eq!(k.subnet(lease.subnet), "/p/subnets/10.244.3.0-24");
        assert_eq!(k.parse_deleted(key), Ok(sn("10.244.3.0/24")));
        assert_eq!(k.parse_deleted_name(key).unwrap(), lease.name());
        // Both forms are the subnet's key; nothing else is, even inside the range read for it.
        let s = sn("10.244.3.0/24");
        let (start, end) = k.keys_of_range(s);
        let (dual_start, dual_end) = k.dual_stack_range(s);
        for (candidate, is_key, in_dual) in [
            ("/p/subnets/10.244.3.0-24", true, false),
            (key, true, true),
            ("/p/subnets/10.244.3.0-24&junk", false, true),
            ("/p/subnets/10.244.3.0-24%", false, false),
            ("/p/subnets/10.244.3.0-240", false, false),
            ("/p/subnets/10.244.3.0-2", false, false),
        ] {
            assert_eq!(k.is_key_of(candidate, s), is_key, "{candidate}");
            let in_range = start.as_str() <= candidate && candidate < end.as_str();
            assert!(!is_key || in_range, "{candidate} is outside the range read for its subnet");
            let dual = dual_start.as_str() <= candidate && candidate < dual_end.as_str();
            assert_eq!(dual, in_dual, "{candidate}");
        }
        assert!(!k.is_key_of(key, sn("10.244.4.0/24")));
    }

    #[test]
    fn the_route_watch_range_holds_subnets_and_departures_and_nothing_a_renewal_writes() {
        let k = KeyLayout::new("/coreos.com/network");
        let (start, end) = k.route_watch_range();
        let inside = |key: &str| start.as_str() <= key && key < end.as_str();
        let s = sn("10.244.3.0/24");
        assert!(inside(&k.subnet(s)));
        assert!(inside(&k.departure(s)));
        assert!(inside("/coreos.com/network/subnets/255.255.255.255-32"));
        assert!(inside("/coreos.com/network/weft/departures/zzz"));
        // What renewals and presence beats write: outside, so they wake no watcher.
        assert!(!inside(&k.history(s)));
        assert!(!inside(&k.node(&NodeId::parse("node-aaaa").unwrap())));
        assert!(!inside(&k.config()));
        assert!(!inside("/coreos.com/network/weft/departures0"));
        assert!(!inside("/coreos.com/network/subnets"));

        let record = br#"{"state":"relinquished","node":"node-aaaa","public_ip":"192.0.2.1"}"#;
        let d = k.parse_departure(&k.departure(s), record, Revision(5)).unwrap().unwrap();
        assert_eq!((d.subnet, d.mod_revision), (s, Revision(5)));
        assert!(k.parse_departure(&k.subnet(s), record, Revision(5)).is_none());
        let bad = k.parse_departure(&k.departure(s), b"{", Revision(5)).unwrap();
        assert!(bad.unwrap_err().problem.starts_with("bad value: "));
    }

    #[test]
    fn skipped_keys_under_subnets_are_told_from_others_whatever_the_prefix() {
        assert_eq!(subnet_key_name("/p/subnets/bogus"), Some("bogus"));
        assert_eq!(subnet_key_name("/a/b/subnets/10.0.0.0-24"), Some("10.0.0.0-24"));
        assert_eq!(subnet_key_name("/p/weft/history/10.0.0.0-24"), None);
        assert_eq!(subnet_key_name("/p/xsubnets/10.0.0.0-24"), None);
        assert_eq!(subnet_key_name("/p/subnets/a/b"), None);
        assert_eq!(relative_subnet_key("10.0.0.0-24"), "subnets/10.0.0.0-24");
    }
}
