//! Two cores, A and B, each with the other as its peer, exchanging datagrams in memory.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

const MTU: u16 = 1420;

/// A private key no other call returns (distinct bytes; X25519 clamps them).
fn fresh_key() -> WgSecret {
    use std::sync::atomic::{AtomicU8, Ordering};
    static NEXT: AtomicU8 = AtomicU8::new(10);
    WgSecret::from_bytes([NEXT.fetch_add(1, Ordering::Relaxed); 32])
}

#[test]
fn public_key_derives_as_rfc_7748_says() {
    // RFC 7748 section 6.1's Alice, in `wg`'s base64.
    let private = WgSecret::parse("dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=").unwrap();
    let public = public_key(&private);
    assert_eq!(public.to_string(), "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=");
    assert_eq!(Sessions::new(&private, None, None, MTU).public_key(), public);
}

fn ep(n: u8) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(192, 0, 2, n), 51820))
}

/// Host `n`'s peer entry: 10.244.n.0/24 and fd00:10:244:n::/64 at 192.0.2.n:51820.
fn config(key: WgPublicKey, n: u8) -> PeerConfig {
    PeerConfig {
        key,
        endpoint: ep(n),
        subnet: format!("10.244.{n}.0/24").parse().unwrap(),
        ipv6: Some(format!("fd00:10:244:{n}::/64").parse().unwrap()),
        epoch: 0,
    }
}

/// An IPv4/UDP packet from `src` to `dst` with `payload` bytes of `fill`.
fn ip4(src: [u8; 4], dst: [u8; 4], payload: usize, fill: u8) -> Vec<u8> {
    let total = 28 + payload;
    let mut p = vec![0x45, 0, (total >> 8) as u8, total as u8, 0, 0, 0x40, 0, 64, 17, 0, 0];
    p.extend_from_slice(&src);
    p.extend_from_slice(&dst);
    p.extend_from_slice(&[0x13, 0x88, 0x13, 0x89, ((8 + payload) >> 8) as u8, (8 + payload) as u8]);
    p.extend_from_slice(&[0, 0]);
    p.resize(total, fill);
    p
}

/// An IPv6/UDP packet from `src` with `payload` bytes.
fn ip6(src: Ipv6Addr, payload: usize) -> Vec<u8> {
    let len = 8 + payload;
    let mut p = vec![0x60, 0, 0, 0, (len >> 8) as u8, len as u8, 17, 64];
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&"fd00:10:244:1::7".parse::<Ipv6Addr>().unwrap().octets());
    p.resize(40 + len, 0xab);
    p
}

struct Pair {
    a: Sessions,
    b: Sessions,
    a_key: WgPublicKey,
    b_key: WgPublicKey,
}

/// A (host 1) and B (host 2), each knowing the other; no handshake yet.
fn pair() -> Pair {
    let (ka, kb) = (fresh_key(), fresh_key());
    let (a, b) = (Sessions::new(&ka, None, None, MTU), Sessions::new(&kb, None, None, MTU));
    let (a_key, b_key) = (a.public_key(), b.public_key());
    a.set_peers([config(b_key, 2)]);
    b.set_peers([config(a_key, 1)]);
    Pair { a, b, a_key, b_key }
}

/// A packet from host 1 to host 2.
fn a_to_b(fill: u8) -> Vec<u8> {
    ip4([10, 244, 1, 5], [10, 244, 2, 7], 100, fill)
}

fn b_to_a(fill: u8) -> Vec<u8> {
    ip4([10, 244, 2, 7], [10, 244, 1, 5], 61, fill)
}

/// Seals `packet` from `from` to `to_key`, expecting a data message: the datagram.
fn send(from: &Sessions, to_key: &WgPublicKey, packet: &[u8]) -> Vec<u8> {
    let mut out = [0u8; 2048];
    match from.seal(to_key, packet, &mut out) {
        Sealed::Send { len, .. } => out[..len].to_vec(),
        other => panic!("not sent: {other:?}"),
    }
}

/// Opens `datagram` at `at`, expecting an inner packet: it.
fn receive(at: &Sessions, from: SocketAddr, datagram: &[u8]) -> Vec<u8> {
    let mut out = [0u8; 2048];
    match at.open(from, datagram, &mut out) {
        Opened::Deliver { range, .. } => out[range].to_vec(),
        other => panic!("not delivered: {other:?}"),
    }
}

/// A's first packet starts the handshake; B answers; A confirms. Returns the pair with A's
/// queued packets (`a_to_b(1)`, `a_to_b(2)`) still in A's queue.
fn handshaken() -> Pair {
    let p = pair();
    let mut out = [0u8; 2048];
    let Sealed::Handshake { to, len } = p.a.seal(&p.b_key, &a_to_b(1), &mut out) else {
        panic!("no handshake")
    };
    assert_eq!((to, len), (ep(2), HANDSHAKE_INIT_LEN));
    let init = out[..len].to_vec();
    assert_eq!(p.a.seal(&p.b_key, &a_to_b(2), &mut out), Sealed::Queued);

    let Opened::Reply { to, len, peer } = p.b.open(ep(1), &init, &mut out) else {
        panic!("no response")
    };
    assert_eq!((to, len, peer), (ep(1), HANDSHAKE_RESPONSE_LEN, p.a_key));
    let response = out[..len].to_vec();
    assert_eq!(p.b.drain(&p.a_key, &mut out), None, "B queued nothing");

    let Opened::Reply { to, len, peer } = p.a.open(ep(2), &response, &mut out) else {
        panic!("no confirmation")
    };
    assert_eq!((to, len, peer), (ep(2), OVERHEAD, p.b_key), "a keepalive");
    let keepalive = out[..len].to_vec();
    assert_eq!(p.b.open(ep(1), &keepalive, &mut out), Opened::Consumed { peer: p.a_key });
    p
}

#[test]
fn the_first_packet_handshakes_then_the_queue_drains_and_data_flows_both_ways() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    let mut drained = Vec::new();
    while let Some((to, len)) = p.a.drain(&p.b_key, &mut out) {
        assert_eq!(to, ep(2));
        drained.push(receive(&p.b, ep(1), &out[..len]));
    }
    assert_eq!(drained, [a_to_b(1), a_to_b(2)], "in order");

    // Both ways now, no handshake.
    for fill in 3..6 {
        let d = send(&p.a, &p.b_key, &a_to_b(fill));
        // 128 bytes pad to 128: header, packet, tag.
        assert_eq!(d.len(), sealed_len(128, MTU));
        assert_eq!(receive(&p.b, ep(1), &d), a_to_b(fill));
        let d = send(&p.b, &p.a_key, &b_to_a(fill));
        // 89 bytes pad to 96, and the padding is not delivered.
        assert_eq!(d.len(), OVERHEAD + 96);
        assert_eq!(receive(&p.a, ep(2), &d), b_to_a(fill));
    }
    // IPv6 inside the sender's half.
    let v6 = ip6("fd00:10:244:2::9".parse().unwrap(), 33);
    assert_eq!(receive(&p.a, ep(2), &send(&p.b, &p.a_key, &v6)), v6);
}

#[test]
fn padding_stops_at_the_mtu() {
    assert_eq!(padded_len(1, 1420), 16);
    assert_eq!(padded_len(16, 1420), 16);
    assert_eq!(padded_len(1419, 1420), 1420);
    assert_eq!(padded_len(1420, 1420), 1420);
    assert_eq!(padded_len(1500, 1420), 1500, "never shorter than the packet");
    assert_eq!(sealed_len(1420, 1420), 1420 + OVERHEAD);
    assert!(padded_len(1000, 1420) - 1000 <= MAX_PADDING);
}

#[test]
fn a_replayed_data_message_is_dropped_as_replay() {
    let p = handshaken();
    let d = send(&p.a, &p.b_key, &a_to_b(9));
    let mut out = [0u8; 2048];
    assert!(matches!(p.b.open(ep(1), &d, &mut out), Opened::Deliver { .. }));
    assert_eq!(p.b.open(ep(1), &d, &mut out), Opened::Drop(DropReason::RxWgReplay));
    // Out of order within the window is fine; each once.
    let (d1, d2) = (send(&p.a, &p.b_key, &a_to_b(1)), send(&p.a, &p.b_key, &a_to_b(2)));
    assert_eq!(receive(&p.b, ep(1), &d2), a_to_b(2));
    assert_eq!(receive(&p.b, ep(1), &d1), a_to_b(1));
    assert_eq!(p.b.open(ep(1), &d1, &mut out), Opened::Drop(DropReason::RxWgReplay));
}

#[test]
fn a_flipped_bit_anywhere_is_refused() {
    let p = handshaken();
    let d = send(&p.a, &p.b_key, &a_to_b(4));
    let mut out = [0u8; 2048];
    for bit in 0..d.len() * 8 {
        let mut bad = d.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let opened = p.b.open(ep(1), &bad, &mut out);
        let expected = match bit / 8 {
            // The type, then the reserved bytes.
            0..4 => DropReason::RxWgMalformed,
            // The receiver index: no session of ours.
            4..8 => DropReason::RxWgNoSession,
            // The counter (this message's is 1, after the keepalive's 0): to 0, a replay.
            8 if bit % 8 == 0 => DropReason::RxWgReplay,
            // Any other counter (the nonce), the ciphertext, the tag.
            _ => DropReason::RxWgDecrypt,
        };
        assert_eq!(opened, Opened::Drop(expected), "bit {bit}");
    }
    // The message itself is still good (nothing above used up its counter).
    assert_eq!(receive(&p.b, ep(1), &d), a_to_b(4));
}

#[test]
fn garbage_and_truncated_datagrams_are_dropped() {
    let p = handshaken();
    let d = send(&p.a, &p.b_key, &a_to_b(4));
    let mut out = [0u8; 2048];
    let malformed: Vec<Vec<u8>> = vec![
        vec![],
        vec![4],
        vec![4, 0, 0, 0],
        d[..OVERHEAD - 1].to_vec(),
        vec![1; HANDSHAKE_INIT_LEN],
        vec![0; 200],
        vec![5, 0, 0, 0, 1, 2, 3, 4],
        [&[1, 0, 0, 0][..], &[0; HANDSHAKE_INIT_LEN - 5]].concat(),
        [&[2, 0, 0, 0][..], &[0; HANDSHAKE_RESPONSE_LEN + 1]].concat(),
        [&[3, 0, 0, 0][..], &[0; COOKIE_REPLY_LEN - 1]].concat(),
    ];
    for g in &malformed {
        assert_eq!(p.b.open(ep(1), g, &mut out), Opened::Drop(DropReason::RxWgMalformed), "{g:?}");
    }
    // Shaped right, but forged: a bad mac1 on an initiation, no session for the others.
    let mut init = vec![0u8; HANDSHAKE_INIT_LEN];
    init[0] = 1;
    assert_eq!(p.b.open(ep(1), &init, &mut out), Opened::Drop(DropReason::RxWgDecrypt));
    let mut resp = vec![0u8; HANDSHAKE_RESPONSE_LEN];
    resp[0] = 2;
    assert_eq!(p.b.open(ep(1), &resp, &mut out), Opened::Drop(DropReason::RxWgNoSession));
    let mut cookie = vec![0u8; COOKIE_REPLY_LEN];
    cookie[0] = 3;
    assert_eq!(p.b.open(ep(1), &cookie, &mut out), Opened::Drop(DropReason::RxWgNoSession));
    // A data message cut short by a byte, or with a byte more: the tag no longer checks.
    for bad in [d[..d.len() - 1].to_vec(), [&d[..], &[0u8][..]].concat()] {
        assert_eq!(p.b.open(ep(1), &bad, &mut out), Opened::Drop(DropReason::RxWgDecrypt));
    }
    // Pseudo-random garbage of every length up to 300, with each type byte in front.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for len in 0..300 {
        for kind in 0..6u8 {
            let mut g: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            if let Some(first) = g.first_mut() {
                *first = kind;
            }
            assert!(matches!(p.b.open(ep(1), &g, &mut out), Opened::Drop(_)), "{g:?}");
        }
    }
    // Still talking.
    assert_eq!(receive(&p.b, ep(1), &d), a_to_b(4));
}

#[test]
fn an_inner_source_outside_the_peers_networks_is_spoofed() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    for packet in [
        // Host 3's subnet, from host 2.
        ip4([10, 244, 3, 7], [10, 244, 1, 5], 10, 0),
        // Host 1's own subnet, reflected.
        ip4([10, 244, 1, 9], [10, 244, 1, 5], 10, 0),
        ip4([8, 8, 8, 8], [10, 244, 1, 5], 10, 0),
        ip6("fd00:10:244:3::9".parse().unwrap(), 10),
    ] {
        let d = send(&p.b, &p.a_key, &packet);
        assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxSpoofedSource));
    }
    // Authenticated, but not IP inside.
    let d = send(&p.b, &p.a_key, &[0x17; 40]);
    assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxMalformed));
    let mut short = b_to_a(0);
    // Its total length past the end, even counting the padding.
    short[3] += 20;
    let d = send(&p.b, &p.a_key, &short[..short.len() - 1]);
    assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxMalformed));
}

#[test]
fn a_new_key_for_a_peer_handshakes_afresh_and_traffic_flows() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    // B restarts with a new key; A's route table follows its lease.
    let b2 = Sessions::new(&fresh_key(), None, None, MTU);
    b2.set_peers([config(p.a_key, 1)]);
    let b2_key = b2.public_key();
    p.a.set_peers([config(b2_key, 2)]);
    assert_eq!(p.a.seal(&p.b_key, &a_to_b(1), &mut out), Sealed::Drop(DropReason::TxWgUnknownPeer));
    // The old key's session is gone: its data is for no session now.
    let old = send(&p.b, &p.a_key, &b_to_a(1));
    assert_eq!(p.a.open(ep(2), &old, &mut out), Opened::Drop(DropReason::RxWgNoSession));

    let Sealed::Handshake { len, .. } = p.a.seal(&b2_key, &a_to_b(7), &mut out) else {
        panic!("no fresh handshake")
    };
    // The old B does not know who this is (it is not for its key): mac1 fails.
    let init = out[..len].to_vec();
    assert_eq!(p.b.open(ep(1), &init, &mut out), Opened::Drop(DropReason::RxWgDecrypt));
    let Opened::Reply { len, .. } = b2.open(ep(1), &init, &mut out) else { panic!("no response") };
    let response = out[..len].to_vec();
    let Opened::Reply { len, .. } = p.a.open(ep(2), &response, &mut out) else {
        panic!("no confirmation")
    };
    let keepalive = out[..len].to_vec();
    assert!(matches!(b2.open(ep(1), &keepalive, &mut out), Opened::Consumed { .. }));
    let (to, len) = p.a.drain(&b2_key, &mut out).unwrap();
    assert_eq!(to, ep(2));
    let queued = out[..len].to_vec();
    assert_eq!(receive(&b2, ep(1), &queued), a_to_b(7));
    assert_eq!(receive(&p.a, ep(2), &send(&b2, &p.a_key, &b_to_a(2))), b_to_a(2));
}

#[test]
fn a_handshake_from_a_key_we_do_not_know_is_refused() {
    let p = handshaken();
    let stranger = Sessions::new(&fresh_key(), None, None, MTU);
    stranger.set_peers([config(p.a_key, 3)]);
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = stranger.seal(&p.a_key, &a_to_b(0), &mut out) else {
        panic!("no handshake")
    };
    let init = out[..len].to_vec();
    assert_eq!(p.a.open(ep(3), &init, &mut out), Opened::Drop(DropReason::RxWgUnknownPeer));
    // A replayed initiation from a known peer is refused by its timestamp.
    let q = pair();
    let Sealed::Handshake { len, .. } = q.a.seal(&q.b_key, &a_to_b(0), &mut out) else {
        panic!("no handshake")
    };
    let init = out[..len].to_vec();
    assert!(matches!(q.b.open(ep(1), &init, &mut out), Opened::Reply { .. }));
    assert_eq!(q.b.open(ep(1), &init, &mut out), Opened::Drop(DropReason::RxWgReplay));
}

#[test]
fn an_endpoint_change_is_used_by_the_next_seal_and_the_session_is_kept() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    let moved = SocketAddr::from((Ipv4Addr::new(198, 51, 100, 2), 51821));
    p.a.set_peers([PeerConfig { endpoint: moved, ..config(p.b_key, 2) }]);
    let Sealed::Send { to, len } = p.a.seal(&p.b_key, &a_to_b(3), &mut out) else {
        panic!("the session was not kept")
    };
    assert_eq!(to, moved);
    assert_eq!(receive(&p.b, moved, &out[..len]), a_to_b(3));
    // A datagram from elsewhere does not move it back (no roaming).
    let d = send(&p.b, &p.a_key, &b_to_a(1));
    assert_eq!(receive(&p.a, ep(9), &d), b_to_a(1));
    assert!(
        matches!(p.a.seal(&p.b_key, &a_to_b(3), &mut out), Sealed::Send { to, .. } if to == moved)
    );
    assert_eq!(p.a.peers(), [PeerConfig { endpoint: moved, ..config(p.b_key, 2) }]);
}

#[test]
fn a_removed_peer_is_forgotten() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    let d = send(&p.b, &p.a_key, &b_to_a(1));
    p.a.set_peers([]);
    assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxWgNoSession));
    assert_eq!(p.a.seal(&p.b_key, &a_to_b(1), &mut out), Sealed::Drop(DropReason::TxWgUnknownPeer));
    assert_eq!(p.a.drain(&p.b_key, &mut out), None);
    assert!(p.a.peers().is_empty());
    // Our own key in a snapshot is not a peer.
    p.a.set_peers([config(p.a_key, 1)]);
    assert!(p.a.peers().is_empty());
}

#[test]
fn a_flood_of_handshakes_from_one_source_is_answered_with_cookies() {
    let p = pair();
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = p.a.seal(&p.b_key, &a_to_b(0), &mut out) else {
        panic!("no handshake")
    };
    let init = out[..len].to_vec();
    let mut refused = 0;
    for i in 0..HANDSHAKES_PER_SOURCE_PER_SEC + 5 {
        match p.b.open(ep(1), &init, &mut out) {
            Opened::Reply { .. } => assert_eq!(i, 0),
            Opened::Drop(DropReason::RxWgReplay) => assert!(i < HANDSHAKES_PER_SOURCE_PER_SEC),
            Opened::Refuse { to, len, reason } => {
                assert_eq!((to, len, reason), (ep(1), COOKIE_REPLY_LEN, DropReason::RxWgUnderLoad));
                refused += 1;
                // A takes the cookie for its handshake.
                let cookie = out[..len].to_vec();
                assert_eq!(p.a.open(ep(2), &cookie, &mut out), Opened::Consumed { peer: p.b_key });
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(refused, 5);
    // Another source is not under load.
    let other = SocketAddr::from((Ipv4Addr::new(192, 0, 2, 77), 51820));
    assert_eq!(p.b.open(other, &init, &mut out), Opened::Drop(DropReason::RxWgReplay));
}

#[test]
fn a_different_preshared_key_never_completes_the_handshake() {
    let (ka, kb) = (fresh_key(), fresh_key());
    let a = Sessions::new(&ka, Some(WgSecret::from_bytes([1; 32])), None, MTU);
    let b = Sessions::new(&kb, Some(WgSecret::from_bytes([2; 32])), None, MTU);
    a.set_peers([config(b.public_key(), 2)]);
    b.set_peers([config(a.public_key(), 1)]);
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = a.seal(&b.public_key(), &a_to_b(0), &mut out) else {
        panic!("no handshake")
    };
    let init = out[..len].to_vec();
    // The responder cannot tell (the PSK enters after the initiation); the initiator can.
    let Opened::Reply { len, .. } = b.open(ep(1), &init, &mut out) else { panic!("no response") };
    let response = out[..len].to_vec();
    assert_eq!(a.open(ep(2), &response, &mut out), Opened::Drop(DropReason::RxWgDecrypt));
}

#[test]
fn buffers_too_small_are_drops_not_panics() {
    let p = handshaken();
    let packet = a_to_b(1);
    for len in [0, 1, OVERHEAD, HANDSHAKE_INIT_LEN - 1, sealed_len(packet.len(), MTU) - 1] {
        let mut out = vec![0u8; len];
        assert_eq!(p.a.seal(&p.b_key, &packet, &mut out), Sealed::Drop(DropReason::TxMalformed));
    }
    assert_eq!(p.a.seal(&p.b_key, &[], &mut [0u8; 2048]), Sealed::Drop(DropReason::TxMalformed));
    let d = send(&p.a, &p.b_key, &packet);
    let mut tiny = [0u8; 20];
    assert_eq!(p.b.open(ep(1), &d, &mut tiny), Opened::Drop(DropReason::RxTruncated));
}

#[test]
fn what_tick_emits_the_peer_accepts() {
    let (ka, kb) = (fresh_key(), fresh_key());
    // A with a persistent keepalive.
    let a = Sessions::new(&ka, None, Some(1), MTU);
    let b = Sessions::new(&kb, None, None, MTU);
    a.set_peers([config(b.public_key(), 2)]);
    b.set_peers([config(a.public_key(), 1)]);
    let mut out = [0u8; 2048];
    let mut emitted = Vec::new();
    a.tick(|to, d| emitted.push((to, d.to_vec())));
    b.tick(|to, d| emitted.push((to, d.to_vec())));
    for (to, d) in emitted {
        assert_eq!(to, ep(2));
        let opened = b.open(ep(1), &d, &mut out);
        assert!(!matches!(opened, Opened::Drop(_)), "{opened:?}");
    }
}

#[test]
fn sessions_are_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Sessions>();
    let p = handshaken();
    let b_key = p.b_key;
    let datagrams: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                let a = &p.a;
                s.spawn(move || {
                    (0..50).map(|i| send(a, &b_key, &a_to_b(t * 50 + i))).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut out = [0u8; 2048];
    let delivered =
        datagrams.iter().filter(|d| matches!(p.b.open(ep(1), d, &mut out), Opened::Deliver { .. }));
    assert_eq!(delivered.count(), 200, "every counter used once");
}

#[test]
fn a_kept_peer_takes_its_new_networks_and_the_last_entry_of_a_key_wins() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    let from_3 = ip4([10, 244, 3, 7], [10, 244, 1, 5], 10, 0);
    let d = send(&p.b, &p.a_key, &from_3);
    assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxSpoofedSource));
    // B's lease now names 10.244.3.0/24 (the entry before it, with the old subnet, loses).
    let moved = PeerConfig { subnet: "10.244.3.0/24".parse().unwrap(), ..config(p.b_key, 2) };
    p.a.set_peers([config(p.b_key, 2), moved]);
    assert_eq!(p.a.peers(), [moved]);
    let d = send(&p.b, &p.a_key, &from_3);
    assert_eq!(receive(&p.a, ep(2), &d), from_3, "same session, new networks");
    let d = send(&p.b, &p.a_key, &b_to_a(1));
    assert_eq!(p.a.open(ep(2), &d, &mut out), Opened::Drop(DropReason::RxSpoofedSource));
}

/// Runs datagrams between A (host 1) and B (host 2) until none is left, each side doing what
/// the receive loop does: deliver, answer, and drain a peer's queue after a reply, a keepalive
/// and a delivery that says so. Returns what each delivered.
fn exchange(p: &Pair, mut wire: Vec<(u8, Vec<u8>)>) -> [Vec<Vec<u8>>; 2] {
    let mut delivered = [Vec::new(), Vec::new()];
    let mut out = [0u8; 2048];
    let mut steps = 0;
    while !wire.is_empty() {
        steps += 1;
        assert!(steps < 100, "the exchange does not end");
        let (to_host, datagram) = wire.remove(0);
        let (at, from, peer_key, back) =
            if to_host == 2 { (&p.b, ep(1), p.a_key, 1) } else { (&p.a, ep(2), p.b_key, 2) };
        let drain = match at.open(from, &datagram, &mut out) {
            Opened::Deliver { range, drain, .. } => {
                delivered[usize::from(to_host - 1)].push(out[range].to_vec());
                drain
            }
            Opened::Reply { len, .. } => {
                wire.push((back, out[..len].to_vec()));
                true
            }
            Opened::Consumed { .. } => true,
            other => panic!("{other:?}"),
        };
        while drain && let Some((_, len)) = at.drain(&peer_key, &mut out) {
            wire.push((back, out[..len].to_vec()));
        }
    }
    delivered
}

/// Both sides send their first packet at once: two initiations cross, each side answers the
/// other's and holds its packet until a session is confirmed; both packets arrive.
#[test]
fn crossing_handshakes_lose_no_queued_packet() {
    let p = pair();
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = p.a.seal(&p.b_key, &a_to_b(1), &mut out) else {
        panic!("A: no handshake")
    };
    let init_a = out[..len].to_vec();
    let Sealed::Handshake { len, .. } = p.b.seal(&p.a_key, &b_to_a(2), &mut out) else {
        panic!("B: no handshake")
    };
    let init_b = out[..len].to_vec();
    let [at_a, at_b] = exchange(&p, vec![(2, init_a), (1, init_b)]);
    assert_eq!((at_a, at_b), (vec![b_to_a(2)], vec![a_to_b(1)]));
}

/// B answered A's initiation: what B seals waits until A confirms the session (its keepalive
/// or data), as the kernel and wireguard-go wait; then B's drain sends it.
#[test]
fn a_responder_sends_no_data_before_the_initiator_confirms() {
    let p = pair();
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = p.a.seal(&p.b_key, &a_to_b(1), &mut out) else {
        panic!("no handshake")
    };
    let init = out[..len].to_vec();
    let Opened::Reply { len, .. } = p.b.open(ep(1), &init, &mut out) else { panic!("no response") };
    let response = out[..len].to_vec();
    assert_eq!(p.b.drain(&p.a_key, &mut out), None);
    assert_eq!(p.b.seal(&p.a_key, &b_to_a(2), &mut out), Sealed::Queued, "B sent unconfirmed");
    assert_eq!(p.b.drain(&p.a_key, &mut out), None, "B drained unconfirmed");
    let Opened::Reply { len, .. } = p.a.open(ep(2), &response, &mut out) else {
        panic!("no keepalive")
    };
    let keepalive = out[..len].to_vec();
    let Some((_, len)) = p.a.drain(&p.b_key, &mut out) else { panic!("A's queue is empty") };
    let data = out[..len].to_vec();
    // B takes A's data first here: confirmed by it, and told to drain what it holds.
    let Opened::Deliver { range, drain: true, .. } = p.b.open(ep(1), &data, &mut out) else {
        panic!("not delivered with a drain")
    };
    assert_eq!(out[range].to_vec(), a_to_b(1));
    let Some((_, len)) = p.b.drain(&p.a_key, &mut out) else { panic!("B held nothing") };
    assert_eq!(receive(&p.a, ep(2), &out[..len]), b_to_a(2));
    assert_eq!(p.b.drain(&p.a_key, &mut out), None);
    assert_eq!(p.b.open(ep(1), &keepalive, &mut out), Opened::Consumed { peer: p.a_key });
}

/// A peer whose lease comes from a new process of it (a new epoch) restarted and forgot its
/// sessions: ours goes too, and the next packet starts a handshake instead of being sealed
/// for a session the peer no longer has. The same epoch keeps the session.
#[test]
fn a_restarted_peer_gets_a_fresh_session() {
    let p = handshaken();
    let mut out = [0u8; 2048];
    p.a.set_peers([config(p.b_key, 2)]);
    assert!(matches!(p.a.seal(&p.b_key, &a_to_b(3), &mut out), Sealed::Send { .. }));
    p.a.set_peers([PeerConfig { epoch: 7, ..config(p.b_key, 2) }]);
    assert!(
        matches!(p.a.seal(&p.b_key, &a_to_b(4), &mut out), Sealed::Handshake { .. }),
        "sealed for the forgotten session"
    );
}

/// A takeover: a worker of the new process sealed a packet before its predecessor let go of
/// the sockets, so it started a handshake whose response the predecessor read (lost here).
/// `initiate_all` after the release starts a fresh one, not "one is under way" (which gotatun
/// would retry only after 5 s), and its response completes it.
#[test]
fn initiate_all_starts_afresh_when_a_response_was_lost() {
    let p = pair();
    let mut out = [0u8; 2048];
    let Sealed::Handshake { len, .. } = p.a.seal(&p.b_key, &a_to_b(1), &mut out) else {
        panic!("no handshake")
    };
    let first = out[..len].to_vec();
    assert!(matches!(p.b.open(ep(1), &first, &mut out), Opened::Reply { .. }), "answered; lost");

    let mut sent = Vec::new();
    p.a.initiate_all(|to, d| sent.push((to, d.to_vec())));
    assert_eq!(sent.len(), 1, "a fresh initiation though one was under way");
    let (to, init) = &sent[0];
    assert_eq!((*to, init.len()), (ep(2), HANDSHAKE_INIT_LEN));
    assert_ne!(init, &first);
    let Opened::Reply { len, .. } = p.b.open(ep(1), init, &mut out) else { panic!("no response") };
    let response = out[..len].to_vec();
    let Opened::Reply { len, .. } = p.a.open(ep(2), &response, &mut out) else {
        panic!("the fresh handshake did not complete")
    };
    let keepalive = out[..len].to_vec();
    assert_eq!(p.b.open(ep(1), &keepalive, &mut out), Opened::Consumed { peer: p.a_key });
    let (_, len) = p.a.drain(&p.b_key, &mut out).expect("the queued packet goes");
    assert_eq!(receive(&p.b, ep(1), &out[..len]), a_to_b(1));
}

/// Host `n`'s route as a dual-stack flannel wireguard lease has it: 10.244.n.0/24 at
/// 192.0.2.n:51820, its IPv6 half fd00:10:244:n::/64 at [2001:db8::n] with `port6`.
fn dual_route(key: WgPublicKey, n: u8, port6: Option<u16>) -> crate::route::Peer {
    use crate::route::{Peer, Peer6, PeerBackend, Wireguard6};
    Peer {
        subnet: format!("10.244.{n}.0/24").parse().unwrap(),
        public_ip: Ipv4Addr::new(192, 0, 2, n),
        backend: PeerBackend::Wireguard { key, port: Some(51820) },
        vtep_mac: None,
        vni: None,
        node: None,
        incarnation: None,
        stale: false,
        ipv6: Some(Peer6 {
            subnet: format!("fd00:10:244:{n}::/64").parse().unwrap(),
            public_ip: format!("2001:db8::{n}").parse().unwrap(),
            vtep_mac: crate::vocab::MacAddr([0; 6]),
            wireguard: Some(Wireguard6 { key, port: port6 }),
        }),
    }
}

/// flannel's `Mode` separate: each host's two devices on one key get the route table's peers
/// per family (the IPv4 one: `PublicIP:Port`, the IPv4 subnet; the IPv6 one:
/// `[PublicIPv6]:BackendV6Data.Port`, ours when none, the IPv6 half), hand-shake apart, and an
/// IPv6 packet goes by the IPv6 device; the same packet sealed by the IPv4 device is refused on
/// arrival, as flannel's IPv4 device (allowed the IPv4 subnet alone) refuses it.
#[test]
fn separate_mode_devices_keep_one_session_per_family() {
    use crate::route::RouteTable;
    let (ka, kb) = (fresh_key(), fresh_key());
    let a = Devices::new(&ka, None, None, MTU, 51820, Some(51821));
    let b = Devices::new(&kb, None, None, MTU, 51820, Some(51821));
    let (a_key, b_key) = (a.v4.public_key(), b.v4.public_key());
    assert_eq!(a.v6.as_ref().map(Sessions::public_key), Some(a_key), "one key for both");
    let table = |peer| RouteTable::build("10.244.0.0/16".parse().unwrap(), 24, [peer]);
    a.set_peers_of(&table(dual_route(b_key, 2, Some(51821))));
    // B's lease names no IPv6 port for A: our ListenPortV6.
    b.set_peers_of(&table(dual_route(a_key, 1, None)));
    let v6_ep =
        |n: u8| SocketAddr::from((format!("2001:db8::{n}").parse::<Ipv6Addr>().unwrap(), 51821));
    assert_eq!(
        a.v4.peers(),
        [PeerConfig { ipv6: None, ..config(b_key, 2) }],
        "the IPv4 device: PublicIP:Port, the IPv4 subnet"
    );
    let v6_peers = a.v6.as_ref().unwrap().peers();
    assert_eq!(v6_peers.len(), 1);
    assert_eq!((v6_peers[0].key, v6_peers[0].endpoint), (b_key, v6_ep(2)));
    assert_eq!(
        v6_peers[0].subnet,
        Subnet::from("fd00:10:244:2::/64".parse::<Ipv6Subnet>().unwrap())
    );
    assert_eq!(b.v6.as_ref().unwrap().peers()[0].endpoint, v6_ep(1));
    // Each family's datagrams go to that family's device.
    assert!(std::ptr::eq(a.of(v6_ep(2)), a.v6.as_ref().unwrap()));
    assert!(std::ptr::eq(a.of(ep(2)), &a.v4));
    assert_eq!(a.port6(), 51821);

    // An IPv6 packet from A's half: sealed by A's IPv6 device, a handshake over IPv6 first.
    let packet = ip6("fd00:10:244:1::5".parse().unwrap(), 40);
    let mut out = [0u8; 2048];
    let (a6, b6) = (a.of(v6_ep(2)), b.of(v6_ep(1)));
    let Sealed::Handshake { to, len } = a6.seal(&b_key, &packet, &mut out) else { panic!() };
    assert_eq!(to, v6_ep(2));
    let init = out[..len].to_vec();
    let Opened::Reply { to, len, .. } = b6.open(v6_ep(1), &init, &mut out) else { panic!() };
    assert_eq!(to, v6_ep(1));
    let response = out[..len].to_vec();
    let Opened::Reply { len, .. } = a6.open(v6_ep(2), &response, &mut out) else { panic!() };
    let keepalive = out[..len].to_vec();
    assert_eq!(b6.open(v6_ep(1), &keepalive, &mut out), Opened::Consumed { peer: a_key });
    let Some((to, len)) = a6.drain(&b_key, &mut out) else { panic!("the packet waited") };
    assert_eq!(to, v6_ep(2));
    let sealed = out[..len].to_vec();
    assert_eq!(receive(b6, v6_ep(1), &sealed), packet);
    // The IPv4 devices have no session: that handshake was the IPv6 devices' alone.
    let mut out4 = [0u8; 2048];
    assert!(matches!(a.v4.seal(&b_key, &a_to_b(1), &mut out4), Sealed::Handshake { .. }));
    // The IPv6 packet over the IPv4 devices (once they hand-shake) is refused: the IPv4
    // device allows the IPv4 subnet alone.
    let init = out4[..HANDSHAKE_INIT_LEN].to_vec();
    let Opened::Reply { len, .. } = b.v4.open(ep(1), &init, &mut out4) else { panic!() };
    let response = out4[..len].to_vec();
    let Opened::Reply { len, .. } = a.v4.open(ep(2), &response, &mut out4) else { panic!() };
    let keepalive = out4[..len].to_vec();
    assert_eq!(b.v4.open(ep(1), &keepalive, &mut out4), Opened::Consumed { peer: a_key });
    while a.v4.drain(&b_key, &mut out4).is_some() {}
    let v6_over_v4 = send(&a.v4, &b_key, &packet);
    assert_eq!(b.v4.open(ep(1), &v6_over_v4, &mut out4), Opened::Drop(DropReason::RxSpoofedSource));
    assert_eq!(receive(&b.v4, ep(1), &send(&a.v4, &b_key, &a_to_b(3))), a_to_b(3));
}
