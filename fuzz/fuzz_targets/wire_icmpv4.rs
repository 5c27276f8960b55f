//! icmpv4 error emission in reply to arbitrary packets: when a reply is written, it is a valid
//! IPv4 packet (header and ICMP checksums), to the original's source, quoting its header.
#![no_main]

use std::net::Ipv4Addr;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{checksum, icmpv4, ip, ipv4};

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    code: u8,
    mtu: Option<u16>,
    our: [u8; 4],
    out_len: u16,
    fix_checksum: bool,
    original: &'a [u8],
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut original = input.original.to_vec();
    if input.fix_checksum
        && let Ok(mut p) = ipv4::Packet::new_checked(&mut original[..])
    {
        p.fill_checksum();
    }
    let our = Ipv4Addr::from(input.our);
    let mut out = vec![0u8; usize::from(input.out_len % 1600)];
    let res = match input.mtu {
        None => icmpv4::emit_dest_unreachable(&original, input.code, our, &mut out),
        Some(mtu) => icmpv4::emit_frag_needed(&original, mtu, our, &mut out),
    };
    let Ok(n) = res else { return };
    assert!(n <= out.len());
    let orig =
        ipv4::Packet::new_checked(&original[..]).expect("a reply means the original checked");
    let reply = ipv4::Packet::new_checked(&out[..n]).expect("the reply is a valid IPv4 packet");
    let repr = ipv4::Repr::parse(&reply).expect("the reply parses");
    assert_eq!(usize::from(reply.total_len()), n);
    assert_eq!(repr.protocol, ip::proto::ICMP);
    assert_eq!(repr.src_addr, our);
    assert_eq!(repr.dst_addr, orig.src_addr());
    let icmp = reply.payload();
    assert_eq!(icmp[0], icmpv4::TYPE_DEST_UNREACHABLE);
    assert_eq!(checksum::data(icmp), 0xffff, "ICMP checksum does not verify");
    let quote = &icmp[icmpv4::HEADER_LEN..];
    let hl = usize::from(orig.header_len());
    assert_eq!(&quote[..hl], orig.header());
    assert!(quote.len() - hl <= icmpv4::QUOTED_PAYLOAD_LEN);
});
