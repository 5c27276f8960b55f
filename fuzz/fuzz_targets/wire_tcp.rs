//! tcp::Packet: accessors, setters, checksum fill then verify (v4, v6).
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::tcp;

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
    let Ok(p) = tcp::Packet::new_checked(bytes) else { return };
    let _ = (p.src_port(), p.dst_port(), p.seq_number(), p.ack_number(), p.flags());
    let _ = (p.window_len(), p.checksum(), p.urgent_at());
    let _ = (p.verify_checksum_v4(s4, d4), p.verify_checksum_v6(s6, d6));
    let hl = usize::from(p.header_len());
    assert!(hl >= tcp::HEADER_LEN && hl <= bytes.len());
    assert_eq!(p.options().len(), hl - tcp::HEADER_LEN);
    assert_eq!(p.payload().len(), bytes.len() - hl);

    let mut buf = bytes.to_vec();
    let mut m = tcp::Packet::new_checked(&mut buf[..]).expect("same bytes");
    m.set_src_port(1);
    m.set_dst_port(2);
    m.set_seq_number(3);
    m.set_ack_number(4);
    m.set_flags(tcp::ACK | tcp::PSH);
    m.set_window_len(5);
    m.set_urgent_at(6);
    m.options_mut().fill(1);
    m.payload_mut().fill(7);
    let fits = bytes.len() <= usize::from(u16::MAX);
    assert_eq!(m.fill_checksum_v4(s4, d4).is_ok(), fits);
    if fits {
        assert!(m.verify_checksum_v4(s4, d4), "filled v4 checksum does not verify");
    }
    if m.fill_checksum_v6(s6, d6).is_ok() {
        assert!(m.verify_checksum_v6(s6, d6), "filled v6 checksum does not verify");
    }
    assert_eq!(usize::from(m.header_len()), hl);
});
