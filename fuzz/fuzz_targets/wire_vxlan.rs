//! vxlan::Packet and Repr: a header that parses is exactly the header Repr::emit writes; a VXLAN
//! datagram's inner Ethernet frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{ethernet, vxlan};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = vxlan::Packet::new_checked(data) else {
        assert!(data.len() < vxlan::HEADER_LEN);
        return;
    };
    let _ = (p.flags(), p.reserved1(), p.vni(), p.reserved2());
    assert!(p.vni() < 1 << 24);
    let Ok(repr) = vxlan::Repr::parse(&p) else { return };
    let mut out = [0u8; vxlan::HEADER_LEN];
    assert_eq!(repr.emit(&mut out), Ok(repr.buffer_len()));
    assert_eq!(
        &out[..],
        &data[..vxlan::HEADER_LEN],
        "parse accepted a header emit would not write"
    );
    let _ = repr.vni.to_string();
    assert_eq!(vxlan::Vni::try_from(repr.vni.get()), Ok(repr.vni));

    let mut buf = data.to_vec();
    let mut m = vxlan::Packet::new_checked(&mut buf[..]).expect("same bytes");
    m.set_vni(repr.vni);
    m.set_flags(0);
    m.set_reserved1(0xff_ffff);
    m.set_reserved2(0xff);
    m.payload_mut().fill(0);
    assert_eq!(m.vni(), repr.vni.get());
    if let Ok(eth) = ethernet::Frame::new_checked(p.payload()) {
        let _ = ethernet::Repr::parse(&eth);
    }
});
