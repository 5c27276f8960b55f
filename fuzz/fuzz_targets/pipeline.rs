//! The forwarder's encap (Forwarder::encap) and decap (Forwarder::decap) over an arbitrary route
//! table built with RouteTable::build, an arbitrary own subnet, backend and VNI.
//!
//! Invariants: a Send's range lies in the buffer and starts with the backend's encapsulation
//! (VXLAN header with our VNI and an inner Ethernet header to the peer's VTEP MAC) in front of
//! the untouched packet, and goes to the peer the table names for the destination; a Reply is a
//! valid ICMP error inside the reply buffer; a Deliver is an IPv4 packet inside the datagram of
//! exactly its total length, from a source routed to the sender, to our subnet. With an own
//! IPv6 subnet (`own6`), IPv6 packets go the IPv6 way (peers may have IPv6 halves): a Send goes
//! in VXLAN with EtherType IPv6 to the `PublicIPv6` and VTEP MAC of the half `lookup6` names, a
//! Reply is a valid ICMPv6 error, and a datagram from an IPv6 sender is delivered only as an
//! IPv6 packet of exactly its length, from a source in that sender's half, to our IPv6 subnet.
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::config::BackendKind;
use weft::dataplane::transport::{
    Forwarder, HEADROOM, IcmpLimit, Ipv6Forwarding, OwnSubnet, OwnSubnet6, Rx, Tx,
};
use weft::dataplane::wire::{ethernet, icmpv6, ipv4, ipv6, vxlan};
use weft::time::Instant;
use weft_fuzz::{AnyPacket, ArbNetwork, ArbPeer};

#[derive(Arbitrary, Debug)]
struct Input {
    network: ArbNetwork,
    peers: Vec<ArbPeer>,
    own: Option<u32>,
    /// An own IPv6 subnet: fd00:10:244:<n>::/64.
    own6: Option<u16>,
    udp_backend: bool,
    vni: u32,
    our_mac: [u8; 6],
    now_ms: u32,
    reply_len: u16,
    extra: u8,
    /// Packets read from TUN.
    tx: Vec<AnyPacket>,
    /// Datagrams from the underlay: (sender host part of 192.0.2.x or 2001:db8::x with the
    /// bool after it, VXLAN-wrap it, bytes).
    rx: Vec<(u8, bool, bool, AnyPacket)>,
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let net = input.network;
    let peers: Vec<_> = input.peers.iter().take(64).cloned().collect();
    let table = net.table(&peers);
    let own = Arc::new(OwnSubnet::default());
    own.set(input.own.map(|i| net.subnet(i, net.subnet_len())));
    let fwd = Forwarder {
        backend: if input.udp_backend { BackendKind::Udp } else { BackendKind::Vxlan },
        vni: vxlan::Vni::new(input.vni % (vxlan::Vni::MAX + 1)).unwrap(),
        port: 8472,
        our_mac: ethernet::MacAddr(input.our_mac),
        own: own.clone(),
        icmp_source: net.net().network(),
        icmp_limit: Arc::new(IcmpLimit::new(1000, 3)),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Ipv6Forwarding {
            own: {
                let own6 = Arc::new(OwnSubnet6::default());
                own6.set(input.own6.map(|n| format!("fd00:10:244:{n:x}::/64").parse().unwrap()));
                own6
            },
            icmp_source: "fd00:10:244::".parse().unwrap(),
        },
    };
    let now = Instant::from_epoch(Duration::from_millis(u64::from(input.now_ms)));
    let mut reply = vec![0u8; usize::from(input.reply_len % 1600)];

    for p in input.tx.iter().take(16) {
        let packet = p.bytes(2000);
        let mut buf = vec![0xeeu8; HEADROOM + packet.len() + usize::from(input.extra % 4)];
        buf[HEADROOM..HEADROOM + packet.len()].copy_from_slice(&packet);
        // Also a length that does not fit the buffer.
        let len = if input.extra >= 250 { buf.len() } else { packet.len() };
        match fwd.encap(&table, &mut buf, len, &mut reply, now) {
            Tx::Send { peer, range, flow } if packet.first().is_some_and(|b| b >> 4 == 6) => {
                assert!(range.end <= buf.len() && range.end == HEADROOM + len);
                assert_eq!(&buf[HEADROOM..range.end], &packet[..], "encap changed the packet");
                assert_eq!(fwd.backend, BackendKind::Vxlan, "IPv6 sent over the udp backend");
                let ip = ipv6::Packet::new_checked(&packet[..]).expect("sent IPv6 packets check");
                let dst = ip.dst_addr();
                let own6 = &fwd.ipv6.own;
                assert!(own6.is_set() && !own6.contains(dst), "sent within our own IPv6 subnet");
                let (_, half) = table.lookup6(dst).expect("sent IPv6 without a route");
                assert_eq!(peer, SocketAddrV6::new(half.public_ip, fwd.port, 0, 0).into());
                assert_eq!(flow, weft::dataplane::wire::flow_hash(&packet));
                let vx = vxlan::Packet::new_checked(&buf[range.clone()]).unwrap();
                assert_eq!(vxlan::Repr::parse(&vx).map(|r| r.vni), Ok(fwd.vni));
                let eth = ethernet::Frame::new_checked(vx.payload()).unwrap();
                assert_eq!(eth.dst_addr(), half.vtep_mac);
                assert_eq!(eth.ethertype(), ethernet::EtherType::IPV6);
            }
            Tx::Send { peer, range, flow } => {
                assert!(range.end <= buf.len() && range.end == HEADROOM + len);
                assert_eq!(range.start, HEADROOM - fwd.headroom());
                assert_eq!(&buf[HEADROOM..range.end], &packet[..], "encap changed the packet");
                let ip = ipv4::Packet::new_checked(&packet[..]).expect("sent packets check");
                let dst = ip.dst_addr();
                assert!(own.is_set() && !own.contains(dst), "sent within our own subnet");
                let route = table.lookup(dst).expect("sent without a route");
                assert_eq!(peer, SocketAddrV4::new(route.public_ip, fwd.port).into());
                assert_eq!(flow, weft::dataplane::wire::flow_hash(&packet));
                if fwd.backend == BackendKind::Vxlan {
                    let vx = vxlan::Packet::new_checked(&buf[range.clone()]).unwrap();
                    assert_eq!(vxlan::Repr::parse(&vx).map(|r| r.vni), Ok(fwd.vni));
                    let eth = ethernet::Frame::new_checked(vx.payload()).unwrap();
                    assert_eq!(Some(eth.dst_addr()), route.vtep_mac);
                    assert_eq!(eth.src_addr(), fwd.our_mac);
                    assert_eq!(eth.ethertype(), ethernet::EtherType::IPV4);
                }
            }
            Tx::Reply { len, .. } if packet.first().is_some_and(|b| b >> 4 == 6) => {
                assert!(len <= reply.len() && len <= icmpv6::MIN_MTU);
                assert!(input.own6.is_some(), "an ICMPv6 error without an IPv6 subnet");
                let r = ipv6::Packet::new_checked(&reply[..len]).expect("ICMPv6 reply checks");
                assert_eq!(r.next_header(), icmpv6::NEXT_HEADER);
            }
            Tx::Reply { len, .. } => {
                assert!(len <= reply.len());
                let r = ipv4::Packet::new_checked(&reply[..len]).expect("reply checks");
                assert!(ipv4::Repr::parse(&r).is_ok(), "reply does not parse");
            }
            Tx::Drop(_) | Tx::Suppressed(_) => {}
        }
    }

    for (sender, from_v6, wrap, p) in input.rx.iter().take(16) {
        let inner = p.bytes(2000);
        let mut buf = Vec::new();
        if *wrap {
            buf.resize(HEADROOM, 0);
            let _ = vxlan::Repr { vni: fwd.vni }.emit(&mut buf);
            let _ = ethernet::Repr {
                src_addr: ethernet::MacAddr([2; 6]),
                dst_addr: fwd.our_mac,
                ethertype: if inner.first().is_some_and(|b| b >> 4 == 6) {
                    ethernet::EtherType::IPV6
                } else {
                    ethernet::EtherType::IPV4
                },
            }
            .emit(&mut buf[vxlan::HEADER_LEN..]);
        }
        buf.extend_from_slice(&inner);
        let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, *sender), 8472);
        let len = buf.len();
        if *from_v6 {
            let ip6 = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(*sender));
            let from6 = SocketAddr::V6(SocketAddrV6::new(ip6, 8472, 0, 0));
            if let Rx::Deliver { range, .. } = fwd.decap(&table, from6, &mut buf, len) {
                assert!(range.end <= len, "delivered past the datagram");
                let ip = ipv6::Packet::new_checked(&buf[range.clone()]).expect("delivered checks");
                assert_eq!(usize::from(ip.payload_len()) + ipv6::HEADER_LEN, range.len());
                assert!(fwd.ipv6.own.contains(ip.dst_addr()), "delivered IPv6 not for us");
                let (_, half) = table.lookup6(ip.src_addr()).expect("from an unrouted source");
                assert_eq!(half.public_ip, ip6, "delivered a spoofed IPv6 source");
            }
            continue;
        }
        buf.extend_from_slice(&[0xee; 3]);
        let original = buf.clone();
        match fwd.decap(&table, from.into(), &mut buf, len) {
            Rx::Deliver { range, checksums_trusted } => {
                assert!(range.end <= len, "delivered past the datagram");
                let ip = ipv4::Packet::new_checked(&buf[range.clone()]).expect("delivered checks");
                assert_eq!(usize::from(ip.total_len()), range.len());
                assert!(own.contains(ip.dst_addr()), "delivered a packet not for us");
                let route = table.lookup(ip.src_addr()).expect("delivered from an unrouted source");
                assert_eq!(route.public_ip, *from.ip(), "delivered a spoofed source");
                // Trust in the checksums is the sender's: only a weft peer's are taken as is.
                assert_eq!(checksums_trusted, route.node.is_some(), "trust not the sender's");
                assert_eq!(&buf[len..], &original[len..], "decap wrote past the datagram");
            }
            Rx::Drop(_) => {}
        }
        // A length past the buffer is a drop, not a panic.
        let n = buf.len() + 1;
        assert!(matches!(fwd.decap(&table, from.into(), &mut buf, n), Rx::Drop(_)));
    }
});
