//! GRO coalescing (GroTable::coalesce, by copying, and GroTable::coalesce_refs, in place) over
//! batches of well-formed TCP/UDP streams, single packets and raw bytes; coalesce_refs also with
//! arbitrary (out of range, overlapping) references.
//!
//! Invariants: nothing panics; every reference a write hands out lies inside the buffers;
//! packets are conserved (each is written alone, appended to exactly one chain, or counted
//! invalid); a coalesced write carries a virtio_net_hdr that finishes to a valid checksum and
//! that split() cuts back into exactly the packets of the chain, each with its own payload.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft::dataplane::offload::{self, GroConfig, GroTable, PacketRef, VIRTIO_HEADROOM};
use weft::dataplane::wire::virtio_net::{self, Header};
use weft::dataplane::wire::{ipv4, ipv6, tcp, udp};
use weft_fuzz::{AnyPacket, ArbPacket};

#[derive(Arbitrary, Debug)]
enum Item {
    One(AnyPacket),
    /// Consecutive segments of one flow: sequence numbers and IDs follow on.
    Stream {
        template: ArbPacket,
        lens: Vec<u16>,
        psh_last: bool,
    },
}

#[derive(Arbitrary, Debug)]
enum Mode {
    /// `coalesce`: packet i in bufs[i] behind VIRTIO_HEADROOM, each buffer `room` long.
    Copy { room: u16 },
    /// `coalesce_refs` over packets laid back to back in `nbufs` shared buffers.
    Refs { nbufs: u8 },
    /// `coalesce_refs` with references taken from the input.
    Arbitrary { refs: Vec<(u8, u16, u16)> },
}

#[derive(Arbitrary, Debug)]
struct Input {
    tcp: bool,
    udp: bool,
    items: Vec<Item>,
    mode: Mode,
}

fn packets(items: &[Item]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for item in items {
        match item {
            Item::One(p) => out.push(p.bytes(3000)),
            Item::Stream { template, lens, psh_last } => {
                let mut p = template.clone();
                p.flags = tcp::ACK;
                for (k, len) in lens.iter().take(70).enumerate() {
                    if *psh_last && k + 1 == lens.len().min(70) {
                        p.flags |= tcp::PSH;
                    }
                    p.payload_len = *len % 1500;
                    out.push(p.build(1500));
                    p.seq = p.seq.wrapping_add(u32::from(p.payload_len));
                    p.id = p.id.wrapping_add(1);
                }
            }
        }
        if out.len() >= 256 {
            break;
        }
    }
    out.truncate(256);
    out
}

fn payload_of(p: &[u8]) -> &[u8] {
    let (ip_len, udp_p) = if p[0] >> 4 == 4 {
        (ipv4::HEADER_LEN, p[9] == 17)
    } else {
        (ipv6::HEADER_LEN, p[6] == 17)
    };
    let l4 = if udp_p { udp::HEADER_LEN } else { usize::from(p[ip_len + 12] >> 4) * 4 };
    &p[ip_len + l4..]
}

/// Checks one write: `hdr` then `merged` (the IP packet), the chain's `originals` in order.
fn check_write(hdr: &[u8; VIRTIO_HEADROOM], merged: &[u8], originals: Option<&[&[u8]]>) -> usize {
    let h = Header::parse(hdr).expect("10 bytes");
    if h.gso_kind() == virtio_net::GSO_NONE {
        assert_eq!(h, Header::NONE, "a lone packet's header is not zero");
        if let Some(o) = originals {
            assert_eq!(o.len(), 1);
            assert_eq!(o[0], merged, "a lone packet was changed");
        }
        return 1;
    }
    assert!(h.needs_csum());
    if merged[0] >> 4 == 4 {
        let ip = ipv4::Packet::new_checked(merged).expect("merged IPv4 checks");
        assert_eq!(usize::from(ip.total_len()), merged.len());
        assert!(ip.verify_checksum(), "merged IPv4 header checksum");
    } else {
        let ip = ipv6::Packet::new_checked(merged).expect("merged IPv6 checks");
        assert_eq!(usize::from(ip.payload_len()) + ipv6::HEADER_LEN, merged.len());
    }
    // CHECKSUM_PARTIAL: finishing it as the kernel would gives a valid L4 checksum.
    let mut finished = merged.to_vec();
    offload::finish_checksum(&h, &mut finished).expect("checksum field inside the packet");
    let l4 = &finished[usize::from(h.csum_start)..];
    let ok = if finished[0] >> 4 == 4 {
        let ip = ipv4::Packet::new_checked(&finished[..]).expect("checked above");
        let (s, d) = (ip.src_addr(), ip.dst_addr());
        if h.gso_kind() == virtio_net::GSO_UDP_L4 {
            udp::Packet::new_checked(l4).is_ok_and(|u| u.verify_checksum_v4(s, d))
        } else {
            tcp::Packet::new_checked(l4).is_ok_and(|t| t.verify_checksum_v4(s, d))
        }
    } else {
        let ip = ipv6::Packet::new_checked(&finished[..]).expect("checked above");
        let (s, d) = (ip.src_addr(), ip.dst_addr());
        if h.gso_kind() == virtio_net::GSO_UDP_L4 {
            udp::Packet::new_checked(l4).is_ok_and(|u| u.verify_checksum_v6(s, d))
        } else {
            tcp::Packet::new_checked(l4).is_ok_and(|t| t.verify_checksum_v6(s, d))
        }
    };
    assert!(ok, "finished L4 checksum of a merged packet does not verify");
    // What GRO merged, TSO splits back.
    let plan = offload::plan(&h, merged, 0).expect("a merged packet splits");
    let mut out = vec![0u8; plan.total_len()];
    let segs = offload::split(&h, merged, &mut out, 0).expect("a merged packet splits");
    assert!(segs.count() >= 2, "a chain of one packet got a GSO header");
    if let Some(o) = originals {
        assert_eq!(segs.count(), o.len(), "split gives a different number of packets");
        for (i, orig) in o.iter().enumerate() {
            assert_eq!(payload_of(&out[segs.packet(i)]), payload_of(orig), "segment {i} payload");
        }
    }
    segs.count()
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let pkts = packets(&input.items);
    let mut table = GroTable::new(GroConfig { tcp: input.tcp, udp: input.udp }, 64);
    match input.mode {
        Mode::Copy { room } => {
            let room = VIRTIO_HEADROOM + usize::from(room);
            let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; room]; pkts.len()];
            let mut lens: Vec<usize> = pkts.iter().map(|p| p.len()).collect();
            for (b, p) in bufs.iter_mut().zip(&pkts) {
                if let Some(dst) = b.get_mut(VIRTIO_HEADROOM..VIRTIO_HEADROOM + p.len()) {
                    dst.copy_from_slice(p);
                }
            }
            let written = table.coalesce(&mut bufs, &mut lens).to_vec();
            assert!(written.windows(2).all(|w| w[0] < w[1]), "indices not ascending");
            let mut segments = 0;
            for (i, len) in lens.iter().enumerate() {
                if !written.contains(&i) {
                    assert_eq!(*len, 0, "unwritten index {i} has a length");
                }
            }
            for &i in &written {
                let b = &bufs[i][..lens[i]];
                let hdr: [u8; VIRTIO_HEADROOM] = b[..VIRTIO_HEADROOM].try_into().unwrap();
                segments += check_write(&hdr, &b[VIRTIO_HEADROOM..], None);
            }
            assert_eq!(segments + table.invalid(), pkts.len(), "packets not conserved");
        }
        Mode::Refs { nbufs } => {
            let nbufs = usize::from(nbufs % 8) + 1;
            let mut bufs = vec![Vec::new(); nbufs];
            let mut refs = Vec::new();
            for (i, p) in pkts.iter().enumerate() {
                let b = i % nbufs;
                refs.push(PacketRef::new(b, bufs[b].len(), p.len()));
                bufs[b].extend_from_slice(p);
            }
            let writes = table.coalesce_refs(&mut bufs, &refs).to_vec();
            let mut segments = 0;
            for w in &writes {
                let mut merged = bufs[w.head.buf][w.head.start..][..w.head.len].to_vec();
                let head_idx = refs.iter().position(|r| *r == w.head).expect("head is a ref");
                let mut chain: Vec<&[u8]> = vec![&pkts[head_idx]];
                for r in table.appended(w, &refs) {
                    merged.extend_from_slice(&bufs[r.buf][r.start..r.start + r.len]);
                    let idx = refs
                        .iter()
                        .position(|x| {
                            x.buf == r.buf
                                && x.start < r.start
                                && r.start + r.len == x.start + x.len
                        })
                        .expect("appended payload is the tail of a ref");
                    chain.push(&pkts[idx]);
                }
                assert_eq!(merged.len(), w.len, "write length");
                segments += check_write(&w.hdr, &merged, Some(&chain));
            }
            assert_eq!(segments, pkts.len(), "packets not conserved");
            assert_eq!(table.invalid(), 0);
            assert_eq!(table.merged() + writes.len(), pkts.len());
        }
        Mode::Arbitrary { refs } => {
            let mut bufs: Vec<Vec<u8>> = pkts.iter().take(8).cloned().collect();
            if bufs.is_empty() {
                bufs.push(Vec::new());
            }
            let refs: Vec<PacketRef> = refs
                .iter()
                .take(512)
                .map(|&(b, s, l)| PacketRef {
                    // Trusted or not (a weft peer's or a kernel peer's): references stay
                    // conserved and inside the buffers either way.
                    checksums_trusted: b & 0x80 != 0,
                    ..PacketRef::new(usize::from(b % 9), usize::from(s), usize::from(l))
                })
                .collect();
            let writes = table.coalesce_refs(&mut bufs, &refs).to_vec();
            let mut count = 0;
            for w in &writes {
                let head = bufs
                    .get(w.head.buf)
                    .and_then(|b| b.get(w.head.start..w.head.start + w.head.len));
                assert!(head.is_some(), "head reference outside the buffers");
                let mut len = w.head.len;
                count += 1;
                for r in table.appended(w, &refs) {
                    let bytes = bufs.get(r.buf).and_then(|b| b.get(r.start..r.start + r.len));
                    assert!(bytes.is_some(), "appended reference outside the buffers");
                    len += r.len;
                    count += 1;
                }
                assert_eq!(len, w.len, "write length");
            }
            assert_eq!(count + table.invalid(), refs.len(), "references not conserved");
        }
    }
});
