//! The wireguard backend through the workers: host A's TX path (TUN read, route, split, seal,
//! GSO send) and host B's RX path (receive, open, GRO, TUN write) and back, over the fake TUN
//! and UDP, with two real session cores (fixed keys) handshaking through the loop. TUN reads
//! are arbitrary bytes (behind an arbitrary virtio_net_hdr when offloads are on) or packets from
//! A's subnet to B's; arbitrary datagrams from the underlay (a peer's address or a stranger's)
//! arrive at B between the rounds. Whatever B writes to its TUN device is a packet for its
//! subnet from A's.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::config::BackendKind;
use weft::dataplane::transport::wireguard::{Devices, PeerConfig, Sessions, WgSecret, public_key};
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
use weft_fuzz::AnyPacket;

const PORT: u16 = 51820;

#[derive(Arbitrary, Debug)]
enum Read {
    /// Exactly these bytes (header included, when offloads are on).
    Raw(Vec<u8>),
    /// A packet from A's subnet to B's (when built) behind a header (with offloads), as a
    /// super-packet of `gso` segments when given.
    Packet { gso: Option<(u8, u16)>, packet: AnyPacket },
}

#[derive(Arbitrary, Debug)]
struct Input {
    vnet: bool,
    gso: bool,
    gro_tcp: bool,
    gro_udp: bool,
    batch: u8,
    psk: bool,
    rounds: Vec<(Vec<Read>, Vec<(bool, Vec<u8>)>)>,
}

fn subnet(n: u8) -> Subnet {
    format!("10.244.{n}.0/24").parse().unwrap()
}

fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, n)
}

/// Host `n`'s forwarder, its routes (to `peer` with `peer_key`) and its sessions.
fn host(
    n: u8,
    peer: u8,
    key: WgSecret,
    peer_key: WgSecret,
    psk: Option<WgSecret>,
) -> (Forwarder, Routes) {
    let sessions = Sessions::new(&key, psk, None, 1420);
    sessions.set_peers([PeerConfig {
        key: public_key(&peer_key),
        endpoint: SocketAddrV4::new(ip(peer), PORT).into(),
        subnet: subnet(peer),
        ipv6: None,
        epoch: 0,
    }]);
    let own = Arc::new(OwnSubnet::default());
    own.set(Some(subnet(n)));
    let fwd = Forwarder {
        backend: BackendKind::Wireguard,
        vni: vxlan::Vni::new(1).unwrap(),
        port: PORT,
        our_mac: MacAddr([2, 0, 0, 0, 0, n]),
        own,
        icmp_source: Ipv4Addr::new(10, 244, 0, 0),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: Some(Arc::new(Devices::ipv4_only(sessions, PORT))),
        ipv6: Default::default(),
    };
    let routes = Routes::new(RouteTable::build(
        "10.244.0.0/16".parse().unwrap(),
        24,
        [Peer {
            subnet: subnet(peer),
            public_ip: ip(peer),
            backend: PeerBackend::Wireguard { key: public_key(&peer_key), port: None },
            vtep_mac: None,
            vni: None,
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        }],
    ));
    (fwd, routes)
}

fn frame(vnet: bool, gso: Option<(u8, u16)>, bytes: &[u8]) -> Vec<u8> {
    let mut frame = Vec::new();
    if vnet {
        let h = match gso {
            Some((kind, size)) => Header {
                flags: virtio_net::F_NEEDS_CSUM,
                gso_type: [virtio_net::GSO_TCPV4, virtio_net::GSO_UDP_L4][usize::from(kind % 2)],
                hdr_len: 0,
                gso_size: size.max(1),
                csum_start: 20,
                csum_offset: if kind % 2 == 0 { 16 } else { 6 },
            },
            None => Header::NONE,
        };
        let mut hdr = [0u8; virtio_net::LEN];
        let _ = h.emit(&mut hdr);
        frame.extend_from_slice(&hdr);
    }
    frame.extend_from_slice(bytes);
    frame
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let (ka, kb) = (WgSecret::from_bytes([1; 32]), WgSecret::from_bytes([2; 32]));
    let psk = input.psk.then(|| WgSecret::from_bytes([3; 32]));
    let (fwd_a, routes_a) = host(1, 2, ka, kb, psk);
    let (fwd_b, routes_b) = host(2, 1, kb, ka, psk);
    let cfg = WorkerConfig {
        batch: usize::from(input.batch % 8) + 1,
        wake: Duration::ZERO,
        gro_tcp: input.gro_tcp,
        gro_udp: input.gro_udp,
        one_thread: true,
        spin: Duration::ZERO,
        slice: Duration::ZERO,
    };
    let new_tun = || if input.vnet { FakeTun::with_vnet_hdr() } else { FakeTun::new() };
    let (tun_a, tun_b) = (new_tun(), new_tun());
    let net = FakeNet::new();
    let mut sock_a = net.bind(SocketAddrV4::new(ip(1), PORT));
    let mut sock_b = net.bind(SocketAddrV4::new(ip(2), PORT));
    sock_a.set_gso(input.gso);
    sock_b.set_gso(input.gso);
    let (ca, cb) = (PacketCounters::default(), PacketCounters::default());
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new());
    let (mut tx_a, mut rx_a) = (
        TxPath::new(&*tun_a, &cfg, clock.clone()),
        RxPath::new(&*tun_a, &sock_a, &cfg, clock.clone()),
    );
    let (mut tx_b, mut rx_b) =
        (TxPath::new(&*tun_b, &cfg, clock.clone()), RxPath::new(&*tun_b, &sock_b, &cfg, clock));
    let cx_a = Context { tun: &*tun_a, fwd: &fwd_a, routes: &routes_a, counters: &ca };
    let cx_b = Context { tun: &*tun_b, fwd: &fwd_b, routes: &routes_b, counters: &cb };
    let (a_net, b_net) = (subnet(1), subnet(2));

    for (reads, datagrams) in input.rounds.iter().take(6) {
        for r in reads.iter().take(12) {
            let bytes = match r {
                Read::Raw(b) => b.clone(),
                Read::Packet { gso, packet } => {
                    let addrs = Some((Ipv4Addr::new(10, 244, 1, 5), Ipv4Addr::new(10, 244, 2, 7)));
                    let bytes = match packet {
                        AnyPacket::Built(p) => p.build_with(60000, addrs),
                        AnyPacket::Raw(b) => b.clone(),
                    };
                    frame(input.vnet, *gso, &bytes)
                }
            };
            tun_a.inject(&bytes);
        }
        for (from_peer, d) in datagrams.iter().take(8) {
            let from = if *from_peer {
                SocketAddrV4::new(ip(1), PORT)
            } else {
                SocketAddrV4::new(ip(9), 4000)
            };
            net.send_raw(from, SocketAddrV4::new(ip(2), PORT), d);
        }
        // Two passes: the handshake, then what waited for it.
        for _ in 0..2 {
            for _ in 0..16 {
                if tx_a.step(&cx_a, std::slice::from_mut(&mut sock_a)) == 0 {
                    break;
                }
            }
            for _ in 0..32 {
                if rx_b.step(&cx_b, &mut sock_b) == 0 {
                    break;
                }
            }
            for _ in 0..8 {
                if tx_b.step(&cx_b, std::slice::from_mut(&mut sock_b)) == 0 {
                    break;
                }
            }
            for _ in 0..32 {
                if rx_a.step(&cx_a, &mut sock_a) == 0 {
                    break;
                }
            }
        }
    }
    // What B delivered is for B's subnet, from A's.
    let skip = if input.vnet { virtio_net::LEN } else { 0 };
    while let Some(w) = tun_b.take_written(Duration::ZERO) {
        let p = &w[skip..];
        assert_eq!(p[0] >> 4, 4, "B wrote a non-IPv4 packet");
        let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
        let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
        let (src_in, dst_in) = (a_net.contains(IpAddr::V4(src)), b_net.contains(IpAddr::V4(dst)));
        assert!(src_in && dst_in, "{src} -> {dst}");
    }
});
