//! TSO/USO split (offload::split, plan, finish_checksum) behind an arbitrary virtio_net_hdr:
//! raw TUN reads through the worker's entry point (Header::parse, then split), and well-formed
//! TCP/UDP packets with arbitrary gso_size, csum_start and csum_offset (csum_start inside the IP
//! header included). Every split segment must be a valid packet of the right length with
//! correct checksums, and the segments' payloads must concatenate to the original payload.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::offload::{self, OffloadError};
use weft::dataplane::wire::virtio_net::{self, Header};
use weft::dataplane::wire::{ipv4, ipv6, tcp, udp};
use weft_fuzz::ArbPacket;

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    /// One TUN read: virtio_net_hdr + packet, as the worker gets it.
    Raw { headroom: u8, out_len: u32, read: &'a [u8] },
    /// A well-formed packet behind a header with arbitrary numbers.
    Built {
        packet: ArbPacket,
        flags: u8,
        gso_type: u8,
        hdr_len: u16,
        gso_size: u16,
        /// `None`: the IP header length (what TUN gives); else taken as is.
        csum_start: Option<u16>,
        csum_offset: Option<u16>,
        headroom: u8,
        out_len: Option<u32>,
    },
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    match input {
        Input::Raw { headroom, out_len, read } => {
            let Ok(hdr) = Header::parse(read) else { return };
            let mut out = vec![0u8; (out_len % (1 << 19)) as usize];
            run(&hdr, &read[virtio_net::LEN..], &mut out, usize::from(headroom % 64));
        }
        Input::Built {
            packet,
            flags,
            gso_type,
            hdr_len,
            gso_size,
            csum_start,
            csum_offset,
            headroom,
            out_len,
        } => {
            let bytes = packet.build(9000);
            let ip_len = if packet.v6 { ipv6::HEADER_LEN } else { ipv4::HEADER_LEN };
            let kind = match gso_type % 8 {
                0 => virtio_net::GSO_NONE,
                1 | 4 => {
                    if packet.udp {
                        virtio_net::GSO_UDP_L4
                    } else if packet.v6 {
                        virtio_net::GSO_TCPV6
                    } else {
                        virtio_net::GSO_TCPV4
                    }
                }
                2 => virtio_net::GSO_TCPV4,
                3 => virtio_net::GSO_TCPV6,
                5 => virtio_net::GSO_UDP_L4,
                6 => virtio_net::GSO_UDP,
                _ => gso_type,
            };
            let hdr = Header {
                flags,
                gso_type: kind | (gso_type & virtio_net::GSO_ECN),
                hdr_len,
                // Small sizes make many segments: keep the output bounded.
                gso_size: gso_size.max(1).saturating_add(64),
                csum_start: csum_start.unwrap_or(ip_len as u16),
                csum_offset: csum_offset.unwrap_or(if packet.udp { 6 } else { 16 }),
            };
            let headroom = usize::from(headroom % 64);
            let len = match out_len {
                None => offload::plan(&hdr, &bytes, headroom).map_or(0, |s| s.total_len()),
                Some(n) => (n % (1 << 19)) as usize,
            };
            let mut out = vec![0u8; len.min(1 << 20)];
            run(&hdr, &bytes, &mut out, headroom);
        }
    }
});

fn run(hdr: &Header, packet: &[u8], out: &mut [u8], headroom: usize) {
    const GUARD: u8 = 0x5a;
    out.fill(GUARD);
    let planned = offload::plan(hdr, packet, headroom);
    let res = offload::split(hdr, packet, out, headroom);
    let mut copy = packet.to_vec();
    let finished = offload::finish_checksum(hdr, &mut copy);
    if !hdr.needs_csum() {
        assert_eq!(copy, packet, "finish_checksum wrote without NEEDS_CSUM");
    }
    let segs = match (planned, res) {
        (Ok(p), Ok(s)) => {
            assert_eq!(p, s, "plan and split disagree");
            s
        }
        (Ok(p), Err(e)) => {
            assert_eq!(e, OffloadError::TooManySegments);
            assert!(p.total_len() > out.len());
            return;
        }
        (Err(e), Err(f)) => {
            assert_eq!(e, f);
            return;
        }
        (Err(e), Ok(_)) => panic!("plan refused ({e:?}) what split did"),
    };
    assert!(segs.count() >= 1 && segs.total_len() <= out.len());
    assert!(out[segs.total_len()..].iter().all(|&b| b == GUARD), "split wrote past total_len");
    for i in 0..segs.count() {
        let slot = segs.slot(i);
        assert_eq!(slot.start, i * segs.stride());
        assert!(
            out[slot.start..slot.start + headroom].iter().all(|&b| b == GUARD),
            "headroom written"
        );
        assert_eq!(segs.packet(i).len(), segs.seg_len(i));
    }
    assert!(segs.packet(segs.count()).is_empty() && segs.slot(segs.count()).is_empty());

    if hdr.gso_kind() == virtio_net::GSO_NONE {
        assert_eq!(segs.count(), 1);
        assert!(finished.is_ok());
        assert_eq!(&out[segs.packet(0)], &copy[..], "GSO_NONE split is not a finished copy");
        return;
    }
    // A GSO split: every segment is a whole packet with correct checksums.
    let is_udp = hdr.gso_kind() == virtio_net::GSO_UDP_L4;
    let l4_start = usize::from(hdr.csum_start);
    let mut payload = Vec::new();
    let mut hdrs = None;
    for i in 0..segs.count() {
        let seg = &out[segs.packet(i)];
        let l4 = &seg[l4_start..];
        let l4_hdr = if is_udp { udp::HEADER_LEN } else { usize::from(l4[12] >> 4) * 4 };
        let h = l4_start + l4_hdr;
        assert!(hdrs.is_none_or(|x| x == h));
        hdrs = Some(h);
        payload.extend_from_slice(&seg[h..]);
        if seg[0] >> 4 == 4 {
            let ip = ipv4::Packet::new_checked(seg).expect("segment is IPv4");
            assert_eq!(usize::from(ip.total_len()), seg.len());
            assert!(ip.verify_checksum(), "segment {i}: bad IPv4 header checksum");
            let (s, d) = (ip.src_addr(), ip.dst_addr());
            if is_udp {
                let u = udp::Packet::new_checked(l4).expect("segment is UDP");
                assert_eq!(usize::from(u.len()), l4.len());
                assert!(u.verify_checksum_v4(s, d), "segment {i}: bad UDP checksum");
            } else {
                let t = tcp::Packet::new_checked(l4).expect("segment is TCP");
                assert!(t.verify_checksum_v4(s, d), "segment {i}: bad TCP checksum");
            }
        } else {
            let ip = ipv6::Packet::new_checked(seg).expect("segment is IPv6");
            assert_eq!(usize::from(ip.payload_len()) + ipv6::HEADER_LEN, seg.len());
            let (s, d) = (ip.src_addr(), ip.dst_addr());
            if is_udp {
                let u = udp::Packet::new_checked(l4).expect("segment is UDP");
                assert!(u.verify_checksum_v6(s, d), "segment {i}: bad UDP checksum");
            } else {
                let t = tcp::Packet::new_checked(l4).expect("segment is TCP");
                assert!(t.verify_checksum_v6(s, d), "segment {i}: bad TCP checksum");
            }
        }
    }
    let h = hdrs.unwrap_or(0);
    assert_eq!(payload, &packet[h..], "segments do not carry the original payload");
}
