//! icmpv6 error emission in reply to arbitrary packets: when a reply is written, it is a valid
//! IPv6 packet of at most the minimum MTU, to the original's source, whose ICMPv6 checksum
//! verifies over the pseudo header, quoting the start of the original.
#![no_main]

use std::net::Ipv6Addr;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{checksum, icmpv6, ipv6};

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    code: u8,
    mtu: Option<u32>,
    our: [u8; 16],
    out_len: u16,
    original: &'a [u8],
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let our = Ipv6Addr::from(input.our);
    let mut out = vec![0u8; usize::from(input.out_len % 1600)];
    let res = match input.mtu {
        None => icmpv6::emit_dest_unreachable(input.original, input.code, our, &mut out),
        Some(mtu) => icmpv6::emit_packet_too_big(input.original, mtu, our, &mut out),
    };
    let Ok(n) = res else { return };
    assert!(n <= out.len() && n <= icmpv6::MIN_MTU);
    let orig =
        ipv6::Packet::new_checked(input.original).expect("a reply means the original checked");
    let reply = ipv6::Packet::new_checked(&out[..n]).expect("the reply is a valid IPv6 packet");
    assert_eq!(usize::from(reply.payload_len()) + ipv6::HEADER_LEN, n);
    assert_eq!(reply.next_header(), icmpv6::NEXT_HEADER);
    assert_eq!((reply.src_addr(), reply.dst_addr()), (our, orig.src_addr()));
    assert!(!orig.src_addr().is_multicast() && !orig.dst_addr().is_multicast());
    let icmp = reply.payload();
    let pseudo =
        checksum::pseudo_header_v6(our, orig.src_addr(), icmpv6::NEXT_HEADER, icmp.len() as u32);
    assert_eq!(checksum::combine(&[pseudo, checksum::data(icmp)]), 0xffff, "checksum");
    let quote = &icmp[icmpv6::HEADER_LEN..];
    assert_eq!(quote, &orig.packet()[..quote.len()]);
    assert!(quote.len() == orig.packet().len() || quote.len() == icmpv6::MAX_QUOTE_LEN);
});
