//! The wireguard receive path: `Sessions::open` on a core (A) that has one established session
//! with its peer (B), fed arbitrary datagrams: raw bytes, B's real data messages with bytes
//! flipped or cut, and B's real handshake initiations likewise; and key parsing.
//!
//! Invariants: nothing panics; a Deliver lies inside `out`, is an IPv4 or IPv6 packet of
//! exactly its length from inside B's networks; a reply or cookie fits `out` and goes back to
//! the datagram's source; an untouched data message from B is delivered (when its inner packet
//! is one B may send, and B's session is still among A's); a key that parses prints back as
//! it was written.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::transport::wireguard::{
    Opened, PeerConfig, Sealed, Sessions, WgPublicKey, WgSecret,
};
use weft::dataplane::wire::{ipv4, ipv6};

const MTU: u16 = 1420;

#[derive(Arbitrary, Debug)]
enum Datagram {
    /// Bytes as they are.
    Raw(Vec<u8>),
    /// A data message B seals of this inner packet (with a valid IPv4 header from B's subnet
    /// in front when `ip`), then bytes XORed in at offsets, then cut to a length.
    Data { ip: bool, inner: Vec<u8>, flips: Vec<(u16, u8)>, cut: Option<u16> },
    /// A fresh handshake initiation from B's key, mutated the same way.
    Init { flips: Vec<(u16, u8)>, cut: Option<u16> },
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// The source port datagrams come from (the address is B's).
    port: u16,
    datagrams: Vec<Datagram>,
    key: String,
}

fn ep(n: u8, port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(192, 0, 2, n), port))
}

fn config(key: WgPublicKey, n: u8) -> PeerConfig {
    PeerConfig {
        key,
        endpoint: ep(n, 51820),
        subnet: format!("10.244.{n}.0/24").parse().unwrap(),
        ipv6: Some(format!("fd00:10:244:{n}::/64").parse().unwrap()),
        epoch: 0,
    }
}

fn mutate(mut d: Vec<u8>, flips: &[(u16, u8)], cut: Option<u16>) -> Vec<u8> {
    for &(at, x) in flips.iter().take(16) {
        if let Some(b) = d.get_mut(usize::from(at)) {
            *b ^= x;
        }
    }
    if let Some(cut) = cut {
        d.truncate(usize::from(cut));
    }
    d
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    if let Ok(key) = WgPublicKey::parse(&input.key) {
        assert_eq!(key.to_string(), input.key.trim());
    }
    let (ka, kb) = (WgSecret::from_bytes([1; 32]), WgSecret::from_bytes([2; 32]));
    let a = Sessions::new(&ka, None, None, MTU);
    let b = Sessions::new(&kb, None, None, MTU);
    let (a_key, b_key) = (a.public_key(), b.public_key());
    a.set_peers([config(b_key, 2)]);
    b.set_peers([config(a_key, 1)]);
    // The handshake, B initiating: afterwards B's data messages reach A.
    let mut out = vec![0u8; 2048];
    let probe = [0x45, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0, 10, 244, 2, 1, 10, 244, 1, 1];
    let Sealed::Handshake { len, .. } = b.seal(&a_key, &probe, &mut out) else { panic!() };
    let init = out[..len].to_vec();
    let Opened::Reply { len, .. } = a.open(ep(2, 51820), &init, &mut out) else { panic!() };
    let response = out[..len].to_vec();
    let Opened::Reply { len, .. } = b.open(ep(1, 51820), &response, &mut out) else { panic!() };
    let keepalive = out[..len].to_vec();
    assert!(matches!(a.open(ep(2, 51820), &keepalive, &mut out), Opened::Consumed { .. }));

    let from = ep(2, input.port);
    // A keeps 8 sessions per peer: past 7 initiations, B's first session may be gone.
    let mut inits = 0;
    for datagram in input.datagrams.iter().take(16) {
        let (bytes, untouched_ip) = match datagram {
            Datagram::Raw(bytes) => (bytes.clone(), false),
            Datagram::Data { ip, inner, flips, cut } => {
                let mut packet = inner.clone();
                if *ip {
                    let total = (20 + packet.len()).min(usize::from(MTU));
                    let mut head = probe.to_vec();
                    head[2..4].copy_from_slice(&(total as u16).to_be_bytes());
                    packet = [head, packet].concat();
                    packet.truncate(total);
                }
                let mut sealed = vec![0u8; 2048];
                let Sealed::Send { len, .. } = b.seal(&a_key, &packet, &mut sealed) else {
                    continue;
                };
                sealed.truncate(len);
                (mutate(sealed, flips, *cut), *ip && flips.is_empty() && cut.is_none() && inits < 7)
            }
            Datagram::Init { flips, cut } => {
                inits += 1;
                let fresh = Sessions::new(&kb, None, None, MTU);
                fresh.set_peers([config(a_key, 1)]);
                let mut sealed = vec![0u8; 2048];
                let Sealed::Handshake { len, .. } = fresh.seal(&a_key, &probe, &mut sealed) else {
                    panic!("no initiation")
                };
                sealed.truncate(len);
                (mutate(sealed, flips, *cut), false)
            }
        };
        match a.open(from, &bytes, &mut out) {
            Opened::Deliver { range, peer, .. } => {
                assert_eq!(peer, b_key);
                let inner = &out[range];
                let src: IpAddr = if let Ok(ip) = ipv4::Packet::new_checked(inner) {
                    assert_eq!(usize::from(ip.total_len()), inner.len());
                    ip.src_addr().into()
                } else {
                    let ip = ipv6::Packet::new_checked(inner).expect("delivered: IPv4 or IPv6");
                    assert_eq!(ipv6::HEADER_LEN + usize::from(ip.payload_len()), inner.len());
                    ip.src_addr().into()
                };
                let b = config(b_key, 2);
                assert!(
                    b.subnet.contains(src)
                        || matches!(src, IpAddr::V6(s) if b.ipv6.unwrap().net().contains(&s))
                );
            }
            Opened::Reply { to, len, peer } => {
                assert_eq!((to, peer), (from, b_key));
                assert!(len <= out.len());
            }
            Opened::Refuse { to, len, .. } => {
                assert_eq!(to, from);
                assert!(len <= out.len());
            }
            Opened::Consumed { peer } => assert_eq!(peer, b_key),
            Opened::Drop(reason) => {
                assert!(!untouched_ip, "an untouched data message was dropped: {reason:?}")
            }
        }
        while let Some((to, len)) = a.drain(&b_key, &mut out) {
            assert_eq!(to, ep(2, 51820));
            assert!(len <= out.len());
        }
    }
});
