//! The whole forwarding path — worker loops, route lookup, encapsulation, validation,
//! decapsulation — between two hosts whose TUN devices and underlay are in-memory fakes. Runs
//! unprivileged, for both backends.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use weft::config::BackendKind;
use weft::dataplane::transport::{DropReason, Forwarder, IcmpLimit, OwnSubnet};
use weft::dataplane::wire::ethernet::MacAddr;
use weft::dataplane::wire::{icmpv4, ipv4, vxlan::Vni};
use weft::dataplane::worker::counters::Counters;
use weft::dataplane::worker::fake::{FakeNet, FakeTun};
use weft::dataplane::worker::{self, StopSignal, WorkerConfig};
use weft::lease::record::Subnet;
use weft::route::{Peer, PeerBackend, RouteTable, Routes};
use weft::time::ManualClock;

const WAIT: Duration = Duration::from_secs(2);

struct Host {
    tun: Arc<FakeTun>,
    counters: Arc<Counters>,
    addr: SocketAddrV4,
}

fn subnet(s: &str) -> Subnet {
    s.parse().unwrap()
}

fn mac(n: u8) -> MacAddr {
    MacAddr([2, 0, 0, 0, 0, n])
}

fn peer(n: u8, backend: PeerBackend) -> Peer {
    Peer {
        subnet: Subnet::from_parts(Ipv4Addr::new(10, 244, n, 0), 24).unwrap(),
        public_ip: Ipv4Addr::new(192, 0, 2, n),
        backend,
        vtep_mac: (backend == PeerBackend::Vxlan).then(|| mac(n)),
        vni: Some(1),
        node: None,
        stale: false,
        incarnation: None,
        ipv6: None,
    }
}

/// Starts host `n` (subnet 10.244.n.0/24, underlay 192.0.2.n) knowing the other hosts, its
/// workers reading `clock`; a one-thread worker keeps looking for `spin` after a small step.
#[allow(clippy::too_many_arguments)]
fn start(
    net: &FakeNet,
    n: u8,
    others: &[u8],
    backend: BackendKind,
    port: u16,
    stop: &Arc<StopSignal>,
    one_thread: bool,
    spin: Duration,
    clock: ManualClock,
) -> Host {
    let pb = if backend == BackendKind::Vxlan { PeerBackend::Vxlan } else { PeerBackend::Udp };
    let routes = Arc::new(Routes::new(RouteTable::build(
        "10.244.0.0/16".parse().unwrap(),
        24,
        others.iter().map(|o| peer(*o, pb)),
    )));
    let own = Arc::new(OwnSubnet::default());
    own.set(Some(subnet(&format!("10.244.{n}.0/24"))));
    let fwd = Forwarder {
        backend,
        vni: Vni::new(1).unwrap(),
        port,
        our_mac: mac(n),
        own,
        icmp_source: Ipv4Addr::new(10, 244, 0, 0),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Default::default(),
    };
    let tun = FakeTun::new();
    let counters = Arc::new(Counters::default());
    let addr = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, n), port);
    let rx = net.bind(addr);
    let pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, n), 40000 + u16::from(n)))];
    let cfg = WorkerConfig {
        batch: 16,
        wake: Duration::from_millis(20),
        gro_tcp: false,
        gro_udp: false,
        one_thread,
        spin,
        slice: Duration::ZERO,
    };
    worker::Worker {
        tun: tun.clone(),
        tx_pool: pool,
        rx,
        fwd,
        routes,
        counters: counters.clone(),
        cfg,
        clock: Arc::new(clock),
        states: Arc::default(),
    }
    .spawn(&format!("h{n}"), stop.clone())
    .unwrap();
    Host { tun, counters, addr }
}

/// An ICMP echo request from `src` to `dst` (valid checksums).
fn echo(src: Ipv4Addr, dst: Ipv4Addr, ttl: u8) -> Vec<u8> {
    let mut p = vec![0u8; 20 + 8 + 32];
    p[0] = 0x45;
    let total = p.len() as u16;
    p[2..4].copy_from_slice(&total.to_be_bytes());
    p[8] = ttl;
    p[9] = 1;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    ipv4::Packet::new_unchecked(&mut p[..]).fill_checksum();
    p[20] = 8;
    for (i, b) in p[28..].iter_mut().enumerate() {
        *b = i as u8;
    }
    let sum = !weft::dataplane::wire::checksum::data(&p[20..]);
    p[22..24].copy_from_slice(&sum.to_be_bytes());
    p
}

fn two_hosts(backend: BackendKind, port: u16) -> (FakeNet, Host, Host, Arc<StopSignal>) {
    two_hosts_with(backend, port, false)
}

fn two_hosts_with(
    backend: BackendKind,
    port: u16,
    one_thread: bool,
) -> (FakeNet, Host, Host, Arc<StopSignal>) {
    let net = FakeNet::new();
    let stop = StopSignal::new();
    // No spin: the fakes run on a manual clock, which a spin would wait on for ever.
    let (spin, clock) = (Duration::ZERO, ManualClock::new);
    let a = start(&net, 1, &[2], backend, port, &stop, one_thread, spin, clock());
    let b = start(&net, 2, &[1], backend, port, &stop, one_thread, spin, clock());
    (net, a, b, stop)
}

/// A counter's value once the worker threads have added to it: they count a batch after
/// handing it on, so a packet can arrive before its count does.
fn count_settles(counter: impl Fn() -> u64) -> u64 {
    let deadline = std::time::Instant::now() + WAIT;
    while counter() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    counter()
}

#[test]
fn vxlan_packet_crosses_from_one_fake_host_to_the_other_unchanged() {
    let (_net, a, b, stop) = two_hosts(BackendKind::Vxlan, 8472);
    let p = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
    a.tun.inject(&p);
    assert_eq!(b.tun.take_written(WAIT).expect("delivered to host 2"), p);
    assert_eq!(count_settles(|| a.counters.packets().tx_packets), 1);
    assert_eq!(count_settles(|| b.counters.packets().rx_packets), 1);
    stop.stop();
}

#[test]
fn one_thread_workers_carry_packets_both_ways() {
    let (_net, a, b, stop) = two_hosts_with(BackendKind::Vxlan, 8472, true);
    let there = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
    let back = echo(Ipv4Addr::new(10, 244, 2, 2), Ipv4Addr::new(10, 244, 1, 2), 63);
    a.tun.inject(&there);
    assert_eq!(b.tun.take_written(WAIT).expect("delivered to host 2"), there);
    b.tun.inject(&back);
    assert_eq!(a.tun.take_written(WAIT).expect("delivered back to host 1"), back);
    assert_eq!(count_settles(|| a.counters.packets().tx_packets), 1);
    assert_eq!(count_settles(|| b.counters.packets().rx_packets), 1);
    stop.stop();
}

/// After a small step a one-thread worker keeps looking instead of sleeping,
/// so a reply that comes back soon is forwarded without a wake-up; once the spin is over it
/// sleeps. Host 1's clock stands still until the test moves it, so "soon" lasts as long as the
/// test needs, whatever the machine's load: the reply is sent 30 ms later.
#[test]
fn a_one_thread_worker_spins_after_a_small_step_and_forwards_the_reply_without_sleeping() {
    let net = FakeNet::new();
    let stop = StopSignal::new();
    let (vx, spin) = (BackendKind::Vxlan, Duration::from_micros(50));
    let clock = ManualClock::new();
    let a = start(&net, 1, &[2], vx, 8472, &stop, true, spin, clock.clone());
    let b = start(&net, 2, &[1], vx, 8472, &stop, true, Duration::ZERO, ManualClock::new());
    let there = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
    let back = echo(Ipv4Addr::new(10, 244, 2, 2), Ipv4Addr::new(10, 244, 1, 2), 63);
    let wakeups = || a.counters.packets().wakeups;

    a.tun.inject(&there);
    assert_eq!(b.tun.take_written(WAIT).expect("delivered to host 2"), there);
    // Host 1's thread counted its last wake-up before it read the request.
    let before = wakeups();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(wakeups(), before, "host 1 slept after a small step instead of spinning");
    b.tun.inject(&back);
    assert_eq!(a.tun.take_written(WAIT).expect("delivered back to host 1"), back);
    assert_eq!(wakeups(), before, "the reply needed a wake-up");

    // The spin after the reply ends once its time has passed: the thread sleeps again. (The
    // clock moves on until it does: moved once, it could move before that spin began.)
    let deadline = std::time::Instant::now() + WAIT;
    while wakeups() == before && std::time::Instant::now() < deadline {
        clock.advance(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(wakeups() > before, "still spinning long after the spin's time");
    stop.stop();
}

#[test]
fn udp_backend_crosses_and_decrements_the_ttl_like_flannel() {
    let (_net, a, b, stop) = two_hosts(BackendKind::Udp, 8285);
    let p = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
    a.tun.inject(&p);
    let got = b.tun.take_written(WAIT).expect("delivered to host 2");
    let ip = ipv4::Packet::new_checked(&got[..]).unwrap();
    assert_eq!(ip.ttl(), 62);
    assert!(ip.verify_checksum());
    assert_eq!(&got[20..], &p[20..]);
    stop.stop();
}

#[test]
fn a_destination_outside_every_lease_is_answered_with_net_unreachable() {
    let (_net, a, _b, stop) = two_hosts(BackendKind::Vxlan, 8472);
    let p = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 77, 2), 63);
    a.tun.inject(&p);
    let reply = a.tun.take_written(WAIT).expect("an ICMP error back into TUN");
    let ip = ipv4::Packet::new_checked(&reply[..]).unwrap();
    assert_eq!(ip.dst_addr(), Ipv4Addr::new(10, 244, 1, 2));
    // Not our own TUN address: the kernel would drop that as a martian source.
    assert_eq!(ip.src_addr(), Ipv4Addr::new(10, 244, 0, 0));
    assert_eq!(ip.payload()[0], icmpv4::TYPE_DEST_UNREACHABLE);
    assert_eq!(ip.payload()[1], icmpv4::code::NET_UNREACHABLE);
    assert_eq!(a.counters.drops(DropReason::TxNoRoute), 1);
    stop.stop();
}

#[test]
fn garbage_datagrams_are_counted_by_reason_and_never_delivered() {
    let (net, a, b, stop) = two_hosts(BackendKind::Vxlan, 8472);
    let good = echo(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
    // A valid frame as host 1 would send it, to mutate.
    let mut frame = vec![0x08, 0, 0, 0, 0, 0, 1, 0];
    frame.extend_from_slice(&mac(2).0);
    frame.extend_from_slice(&mac(1).0);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&good);
    let from_host1 = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001);
    let stranger = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 254), 5555);
    let mut bad_flags = frame.clone();
    bad_flags[0] = 0;
    let mut wrong_vni = frame.clone();
    wrong_vni[6] = 9;
    let mut wrong_mac = frame.clone();
    wrong_mac[8..14].copy_from_slice(&mac(9).0);
    let spoofed = {
        let mut f = frame.clone();
        let inner = echo(Ipv4Addr::new(10, 244, 3, 2), Ipv4Addr::new(10, 244, 2, 2), 63);
        f.truncate(22);
        f.extend_from_slice(&inner);
        f
    };
    let cases: [(&[u8], SocketAddrV4, DropReason); 6] = [
        (&frame[..5], from_host1, DropReason::RxMalformed),
        (&bad_flags, from_host1, DropReason::RxBadFlags),
        (&wrong_vni, from_host1, DropReason::RxWrongVni),
        (&wrong_mac, from_host1, DropReason::RxNotOurMac),
        (&spoofed, from_host1, DropReason::RxSpoofedSource),
        (&frame, stranger, DropReason::RxUnknownSender),
    ];
    for (datagram, from, _) in &cases {
        for _ in 0..3 {
            net.send_raw(*from, b.addr, datagram);
        }
    }
    // Real traffic still flows through the garbage.
    a.tun.inject(&good);
    assert_eq!(b.tun.take_written(WAIT).expect("real traffic delivered"), good);
    assert!(b.tun.take_written(Duration::from_millis(200)).is_none(), "nothing else delivered");
    for (_, _, reason) in &cases {
        assert_eq!(b.counters.drops(*reason), 3, "{reason:?}");
    }
    stop.stop();
}

/// A pod flooding addresses in no lease: the first `IcmpLimit::BURST` packets are answered with
/// net unreachable, the rest only counted (time stands still); once the clock moves on, the
/// bucket has refilled and answers again — never more than a burst.
#[test]
fn a_flood_to_unleased_destinations_gets_at_most_a_burst_of_icmp_errors() {
    const FLOOD: u64 = 300;
    let burst = u64::from(IcmpLimit::BURST);
    let net = FakeNet::new();
    let stop = StopSignal::new();
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(1000));
    let a =
        start(&net, 1, &[2], BackendKind::Vxlan, 8472, &stop, false, Duration::ZERO, clock.clone());
    let _b = start(
        &net,
        2,
        &[1],
        BackendKind::Vxlan,
        8472,
        &stop,
        false,
        Duration::ZERO,
        ManualClock::new(),
    );
    let flood = |round: u64| {
        for i in 0..FLOOD {
            let dst = Ipv4Addr::new(10, 244, 100 + (i % 100) as u8, 2);
            a.tun.inject(&echo(Ipv4Addr::new(10, 244, 1, 2), dst, 63));
        }
        let deadline = std::time::Instant::now() + WAIT;
        while a.counters.drops(DropReason::TxNoRoute) < round * FLOOD {
            assert!(std::time::Instant::now() < deadline, "the flood was not all read");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut replies = 0;
        while let Some(reply) = a.tun.take_written(Duration::from_millis(200)) {
            let ip = ipv4::Packet::new_checked(&reply[..]).unwrap();
            assert_eq!(ip.payload()[0], icmpv4::TYPE_DEST_UNREACHABLE);
            replies += 1;
        }
        replies
    };
    assert_eq!(flood(1), burst, "replies to the first flood");
    let suppressed = a.counters.packets().icmp_suppressed;
    assert_eq!(suppressed, FLOOD - burst);
    // A second later the bucket is full again: one more burst, no more.
    clock.advance(Duration::from_secs(1));
    assert_eq!(flood(2), burst, "replies to the second flood");
    assert_eq!(a.counters.packets().icmp_suppressed, 2 * (FLOOD - burst));
    let metrics = weft::metrics::render_collector(a.counters.clone()).expect("metrics render");
    let line = format!("weft_dataplane_icmp_suppressed_total {}\n", 2 * (FLOOD - burst));
    assert!(metrics.contains(&line), "{line} missing from\n{metrics}");
    stop.stop();
}
