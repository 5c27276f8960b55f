//! The forwarder's encap (Forwarder::encap) and decap (Forwarder::decap) over an arbitrary route
//! table built with RouteTable::build, an arbitrary own subnet, backend and VNI.
//!
//! Invariants: a Send's range lies in the buffer and starts with the backend's encapsulation
//! (VXLAN header with our VNI and an inner Ethernet header to the peer's VTEP MAC) in front of
//! the untouched packet, and goes to the peer the table names for the destination; a Reply is a
//! valid ICMP error inside the reply buffer; a Deliver is an IPv4 packet inside the datagram of
//! exactly its total length, from a source routed to the sender, to our subnet.
#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::config::BackendKind;
use weft::dataplane::pipeline::{Forwarder, HEADROOM, IcmpLimit, OwnSubnet, Rx, Tx};
use weft::dataplane::wire::{ethernet, ipv4, vxlan};
use weft::time::Instant;
use weft_fuzz::{AnyPacket, ArbNetwork, ArbPeer};

#[derive(Arbitrary, Debug)]
struct Input {
    network: ArbNetwork,
    peers: Vec<ArbPeer>,
    own: Option<u32>,
    udp_backend: bool,
    vni: u32,
    our_mac: [u8; 6],
    now_ms: u32,
    reply_len: u16,
    extra: u8,
    /// Packets read from TUN.
    tx: Vec<AnyPacket>,
    /// Datagrams from the underlay: (sender host part of 192.0.2.x, VXLAN-wrap it, bytes).
    rx: Vec<(u8, bool, AnyPacket)>,
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
            Tx::Reply { len, .. } => {
                assert!(len <= reply.len());
                let r = ipv4::Packet::new_checked(&reply[..len]).expect("reply checks");
                assert!(ipv4::Repr::parse(&r).is_ok(), "reply does not parse");
            }
            Tx::Drop(_) | Tx::Suppressed(_) => {}
        }
    }

    for (sender, wrap, p) in input.rx.iter().take(16) {
        let inner = p.bytes(2000);
        let mut buf = Vec::new();
        if *wrap {
            buf.resize(HEADROOM, 0);
            let _ = vxlan::Repr { vni: fwd.vni }.emit(&mut buf);
            let _ = ethernet::Repr {
                src_addr: ethernet::MacAddr([2; 6]),
                dst_addr: fwd.our_mac,
                ethertype: ethernet::EtherType::IPV4,
            }
            .emit(&mut buf[vxlan::HEADER_LEN..]);
        }
        buf.extend_from_slice(&inner);
        let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, *sender), 8472);
        let len = buf.len();
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
