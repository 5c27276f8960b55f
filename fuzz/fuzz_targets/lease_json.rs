//! Lease store values and keys: LeaseAttrs::from_json (then Peer::from_lease, which reads
//! BackendData and BackendV6Data: vxlan's VtepMAC, wireguard's PublicKey and Port, under an
//! IPv4, a dual-stack and an IPv6-only key), HistoryRecord::from_json,
//! PresenceRecord::from_json and Subnet::parse_key_name, each with
//! its round trip (to_json / key_name parse back to the same value); LeaseName::parse (both
//! halves of a dual-stack key) and Ipv6Subnet's parsers likewise; KeyLayout's parsers, which
//! both stores read keys with, agree with them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::ethernet::MacAddr;
use weft::lease::keys::{KeyLayout, KeyRevisions};
use weft::lease::record::{
    HistoryRecord, Ipv6Subnet, LeaseAttrs, LeaseName, Revision, StoreLeaseId, StoredLease, Subnet,
};
use weft::lease::store::{BadEntry, PresenceRecord};
use weft::route::{Peer, Peer6, PeerBackend};

fuzz_target!(|data: &[u8]| {
    if let Ok(attrs) = LeaseAttrs::from_json(data) {
        let mut again = LeaseAttrs::from_json(&attrs.to_json()).expect("to_json parses back");
        // serde_json (without its float_roundtrip feature) may read a float written back one
        // ulp off; weft only ever writes its own integer BackendData, so that is not compared.
        // The same for the IPv6 half's BackendV6Data.
        if attrs.backend_data.as_ref().is_some_and(has_float) {
            again.backend_data.clone_from(&attrs.backend_data);
        }
        if attrs.backend_v6_data.as_ref().is_some_and(has_float) {
            again.backend_v6_data.clone_from(&attrs.backend_v6_data);
        }
        assert_eq!(again, attrs, "LeaseAttrs round trip");
        let subnet = Subnet::from_parts([10, 244, 1, 0].into(), 24).unwrap();
        let lease = StoredLease {
            subnet,
            ipv6: None,
            attrs,
            create_revision: Revision(1),
            mod_revision: Revision(1),
            lease_id: StoreLeaseId(0),
        };
        if let Ok(peer) = Peer::from_lease(&lease) {
            let ip = peer.public_ip;
            assert!(!ip.is_unspecified() && !ip.is_broadcast() && !ip.is_multicast());
            assert!(peer.vni.is_none_or(|v| v <= 0xff_ffff));
            assert!(peer.ipv6.is_none(), "an IPv6 route without an IPv6 half in the key");
        }
        // The same value under a dual-stack key: the IPv6 half routes or says why, and never
        // changes the IPv4 route.
        let dual =
            StoredLease { ipv6: Some("fd00:10:244:1::/64".parse().unwrap()), ..lease.clone() };
        let v6 = Peer6::from_lease(&dual);
        match (Peer::from_lease(&lease), Peer::from_lease(&dual)) {
            (Ok(v4), Ok(both)) => {
                assert_eq!(both.ipv6, v6.ok().flatten());
                assert_eq!(Peer { ipv6: None, ..both }, v4);
            }
            (Err(a), Err(b)) => assert_eq!(a, b),
            (a, b) => panic!("the IPv6 half changed the IPv4 verdict: {a:?} / {b:?}"),
        }
        if let Ok(Some(p6)) = v6 {
            assert!(!p6.public_ip.is_unspecified() && !p6.public_ip.is_multicast());
            // A wireguard half (BackendV6Data {"PublicKey","Port"}) has its key and no MAC;
            // a vxlan half the other way round.
            let wireguard = dual.attrs.backend_type.as_deref() == Some("wireguard");
            assert_eq!(p6.wireguard.is_some(), wireguard);
            assert!(!wireguard || p6.vtep_mac == MacAddr([0; 6]));
            assert!(p6.wireguard.is_none_or(|w| w.port != Some(0)), "port 0 means ours");
        }
        // The same value under an IPv6-only key (`0.0.0.0-0&…`): routed by its IPv6 half alone,
        // whose backend (a wireguard half's key and port) it takes.
        let half: Ipv6Subnet = "fd00:10:244:1::/64".parse().unwrap();
        let only = StoredLease { subnet: Subnet::from(half), ipv6: Some(half), ..lease };
        if let Ok(peer) = Peer::from_lease(&only) {
            let p6 = peer.ipv6.expect("an IPv6-only route has its half");
            assert_eq!(Peer6::from_lease(&only), Ok(Some(p6)));
            match p6.wireguard {
                Some(w) => {
                    assert_eq!(peer.backend, PeerBackend::Wireguard { key: w.key, port: w.port })
                }
                None => assert_eq!(peer.backend, PeerBackend::Vxlan),
            }
        }
    }
    if let Ok(record) = HistoryRecord::from_json(data) {
        let again = HistoryRecord::from_json(&record.to_json()).expect("to_json parses back");
        assert_eq!(again, record, "HistoryRecord round trip");
    }
    if let Ok(presence) = PresenceRecord::from_json(data) {
        let again = PresenceRecord::from_json(&presence.to_json()).expect("to_json parses back");
        assert_eq!(again, presence, "PresenceRecord round trip");
        let shown = presence.public_addr();
        assert!(
            shown.is_ipv6()
                == (presence.public_ip.is_unspecified() && presence.public_ipv6.is_some())
        );
    }
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Some(mac) = MacAddr::parse(text) {
        assert_eq!(MacAddr::parse(&mac.to_string()), Some(mac), "MAC round trip");
    }
    match Subnet::parse_key_name(text) {
        Ok(s) => {
            assert_eq!(Subnet::parse_key_name(&s.key_name()), Ok(s), "key name round trip");
            assert_eq!(s.to_string().parse::<Subnet>(), Ok(s), "display round trip");
            assert_eq!(s.net().network(), s.network());
            let _ = s.first_host();
        }
        Err(_) => {}
    }
    let _ = text.parse::<Subnet>();
    match LeaseName::parse(text) {
        Ok(n) => {
            assert_eq!(Subnet::parse_key_name(text), Ok(n.subnet), "the subnet agrees");
            assert_eq!(LeaseName::parse(&n.key_name()), Ok(n), "lease name round trip");
            assert_eq!(n.ipv6.is_some(), text.contains('&'));
            // An IPv6-only name is exactly flannel's `0.0.0.0-0&…` form, and its half is its
            // subnet; no other name has an IPv6 subnet.
            assert_eq!(n.subnet.v4().is_none(), text.starts_with("0.0.0.0-0&"), "{text}");
            if let Some(v6) = n.subnet.v6() {
                assert_eq!(n.ipv6, Some(v6), "{text}");
                assert_eq!(LeaseName::single(n.subnet), n, "{text}");
            }
            if let Some(half) = n.ipv6 {
                assert_eq!(half.to_string().parse::<Ipv6Subnet>(), Ok(half));
                assert_eq!(half.key_name().parse::<Ipv6Subnet>(), Ok(half));
                assert_eq!(half.net().network(), half.network());
                let _ = half.first_host();
            }
        }
        Err(e) => assert_eq!(Subnet::parse_key_name(text), Err(e), "the same verdict"),
    }
    let _ = text.parse::<Ipv6Subnet>();
    let bad =
        BadEntry { key: format!("/coreos.com/network/subnets/{text}"), problem: String::new() };
    let _ = bad.subnet_key();
    if let Some(half) = bad.ipv6_half() {
        assert!(LeaseName::parse(text).is_ok(), "{text}");
        let (_, v6) = text.split_once('&').expect("a half comes after '&'");
        assert_eq!(v6.parse::<Ipv6Subnet>(), Ok(half), "{text}");
    }
    // The stores' key parsers: a key under subnets/ (or history/) reads as a lease (a record)
    // exactly when its name and the value parse, and a subnet's own key reads back to it.
    let keys = KeyLayout::new("/coreos.com/network/");
    let name = Subnet::parse_key_name(text);
    let revisions = KeyRevisions { create_revision: Revision(2), mod_revision: Revision(3) };
    let lease = keys.parse_lease(&bad.key, data, revisions, StoreLeaseId(5));
    assert_eq!(lease.is_ok(), name.is_ok() && LeaseAttrs::from_json(data).is_ok());
    if let Err(e) = &lease {
        assert_eq!(e.key, bad.key);
        assert!(!e.problem.is_empty());
    }
    let history_key = format!("/coreos.com/network/weft/history/{text}");
    let record = keys.parse_history(&history_key, data, Revision(3));
    assert_eq!(record.is_ok(), name.is_ok() && HistoryRecord::from_json(data).is_ok());
    assert_eq!(keys.parse_deleted(&bad.key).ok(), name.ok());
    if let Ok(n) = LeaseName::parse(text) {
        assert_eq!(keys.parse_deleted_name(&keys.lease(n)).ok(), Some(n), "lease key round trip");
        if let Ok(l) = &lease {
            assert_eq!(l.name(), n, "a lease reads back with both halves");
        }
    }
    if let Ok(s) = name {
        assert_eq!(keys.parse_deleted(&keys.subnet(s)), Ok(s), "subnet key round trip");
        assert!(keys.parse_deleted(&keys.history(s)).is_err(), "a history key is no lease");
    }
});

fn has_float(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => n.is_f64(),
        serde_json::Value::Array(a) => a.iter().any(has_float),
        serde_json::Value::Object(o) => o.values().any(has_float),
        _ => false,
    }
}
