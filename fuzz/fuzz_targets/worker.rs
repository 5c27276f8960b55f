//! The worker's TX path (TxPath::step: TUN read, virtio header, split or encap, GSO send) and RX
//! path (RxPath::step: receive, decap, GRO, vectored TUN write) over the fake TUN and UDP, with
//! an arbitrary route table. TUN reads are arbitrary bytes (behind an arbitrary virtio_net_hdr
//! when offloads are on) or well-formed packets; what TX sends to the peer whose address this
//! host's socket is bound to comes back through RX, with arbitrary datagrams from the underlay.
//! With the equal-tail rule on, the fake socket sends the pads and datagrams alone the real one
//! would, and panics on a GSO message beyond its limits (the TX path never lays one out); RX
//! counts malformed datagrams by peer.
#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::config::BackendKind;
use weft::dataplane::sys::udp::gso_tail::TailRule;
use weft::dataplane::transport::{Forwarder, OwnSubnet};
use weft::dataplane::wire::ethernet::MacAddr;
use weft::dataplane::wire::virtio_net::{self, Header};
use weft::dataplane::wire::vxlan;
use weft::dataplane::worker::counters::PacketCounters;
use weft::dataplane::worker::fake::{FakeNet, FakeTun};
use weft::dataplane::worker::{Context, RxPath, TxPath, WorkerConfig};
use weft::lease::record::Subnet;
use weft::route::{Peer, PeerBackend, RouteTable, Routes};
use weft::time::{Clock, ManualClock};
use weft_fuzz::{AnyPacket, ArbNetwork, ArbPeer};

#[derive(Arbitrary, Debug)]
enum Read {
    /// Exactly these bytes (header included, when offloads are on).
    Raw(Vec<u8>),
    /// A packet behind a header (ignored without offloads).
    /// `steer`: from our subnet to the `k`th peer's (a well-formed IPv4 packet only).
    Packet { hdr: [u8; 10], gso: Option<(u8, u16)>, packet: AnyPacket, steer: Option<u8> },
}

#[derive(Arbitrary, Debug)]
struct Input {
    network: ArbNetwork,
    peers: Vec<ArbPeer>,
    own: Option<u32>,
    udp_backend: bool,
    vnet: bool,
    batch: u8,
    gro_tcp: bool,
    gro_udp: bool,
    gso: bool,
    /// GSO messages never end on a full segment (the pad, or datagrams alone).
    never_equal_tail: bool,
    /// Which peer's public IP our RX socket is bound to (so TX output comes back).
    loop_peer: u8,
    reads: Vec<Read>,
    datagrams: Vec<(u8, Vec<u8>)>,
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let net = input.network;
    let peers: Vec<_> = input.peers.iter().take(32).cloned().collect();
    let table = net.table(&peers);
    let own_subnet = input.own.map(|i| net.subnet(i, net.subnet_len()));
    let own = Arc::new(OwnSubnet::default());
    own.set(own_subnet);
    let backend = if input.udp_backend { BackendKind::Udp } else { BackendKind::Vxlan };
    let port = backend.default_port();
    let fwd = Forwarder {
        backend,
        vni: vxlan::Vni::new(1).unwrap(),
        port,
        our_mac: MacAddr([2, 0, 0, 0, 0, 1]),
        own,
        icmp_source: net.net().network(),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Default::default(),
    };
    let cfg = WorkerConfig {
        batch: usize::from(input.batch % 8) + 1,
        wake: Duration::ZERO,
        gro_tcp: input.gro_tcp,
        gro_udp: input.gro_udp,
        one_thread: true,
        spin: std::time::Duration::ZERO,
        slice: std::time::Duration::ZERO,
    };
    let tun = if input.vnet { FakeTun::with_vnet_hdr() } else { FakeTun::new() };
    let fake = FakeNet::new();
    let mut pool = vec![fake.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 200), 40001))];
    pool[0].set_gso(input.gso);
    pool[0].set_gso_tail(if input.never_equal_tail { TailRule::NeverEqual } else { TailRule::Any });
    // The receiving side is the peer our socket is bound as: its subnet is its own, and it
    // routes our subnet back to the address we send from.
    let looped = table.peers().get(usize::from(input.loop_peer) % table.len().max(1)).cloned();
    let loop_ip = looped.as_ref().map_or(Ipv4Addr::new(192, 0, 2, 1), |p| p.public_ip);
    let mut sock = fake.bind(SocketAddrV4::new(loop_ip, port));
    let own2 = Arc::new(OwnSubnet::default());
    own2.set(looped.as_ref().map(|p| p.subnet));
    let fwd2 = Forwarder {
        our_mac: looped.as_ref().and_then(|p| p.vtep_mac).unwrap_or(MacAddr([2, 0, 0, 0, 0, 2])),
        own: own2,
        ..fwd.clone()
    };
    let back = own_subnet.map(|subnet| Peer {
        subnet,
        public_ip: Ipv4Addr::new(192, 0, 2, 200),
        backend: if input.udp_backend { PeerBackend::Udp } else { PeerBackend::Vxlan },
        vtep_mac: Some(fwd.our_mac),
        vni: Some(1),
        node: None,
        stale: false,
        incarnation: None,
        ipv6: None,
    });
    let routes2 = Routes::new(RouteTable::build(
        net.net(),
        net.subnet_len(),
        table.peers().iter().cloned().chain(back),
    ));
    let first_host = |s: Subnet| match s.first_host() {
        std::net::IpAddr::V4(a) => Some(a),
        std::net::IpAddr::V6(_) => None,
    };
    let targets: Vec<Ipv4Addr> =
        table.peers().iter().filter_map(|p| first_host(p.subnet)).collect();
    let routes = Routes::new(table);
    let counters = PacketCounters::default();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new());

    for r in input.reads.iter().take(24) {
        match r {
            Read::Raw(b) => tun.inject(b),
            Read::Packet { hdr, gso, packet, steer } => {
                let addrs = match (steer, own_subnet, packet) {
                    (Some(k), Some(o), AnyPacket::Built(_)) if !targets.is_empty() => {
                        first_host(o).map(|o| (o, targets[usize::from(*k) % targets.len()]))
                    }
                    _ => None,
                };
                let bytes = match packet {
                    AnyPacket::Built(p) => p.build_with(60000, addrs),
                    AnyPacket::Raw(b) => b.clone(),
                };
                let mut frame = Vec::new();
                if input.vnet {
                    frame.extend_from_slice(hdr);
                    if let Some((kind, size)) = gso {
                        let v6 = bytes.first().is_some_and(|b| b >> 4 == 6);
                        let h = Header {
                            flags: virtio_net::F_NEEDS_CSUM,
                            gso_type: [
                                virtio_net::GSO_TCPV4,
                                virtio_net::GSO_TCPV6,
                                virtio_net::GSO_UDP_L4,
                            ][usize::from(kind % 3)],
                            hdr_len: 0,
                            gso_size: (*size).max(1),
                            csum_start: if v6 { 40 } else { 20 },
                            csum_offset: 16,
                        };
                        let _ = h.emit(&mut frame);
                    }
                }
                frame.extend_from_slice(&bytes);
                tun.inject(&frame);
            }
        }
    }
    let mut tx = TxPath::new(&*tun, &cfg, clock.clone());
    // Each step reads at most one batch; drain what was injected.
    for _ in 0..32 {
        if tx.step(
            &Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters },
            &mut pool,
        ) == 0
        {
            break;
        }
    }
    for (sender, d) in input.datagrams.iter().take(16) {
        let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, *sender), port);
        fake.send_raw(from, SocketAddrV4::new(loop_ip, port), d);
    }
    let mut rx = RxPath::new(&*tun, &sock, &cfg, clock);
    for _ in 0..64 {
        if rx.step(
            &Context { tun: &*tun, fwd: &fwd2, routes: &routes2, counters: &counters },
            &mut sock,
        ) == 0
        {
            break;
        }
    }
    // Whatever reached TUN starts with a header that parses, when offloads are on.
    while let Some(w) = tun.take_written(Duration::ZERO) {
        if input.vnet {
            assert!(Header::parse(&w).is_ok(), "TUN write without a virtio_net_hdr");
        }
    }
});
