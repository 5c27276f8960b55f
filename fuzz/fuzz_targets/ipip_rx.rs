//! The ipip receive path: `Forwarder::decap` of the ipip backend over arbitrary datagrams as a
//! raw IPv4 socket of protocol 4 delivers them (the outer header included), from an arbitrary
//! route table; and the codec (`wire::ipip`) on its own.
//!
//! Invariants: nothing panics; a Deliver lies inside the datagram after a valid outer header of
//! protocol 4, is an IPv4 packet of exactly its total length, from a source whose route names
//! the outer source as its `PublicIP`, to our subnet, with no checksum trusted (nothing covers
//! the inner packet on the way); decap writes nothing but the inner header's ECN bits and
//! checksum; an outer header `emit_outer` writes parses back to the same packet.
#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::config::BackendKind;
use weft::dataplane::transport::{Forwarder, IcmpLimit, Ipv6Forwarding, OwnSubnet, Rx};
use weft::dataplane::wire::{ethernet, ipip, ipv4, vxlan};
use weft_fuzz::{AnyPacket, ArbNetwork, ArbPeer};

#[derive(Arbitrary, Debug)]
struct Input {
    network: ArbNetwork,
    peers: Vec<ArbPeer>,
    own: Option<u32>,
    /// Datagrams: (outer source host part of 192.0.2.x, wrap it in a valid outer header with
    /// this TOS, the inner bytes).
    rx: Vec<(u8, Option<u8>, AnyPacket)>,
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let net = input.network;
    let peers: Vec<_> = input.peers.iter().take(64).cloned().collect();
    let table = net.table(&peers);
    let own = Arc::new(OwnSubnet::default());
    own.set(input.own.map(|i| net.subnet(i, net.subnet_len())));
    let fwd = Forwarder {
        backend: BackendKind::Ipip,
        vni: vxlan::Vni::new(1).unwrap(),
        port: 0,
        our_mac: ethernet::MacAddr([2; 6]),
        own: own.clone(),
        icmp_source: net.net().network(),
        icmp_limit: Arc::new(IcmpLimit::new(1000, 3)),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Ipv6Forwarding::default(),
    };
    for (sender, wrap, p) in input.rx.iter().take(16) {
        let inner = p.bytes(2000);
        let src = Ipv4Addr::new(192, 0, 2, *sender);
        let mut buf = match wrap {
            Some(tos) => {
                let mut b = vec![0u8; ipip::OVERHEAD];
                b.extend_from_slice(&inner);
                let (head, rest) = b.split_at_mut(ipip::OVERHEAD);
                if ipip::emit_outer(head, rest, src, Ipv4Addr::new(192, 0, 2, 1)).is_ok() {
                    b[1] = *tos;
                    ipv4::Packet::new_unchecked(&mut b[..ipip::OVERHEAD]).fill_checksum();
                    let o = ipip::parse_outer(&b).expect("an emitted outer header parses");
                    assert_eq!(&b[o.inner.clone()], &rest_of(&inner), "the inner packet");
                    assert_eq!(o.src, src);
                }
                b
            }
            None => inner.clone(),
        };
        let len = buf.len();
        buf.extend_from_slice(&[0xee; 3]);
        let original = buf.clone();
        let from = SocketAddrV4::new(src, 0).into();
        match fwd.decap(&table, from, &mut buf, len) {
            Rx::Deliver { range, checksums_trusted } => {
                assert!(!checksums_trusted, "nothing covers an IP-in-IP packet's checksums");
                let outer =
                    ipip::parse_outer(&original[..len]).expect("delivered past a bad outer");
                assert!(range.start == outer.inner.start && range.end <= outer.inner.end);
                let ip = ipv4::Packet::new_checked(&buf[range.clone()]).expect("delivered checks");
                assert_eq!(usize::from(ip.total_len()), range.len());
                assert!(own.contains(ip.dst_addr()), "delivered a packet not for us");
                let route = table.lookup(ip.src_addr()).expect("delivered from an unrouted source");
                assert_eq!(route.public_ip, outer.src, "delivered a spoofed source");
                // Only the ECN bits and the header checksum may change.
                let mut want = original.clone();
                want[range.start + 1] = buf[range.start + 1];
                want[range.start + 10..range.start + 12]
                    .copy_from_slice(&buf[range.start + 10..range.start + 12]);
                assert_eq!(buf, want, "decap wrote more than ECN");
                assert_eq!(buf[range.start + 1] & !3, original[range.start + 1] & !3);
            }
            Rx::Drop(_) => assert_eq!(buf, original, "a dropped datagram was changed"),
        }
        let n = buf.len() + 1;
        assert!(matches!(fwd.decap(&table, from, &mut buf, n), Rx::Drop(_)));
    }
});

/// The IPv4 packet `p` up to its total length (what the outer header carries).
fn rest_of(p: &[u8]) -> Vec<u8> {
    match ipv4::Packet::new_checked(p) {
        Ok(ip) => p[..usize::from(ip.total_len())].to_vec(),
        Err(_) => p.to_vec(),
    }
}
