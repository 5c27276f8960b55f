//! ipv6::Packet (checked view, accessors, setters) and the Repr parse/emit round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{self, Error, ipv6};

fuzz_target!(|data: &[u8]| {
    let _ = wire::flow_hash(data);
    let Ok(p) = ipv6::Packet::new_checked(data) else { return };
    let _ = (p.version(), p.traffic_class(), p.flow_label(), p.next_header(), p.hop_limit());
    let _ = (p.src_addr(), p.dst_addr());
    assert_eq!(p.payload().len(), usize::from(p.payload_len()));
    assert_eq!(p.packet().len(), ipv6::HEADER_LEN + usize::from(p.payload_len()));

    let mut buf = data.to_vec();
    {
        let mut m = ipv6::Packet::new_checked(&mut buf[..]).expect("same bytes");
        m.set_traffic_class(0xff);
        m.set_flow_label(0xf_ffff);
        m.set_next_header(6);
        m.set_hop_limit(1);
        m.set_src_addr(std::net::Ipv6Addr::LOCALHOST);
        m.set_dst_addr(std::net::Ipv6Addr::UNSPECIFIED);
        m.payload_mut().fill(1);
        assert_eq!((m.traffic_class(), m.flow_label(), m.version()), (0xff, 0xf_ffff, p.version()));
    }

    let Ok(repr) = ipv6::Repr::parse(&p) else { return };
    let mut out = vec![0u8; repr.buffer_len()];
    assert_eq!(repr.emit(&mut out), Ok(ipv6::HEADER_LEN));
    out[ipv6::HEADER_LEN..].copy_from_slice(p.payload());
    let q = ipv6::Packet::new_checked(&out[..]).expect("emitted packet checks");
    assert_eq!((q.version(), q.traffic_class(), q.flow_label()), (6, 0, 0));
    assert_eq!(ipv6::Repr::parse(&q), Ok(repr));
    let mut small = [0u8; ipv6::HEADER_LEN - 1];
    assert_eq!(repr.emit(&mut small), Err(Error::BufferTooSmall));
});
