//! udp::Packet and Repr: accessors, parse/emit round trip, checksum fill then verify (v4, v6).
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{Error, udp};

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let (Ok(s4), Ok(d4), Ok(s6), Ok(d6)) = (
        <[u8; 4]>::arbitrary(&mut u),
        <[u8; 4]>::arbitrary(&mut u),
        <[u8; 16]>::arbitrary(&mut u),
        <[u8; 16]>::arbitrary(&mut u),
    ) else {
        return;
    };
    let (s4, d4, s6, d6) =
        (Ipv4Addr::from(s4), Ipv4Addr::from(d4), Ipv6Addr::from(s6), Ipv6Addr::from(d6));
    let bytes = u.take_rest();
    let Ok(p) = udp::Packet::new_checked(bytes) else { return };
    let _ = (p.src_port(), p.dst_port(), p.is_empty(), p.checksum());
    let _ = (p.verify_checksum_v4(s4, d4), p.verify_checksum_v6(s6, d6));
    assert_eq!(p.datagram().len(), usize::from(p.len()));
    assert_eq!(p.payload().len() + udp::HEADER_LEN, usize::from(p.len()));

    let repr = udp::Repr::parse(&p).expect("a checked datagram parses");
    let mut out = vec![0xa5u8; repr.buffer_len()];
    assert_eq!(repr.emit(&mut out), Ok(udp::HEADER_LEN));
    out[udp::HEADER_LEN..].copy_from_slice(p.payload());
    let mut q = udp::Packet::new_checked(&mut out[..]).expect("emitted datagram checks");
    assert_eq!(udp::Repr::parse(&q), Ok(repr));
    assert_eq!(q.checksum(), 0);
    assert!(q.verify_checksum_v4(s4, d4), "zero checksum verifies over IPv4");
    q.fill_checksum_v4(s4, d4);
    assert!(q.verify_checksum_v4(s4, d4), "filled v4 checksum does not verify");
    q.fill_checksum_v6(s6, d6);
    assert!(q.verify_checksum_v6(s6, d6), "filled v6 checksum does not verify");
    assert_ne!(q.checksum(), 0);
    let mut small = [0u8; udp::HEADER_LEN - 1];
    assert_eq!(repr.emit(&mut small), Err(Error::BufferTooSmall));

    let mut buf = bytes.to_vec();
    let mut m = udp::Packet::new_checked(&mut buf[..]).expect("same bytes");
    m.set_src_port(1);
    m.set_dst_port(2);
    m.set_checksum(3);
    m.payload_mut().fill(0);
});
