//! ethernet::Frame and Repr: parse then emit gives back the same 14 header bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::ethernet::{self, Frame, MacAddr, Repr};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = Frame::new_checked(data) else {
        assert!(data.len() < ethernet::HEADER_LEN);
        return;
    };
    let _ = (f.dst_addr().to_string(), f.src_addr(), f.ethertype());
    assert_eq!(f.payload().len(), data.len() - ethernet::HEADER_LEN);
    let repr = Repr::parse(&f).expect("a checked frame parses");
    let mut out = [0u8; ethernet::HEADER_LEN];
    assert_eq!(repr.emit(&mut out), Ok(repr.buffer_len()));
    assert_eq!(&out[..], &data[..ethernet::HEADER_LEN]);

    let mut buf = data.to_vec();
    let mut m = Frame::new_checked(&mut buf[..]).expect("same bytes");
    m.set_dst_addr(MacAddr([1; 6]));
    m.set_src_addr(MacAddr([2; 6]));
    m.set_ethertype(ethernet::EtherType::IPV4);
    m.payload_mut().fill(0);
});
