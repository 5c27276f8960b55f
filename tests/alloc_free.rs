//! Proves the per-packet path allocates nothing: a counting global allocator wraps the system
//! one, and after a warm-up, thousands of packets go through VXLAN encapsulation,
//! decapsulation and route lookup, a thousand TSO super-packets through the offload split
//! and the in-place GRO coalesce, and thousands of GSO pads and malformed datagrams are
//! dropped and counted by peer, without one allocation.
//!
//! This is its own test binary because a global allocator is process-wide. It counts only the
//! allocations of the thread inside [`allocations_during`]: the test harness's own threads
//! (output capture, the slow-test timer) allocate whenever they like, and once made a fresh
//! machine's run count 4 allocations that were not the packet path's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use weft::config::BackendKind;
use weft::dataplane::offload::{GroConfig, GroTable, PacketRef, split};
use weft::dataplane::sys::udp::gso_tail::{PAD, PAD_LEN};
use weft::dataplane::transport::malformed_peers::{MalformedLog, MalformedWatch};
use weft::dataplane::transport::{
    DropReason, Forwarder, HEADROOM, Ipv6Forwarding, OwnSubnet, OwnSubnet6, Rx, Tx,
};
use weft::dataplane::wire::ethernet::MacAddr;
use weft::dataplane::wire::vxlan::Vni;
use weft::dataplane::wire::{ipv4, virtio_net};
use weft::lease::record::Subnet;
use weft::route::{Peer, Peer6, PeerBackend, RouteTable};
use weft::time::Instant;

struct Counting;

thread_local! {
    /// Whether this thread's allocations are being counted (const-initialised: reading it
    /// never allocates, so the allocator may read it).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// This thread's counted allocations. Per thread, not one global count: two tests that
    /// count at once (the harness runs them on two threads) would each see the other's.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count_one() {
    // `try_with`: a thread being torn down has no thread-locals left; it is not counting.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: defers every call to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn subnet(s: &str) -> Subnet {
    s.parse().unwrap()
}

/// An IPv4 packet from `src` to `dst` carrying `l4_len` bytes of `protocol`, header filled in
/// (checksum too), the rest zero.
fn ipv4_packet(protocol: u8, src: Ipv4Addr, dst: Ipv4Addr, l4_len: usize) -> Vec<u8> {
    let mut p = vec![0u8; 20 + l4_len];
    ipv4::Repr { src_addr: src, dst_addr: dst, protocol, payload_len: l4_len, ttl: 64 }
        .emit(&mut p)
        .expect("fits");
    p
}

/// An IPv4/UDP packet from `src` to `dst` with `payload` bytes, checksums filled.
fn udp_packet(src: Ipv4Addr, dst: Ipv4Addr, payload: usize) -> Vec<u8> {
    let mut p = ipv4_packet(17, src, dst, 8 + payload);
    p[20..22].copy_from_slice(&5000u16.to_be_bytes());
    p[22..24].copy_from_slice(&5001u16.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    p
}

fn peers() -> Vec<Peer> {
    (1..=200u8)
        .map(|i| Peer {
            subnet: Subnet::from_parts(Ipv4Addr::new(10, 244, i, 0), 24).unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, i),
            backend: PeerBackend::Vxlan,
            vtep_mac: Some(MacAddr([2, 0, 0, 0, 0, i])),
            vni: Some(1),
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        })
        .collect()
}

#[test]
fn the_per_packet_path_allocates_nothing() {
    let network = "10.244.0.0/16".parse().unwrap();
    let a_own = Arc::new(OwnSubnet::default());
    a_own.set(Some(subnet("10.244.1.0/24")));
    let b_own = Arc::new(OwnSubnet::default());
    b_own.set(Some(subnet("10.244.2.0/24")));
    let vni = Vni::new(1).unwrap();
    let a = Forwarder {
        backend: BackendKind::Vxlan,
        vni,
        port: 8472,
        our_mac: MacAddr([2, 0, 0, 0, 0, 1]),
        own: a_own,
        icmp_source: Ipv4Addr::new(10, 244, 0, 0),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Default::default(),
    };
    let b = Forwarder {
        backend: BackendKind::Vxlan,
        vni,
        port: 8472,
        our_mac: MacAddr([2, 0, 0, 0, 0, 2]),
        own: b_own,
        icmp_source: Ipv4Addr::new(10, 244, 0, 0),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Default::default(),
    };
    let a_routes = RouteTable::build(
        network,
        24,
        peers().into_iter().filter(|p| p.subnet != subnet("10.244.1.0/24")),
    );
    let b_routes = RouteTable::build(
        network,
        24,
        peers().into_iter().filter(|p| p.subnet != subnet("10.244.2.0/24")),
    );
    let packet = udp_packet(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 1372);
    let mut buf = vec![0u8; HEADROOM + 65536];
    let mut reply = vec![0u8; 1500];
    let mut run = |rounds: usize| {
        let mut delivered = 0;
        for _ in 0..rounds {
            buf[HEADROOM..HEADROOM + packet.len()].copy_from_slice(&packet);
            let Tx::Send { peer, range, .. } =
                a.encap(&a_routes, &mut buf, packet.len(), &mut reply, Instant::ZERO)
            else {
                panic!("encap failed")
            };
            assert_eq!(peer, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472).into());
            let len = range.len();
            let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 50000).into();
            if let Rx::Deliver { range: inner, .. } = b.decap(&b_routes, from, &mut buf, len) {
                assert_eq!(inner.len(), packet.len());
                delivered += 1;
            }
        }
        delivered
    };
    assert_eq!(run(100), 100, "warm-up");
    let (delivered, allocs) = allocations_during(|| run(10_000));
    assert_eq!(delivered, 10_000);
    assert_eq!(allocs, 0, "allocations on the per-packet path");

    // A destination in no lease: ICMP net unreachable while the rate limit allows it, counted
    // as suppressed once it does not.
    let unroutable = udp_packet(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 250, 2), 64);
    let mut icmp = |rounds: u32| {
        let (mut replies, mut suppressed) = (0, 0);
        for i in 0..rounds {
            buf[HEADROOM..HEADROOM + unroutable.len()].copy_from_slice(&unroutable);
            let now = Instant::from_epoch(std::time::Duration::from_micros(u64::from(i) * 100));
            match a.encap(&a_routes, &mut buf, unroutable.len(), &mut reply, now) {
                Tx::Reply { .. } => replies += 1,
                Tx::Suppressed(_) => suppressed += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        (replies, suppressed)
    };
    assert_eq!(icmp(10), (10, 0), "warm-up");
    let ((replies, suppressed), allocs) = allocations_during(|| icmp(10_000));
    assert!(replies > 0 && suppressed > 0, "{replies} replies, {suppressed} suppressed");
    assert_eq!(allocs, 0, "allocations on the ICMP reply path");

    // The offload path: a TSO super-packet split into segments behind VXLAN headroom (TX),
    // and the segments coalesced back where they lie (RX GRO), as the workers do them.
    let (hdr, super_packet) = tso_super_packet(40 * 1398, 1398);
    let mut out = vec![0u8; 128 * 1024];
    let mut refs: Vec<PacketRef> = Vec::with_capacity(64);
    let mut gro = GroTable::new(GroConfig::default(), 64);
    let mut offload = |rounds: usize| {
        let mut merged = 0;
        for _ in 0..rounds {
            let segs = split(&hdr, &super_packet, &mut out, HEADROOM).expect("splits");
            refs.clear();
            refs.extend((0..segs.count()).map(|i| {
                let r = segs.packet(i);
                PacketRef::new(0, r.start, r.len())
            }));
            let bufs = std::slice::from_mut(&mut out);
            let writes = gro.coalesce_refs(bufs, &refs);
            assert_eq!(writes.len(), 1, "one super-packet comes back");
            let w = writes[0];
            merged += gro.appended(&w, &refs).count() + 1;
        }
        merged
    };
    assert_eq!(offload(10), 400, "warm-up");
    let (segments, allocs) = allocations_during(|| offload(1_000));
    assert_eq!(segments, 40_000);
    assert_eq!(allocs, 0, "allocations on the offload path");

    // Datagrams that are dropped: a weft peer's GSO pad, and malformed ones from many peers,
    // counted per peer (more peers than the watch follows), their alarms through the shared
    // log, as the RX path does.
    let mut watch = MalformedWatch::new();
    let log = MalformedLog::default();
    let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 50000).into();
    let mut dropped = |rounds: u64| {
        let (mut pads, mut alarms) = (0, 0);
        for i in 0..rounds {
            buf[..PAD_LEN].copy_from_slice(&PAD);
            if b.decap(&b_routes, from, &mut buf, PAD_LEN) == Rx::Drop(DropReason::RxGsoPad) {
                pads += 1;
            }
            let Rx::Drop(reason) = b.decap(&b_routes, from, &mut buf, 3) else { panic!() };
            assert!(reason.is_suspect());
            // Eight peers often, and among them a new one every fifth datagram.
            let d = if i % 5 == 4 { 100 + (i / 5) % 100 } else { i % 8 };
            let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, d as u8));
            let now = Instant::from_epoch(std::time::Duration::from_micros(i * 50));
            if let Some(a) = watch.record(peer, "malformed", now) {
                alarms += 1;
                log.admit(a.peer, now);
            }
        }
        (pads, alarms)
    };
    assert_eq!(dropped(100).0, 100, "warm-up");
    let ((pads, alarms), allocs) = allocations_during(|| dropped(100_000));
    assert_eq!(pads, 100_000);
    assert!(alarms > 0, "no alarm: the watch was not exercised");
    assert_eq!(allocs, 0, "allocations dropping pads and counting malformed datagrams");
}

/// What `f` returns, and how many allocations it made on this thread.
/// IPv6 (dual-stack peers): route lookups, and encapsulation and decapsulation of IPv6
/// packets over the IPv6 underlay, allocate nothing either.
#[test]
fn ipv6_forwarding_allocates_nothing() {
    let half = |i: u8| -> weft::lease::record::Ipv6Subnet {
        format!("fd00:10:244:{i:x}::/64").parse().unwrap()
    };
    let dual_peers = || {
        peers().into_iter().map(move |mut p| {
            let i = p.public_ip.octets()[3];
            p.ipv6 = Some(Peer6 {
                subnet: half(i),
                public_ip: format!("2001:db8::{i:x}").parse().unwrap(),
                vtep_mac: MacAddr([2, 0, 0, 0, 0, i]),
                wireguard: None,
            });
            p
        })
    };
    let network = "10.244.0.0/16".parse().unwrap();
    let table = RouteTable::build(network, 24, dual_peers());
    let dst = |n: u32| -> Ipv6Addr {
        Ipv6Addr::from(
            0xfd00_0010_0244_0000_0000_0000_0000_0000u128 | (u128::from(n % 256) << 64) | 7,
        )
    };
    let lookups = |n: u32| (0..n).filter(|&i| table.lookup6(dst(i)).is_some()).count();
    assert_eq!(lookups(256), 200, "warm-up: halves 1..=200 hit, the rest miss");
    let (hits, allocs) = allocations_during(|| lookups(10_000));
    assert!(hits > 7_000, "{hits}");
    assert_eq!(allocs, 0, "allocations on the IPv6 lookup path");

    let host = |n: u8| {
        let own = Arc::new(OwnSubnet::default());
        own.set(Some(subnet(&format!("10.244.{n}.0/24"))));
        let own6 = Arc::new(OwnSubnet6::default());
        own6.set(Some(half(n)));
        let fwd = Forwarder {
            backend: BackendKind::Vxlan,
            vni: Vni::new(1).unwrap(),
            port: 8472,
            our_mac: MacAddr([2, 0, 0, 0, 0, n]),
            own,
            icmp_source: Ipv4Addr::new(10, 244, 0, 0),
            icmp_limit: Arc::default(),
            malformed: Arc::default(),
            wireguard: None,
            ipv6: Ipv6Forwarding { own: own6, icmp_source: "fd00:10:244::".parse().unwrap() },
        };
        let routes = RouteTable::build(
            network,
            24,
            dual_peers().filter(move |p| p.public_ip.octets()[3] != n),
        );
        (fwd, routes)
    };
    let ((a, a_routes), (b, b_routes)) = (host(1), host(2));
    let repr_len = 40 + 8 + 1000;
    let mut packet = vec![0u8; repr_len];
    packet[0] = 0x60;
    packet[4..6].copy_from_slice(&1008u16.to_be_bytes());
    packet[6] = 17;
    packet[7] = 64;
    packet[8..24].copy_from_slice(&"fd00:10:244:1::5".parse::<Ipv6Addr>().unwrap().octets());
    packet[24..40].copy_from_slice(&"fd00:10:244:2::7".parse::<Ipv6Addr>().unwrap().octets());
    packet[44..46].copy_from_slice(&1008u16.to_be_bytes());
    let from: std::net::SocketAddr = "[2001:db8::1]:40000".parse().unwrap();
    let mut buf = vec![0u8; HEADROOM + repr_len];
    let mut reply = vec![0u8; 1500];
    let mut run = |rounds: usize| {
        let mut delivered = 0;
        for _ in 0..rounds {
            buf[HEADROOM..].copy_from_slice(&packet);
            let Tx::Send { range, .. } =
                a.encap(&a_routes, &mut buf, repr_len, &mut reply, Instant::ZERO)
            else {
                panic!("IPv6 encap failed")
            };
            let len = range.len();
            if let Rx::Deliver { range: inner, .. } = b.decap(&b_routes, from, &mut buf, len) {
                assert_eq!(inner.len(), repr_len);
                delivered += 1;
            }
        }
        delivered
    };
    assert_eq!(run(100), 100, "warm-up");
    let (delivered, allocs) = allocations_during(|| run(10_000));
    assert_eq!(delivered, 10_000);
    assert_eq!(allocs, 0, "allocations on the IPv6 forwarding path");
}

fn allocations_during<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = ALLOCS.with(Cell::get);
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (r, ALLOCS.with(Cell::get) - before)
}

#[test]
fn the_counter_sees_this_threads_allocations_and_no_others() {
    let (v, n) = allocations_during(|| vec![1u8; 64]);
    assert_eq!((v.len(), n), (64, 1));
    // Another thread allocating all the while is not counted.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) {
                made += std::hint::black_box(vec![0u8; 64]).len() as u64 / 64;
            }
            made
        })
    };
    let (_, n) = allocations_during(|| std::thread::sleep(std::time::Duration::from_millis(50)));
    stop.store(true, Ordering::Relaxed);
    assert!(busy.join().unwrap() > 0);
    assert_eq!(n, 0);
}

/// A TCPv4 super-packet of `payload` bytes as TUN hands it over with TSO, and its header.
fn tso_super_packet(payload: usize, mss: u16) -> (virtio_net::Header, Vec<u8>) {
    let (src, dst) = (Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2));
    let mut p = ipv4_packet(6, src, dst, 20 + payload);
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&5201u16.to_be_bytes());
    p[24..28].copy_from_slice(&1u32.to_be_bytes());
    p[28..32].copy_from_slice(&1u32.to_be_bytes());
    p[32] = 5 << 4;
    p[33] = 0x10; // ACK
    p[34..36].copy_from_slice(&502u16.to_be_bytes());
    for (i, b) in p[40..].iter_mut().enumerate() {
        *b = (i * 7) as u8;
    }
    let hdr = virtio_net::Header {
        flags: virtio_net::F_NEEDS_CSUM,
        gso_type: virtio_net::GSO_TCPV4,
        hdr_len: 40,
        gso_size: mss,
        csum_start: 20,
        csum_offset: 16,
    };
    (hdr, p)
}
