//! ipv4::Packet (checked view, every accessor and setter), Repr parse/emit round trip, the
//! incremental TTL decrement, and the version-agnostic peeks and flow hash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{self, Error, ip, ipv4};

fuzz_target!(|data: &[u8]| {
    let _ = (ip::version(data), ip::src_v4(data), ip::dst_v4(data));
    assert_eq!(wire::flow_hash(data), wire::flow_hash(data));
    check(data);
    // The same bytes with a correct header checksum, to get past Repr::parse's check.
    let mut fixed = data.to_vec();
    if let Ok(mut p) = ipv4::Packet::new_checked(&mut fixed[..]) {
        p.fill_checksum();
        check(&fixed);
    }
});

fn check(data: &[u8]) {
    let Ok(p) = ipv4::Packet::new_checked(data) else { return };
    // check_len passed: no accessor may panic.
    let _ = (p.version(), p.header_len(), p.dscp_ecn(), p.total_len(), p.ident());
    let _ = (p.dont_frag(), p.more_frags(), p.reserved_flag(), p.frag_offset());
    let _ = (p.is_fragment(), p.ttl(), p.hop_limit(), p.protocol(), p.next_header());
    let _ = (p.checksum(), p.src_addr(), p.dst_addr());
    assert_eq!(p.header().len(), usize::from(p.header_len()));
    assert_eq!(p.packet().len(), usize::from(p.total_len()));
    assert_eq!(p.header().len() + p.options().len(), p.header_len() as usize + p.options().len());
    assert_eq!(p.payload().len() + usize::from(p.header_len()), usize::from(p.total_len()));
    let valid = p.verify_checksum();

    // Setters that keep the lengths keep the view valid.
    let mut buf = data.to_vec();
    {
        let mut m = ipv4::Packet::new_checked(&mut buf[..]).expect("same bytes");
        let before = m.ttl();
        let after = m.decrement_ttl_incremental();
        if before > 0 {
            assert_eq!(after, before - 1);
            // RFC 1624: the incremental update keeps a valid checksum valid.
            if valid {
                assert!(m.verify_checksum(), "TTL decrement broke the header checksum");
            }
        }
        m.set_ident(0xbeef);
        m.set_dont_frag(true);
        m.set_more_frags(false);
        m.set_frag_offset(0);
        m.set_dscp_ecn(0);
        m.set_ttl(7);
        m.set_protocol(17);
        m.options_mut().fill(0);
        m.payload_mut().fill(0);
        m.fill_checksum();
        assert!(m.verify_checksum());
        m.clear_flags();
    }

    match ipv4::Repr::parse(&p) {
        Ok(repr) => {
            assert!(valid && !p.is_fragment() && usize::from(p.header_len()) == ipv4::HEADER_LEN);
            assert_eq!(repr.buffer_len(), usize::from(p.total_len()));
            let mut out = vec![0xa5u8; repr.buffer_len()];
            assert_eq!(repr.emit(&mut out), Ok(ipv4::HEADER_LEN));
            out[ipv4::HEADER_LEN..].copy_from_slice(p.payload());
            let q = ipv4::Packet::new_checked(&out[..]).expect("emitted packet checks");
            assert!(q.verify_checksum());
            assert_eq!(ipv4::Repr::parse(&q), Ok(repr));
            // Too small a buffer: an error, and nothing written.
            let mut small = [0u8; ipv4::HEADER_LEN - 1];
            assert_eq!(repr.emit(&mut small), Err(Error::BufferTooSmall));
            assert_eq!(small, [0u8; ipv4::HEADER_LEN - 1]);
        }
        Err(Error::BadChecksum) => assert!(!valid),
        Err(_) => {}
    }
}
