//! TSO/USO segmentation of a packet read from TUN (the kernel's `tcp_gso_segment` and
//! `__udp_gso_segment`, done in user space).
//!
//! # Output layout
//! Segment `i` occupies the slot `out[i * stride ..][.. headroom + len(i)]`: `headroom` bytes the
//! caller fills later (VXLAN + inner Ethernet, `transport::HEADROOM` = 22), then the segment's IP
//! packet. `stride = headroom + hdr + gso_size` is the length of every full segment's slot, so
//! once each headroom is filled, `out[..total_len()]` is exactly the buffer a
//! `sendmsg(UDP_SEGMENT = stride)` wants: equal datagrams and a shorter last one, back to back.
//! Headroom bytes are never written here.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::Range;

use super::OffloadError;
use crate::dataplane::wire::virtio_net::{self, Header};
use crate::dataplane::wire::{checksum, ip, ipv4, ipv6, read_u16, read_u32, tcp, udp, write_u16};

/// Where [`split`] puts (or would put) each segment in its output buffer. See the module docs
/// for the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segments {
    count: usize,
    stride: usize,
    headroom: usize,
    /// The IP length of every segment but the last.
    full_len: usize,
    /// The IP length of the last segment (equal to `full_len` or shorter).
    last_len: usize,
    /// The end of the last segment.
    total: usize,
}

impl Segments {
    /// How many segments (at least 1).
    pub const fn count(&self) -> usize {
        self.count
    }

    /// The distance between the starts of consecutive slots: `headroom` + the IP length of a
    /// full segment. Once the headroom is filled, this is the `UDP_SEGMENT` size.
    pub const fn stride(&self) -> usize {
        self.stride
    }

    /// The IP length of segment `i` (0 when `i >= count()`).
    pub const fn seg_len(&self, i: usize) -> usize {
        if i + 1 < self.count {
            self.full_len
        } else if i + 1 == self.count {
            self.last_len
        } else {
            0
        }
    }

    /// The range of segment `i`'s IP packet in the output buffer (empty, at
    /// [`total_len`](Self::total_len), when `i >= count()`).
    pub fn packet(&self, i: usize) -> Range<usize> {
        if i >= self.count {
            return self.total..self.total;
        }
        let start = self.slot(i).start + self.headroom;
        start..start + self.seg_len(i)
    }

    /// The range of segment `i`'s slot, headroom included: what encapsulation turns into one
    /// datagram (empty, at [`total_len`](Self::total_len), when `i >= count()`).
    pub fn slot(&self, i: usize) -> Range<usize> {
        if i >= self.count {
            return self.total..self.total;
        }
        // i * stride + headroom + seg_len(i) <= total, which did not overflow.
        let start = i * self.stride;
        start..start + self.headroom + self.seg_len(i)
    }

    /// The output bytes used: the end of the last segment.
    pub const fn total_len(&self) -> usize {
        self.total
    }

    /// The layout of `count` >= 1 segments, or `None` if the output would not fit in memory.
    fn new(count: usize, headroom: usize, full_len: usize, last_len: usize) -> Option<Self> {
        let stride = headroom.checked_add(full_len)?;
        let total =
            (count - 1).checked_mul(stride)?.checked_add(headroom)?.checked_add(last_len)?;
        Some(Self { count, stride, headroom, full_len, last_len, total })
    }
}

/// What the packet looks like, once the header has been checked against it.
#[derive(Clone, Copy, Debug)]
struct Layout {
    segs: Segments,
    /// The GSO type without the ECN bit.
    kind: u8,
    /// IP version, 4 or 6 (unused for `GSO_NONE`).
    version: u8,
    /// The L4 header's offset: `csum_start`, i.e. the IP header length (IPv6 extension headers
    /// included).
    l4_start: usize,
    /// The length of all headers, IP + L4: what every segment repeats.
    hdr_len: usize,
    /// Payload bytes per full segment.
    gso_size: usize,
}

/// Computes where [`split`] would put each segment of `packet` behind `hdr`, without writing.
/// Use it to size the output buffer: [`Segments::total_len`] bytes.
///
/// # Errors
/// As [`split`]; [`OffloadError::TooManySegments`] only if the layout does not fit in memory.
pub fn plan(hdr: &Header, packet: &[u8], headroom: usize) -> Result<Segments, OffloadError> {
    layout(hdr, packet, headroom).map(|l| l.segs)
}

fn layout(hdr: &Header, packet: &[u8], headroom: usize) -> Result<Layout, OffloadError> {
    let len = packet.len();
    let kind = hdr.gso_kind();
    let (proto, l4_min) = match kind {
        virtio_net::GSO_NONE => {
            if hdr.needs_csum() {
                checksum_at(hdr, len)?;
            }
            let segs = Segments::new(1, headroom, len, len).ok_or(OffloadError::TooManySegments)?;
            return Ok(Layout { segs, kind, version: 0, l4_start: 0, hdr_len: len, gso_size: len });
        }
        virtio_net::GSO_TCPV4 | virtio_net::GSO_TCPV6 => (ip::proto::TCP, tcp::HEADER_LEN),
        virtio_net::GSO_UDP_L4 => (ip::proto::UDP, udp::HEADER_LEN),
        _ => return Err(OffloadError::Unsupported),
    };
    let version = ip::version(packet).ok_or(OffloadError::Malformed)?;
    let version_ok = match kind {
        virtio_net::GSO_TCPV4 => version == 4,
        virtio_net::GSO_TCPV6 => version == 6,
        _ => version == 4 || version == 6,
    };
    if !version_ok {
        return Err(OffloadError::Malformed);
    }
    // hdr_len is not trusted (on the forward path it can cover the whole first packet): the L4
    // header starts at csum_start, which must agree with the IP header.
    let l4_start = usize::from(hdr.csum_start);
    if version == 4 {
        if len < ipv4::HEADER_LEN {
            return Err(OffloadError::Malformed);
        }
        let ihl = usize::from(packet[0] & 0x0f) * 4;
        let fragment = read_u16(packet, 6) & 0x3fff != 0;
        if ihl < ipv4::HEADER_LEN || ihl != l4_start || packet[9] != proto || fragment {
            return Err(OffloadError::Malformed);
        }
    } else {
        // Extension headers may sit between the fixed header and csum_start; they are copied
        // into every segment as they are (and, as in wireguard-go, not walked: a routing
        // header's final destination is not used for the pseudo header). Without them the next
        // header must be the protocol.
        if len < ipv6::HEADER_LEN
            || l4_start < ipv6::HEADER_LEN
            || (l4_start == ipv6::HEADER_LEN && packet[6] != proto)
        {
            return Err(OffloadError::Malformed);
        }
    }
    if l4_start + l4_min > len {
        return Err(OffloadError::Malformed);
    }
    let l4_len = if proto == ip::proto::TCP {
        let doff = usize::from(packet[l4_start + 12] >> 4) * 4;
        if doff < tcp::HEADER_LEN {
            return Err(OffloadError::Malformed);
        }
        doff
    } else {
        udp::HEADER_LEN
    };
    let hdr_len = l4_start + l4_len;
    let gso_size = usize::from(hdr.gso_size);
    if hdr_len > len || gso_size == 0 {
        return Err(OffloadError::Malformed);
    }
    let payload = len - hdr_len;
    let count = payload.div_ceil(gso_size).max(1);
    let full_len = hdr_len + gso_size.min(payload);
    let last_len = hdr_len + (payload - (count - 1) * gso_size);
    // IPv4 total length, IPv6 payload length and UDP length are all 16 bits.
    if full_len > usize::from(u16::MAX) {
        return Err(OffloadError::Malformed);
    }
    let segs =
        Segments::new(count, headroom, full_len, last_len).ok_or(OffloadError::TooManySegments)?;
    Ok(Layout { segs, kind, version, l4_start, hdr_len, gso_size })
}

/// The offset of the checksum field of a `NEEDS_CSUM` header, checked against a packet of `len`
/// bytes.
fn checksum_at(hdr: &Header, len: usize) -> Result<(usize, usize), OffloadError> {
    let start = usize::from(hdr.csum_start);
    let at = start + usize::from(hdr.csum_offset);
    if at + 2 > len {
        return Err(OffloadError::Malformed);
    }
    Ok((start, at))
}

/// Finishes a partial checksum in place, as `skb_checksum_help` does: the field at
/// `csum_start + csum_offset` holds the pseudo-header sum; the ones' complement sum of
/// `packet[csum_start..]` (the field included) is complemented and stored there. Does nothing
/// unless `hdr` has `F_NEEDS_CSUM`.
///
/// For a `GSO_NONE` packet this is all [`split`] would do besides copying, so a caller can
/// skip the copy and forward the packet where it lies.
///
/// # Errors
/// [`OffloadError::Malformed`] if the checksum field is not inside `packet` (nothing written).
pub fn finish_checksum(hdr: &Header, packet: &mut [u8]) -> Result<(), OffloadError> {
    if !hdr.needs_csum() {
        return Ok(());
    }
    let (start, at) = checksum_at(hdr, packet.len())?;
    let sum = !checksum::data(&packet[start..]);
    // 0 and 0xffff are the same in ones' complement, but 0 means "no checksum" to UDP, so the
    // kernel writes 0xffff (CSUM_MANGLED_0); harmless for TCP.
    write_u16(packet, at, if sum == 0 { 0xffff } else { sum });
    Ok(())
}

/// Splits `packet`, read from TUN behind `hdr`, into wire-sized segments in `out`, each after
/// `headroom` free bytes (see the module docs for the layout), and returns where they are.
///
/// - `GSO_NONE`: one segment, a copy of `packet`, its checksum finished if `F_NEEDS_CSUM`.
/// - `GSO_TCPV4`, `GSO_TCPV6`, `GSO_UDP_L4` (the ECN bit is ignored): every `gso_size` payload
///   bytes become a segment with a copy of the headers (IPv6 extension headers included);
///   IPv4 total length, identification (+ i) and header checksum; IPv6 payload length; TCP
///   sequence number (+ i·gso_size), FIN and PSH only on the last segment, CWR only on the
///   first; UDP length; and a complete L4 checksum in every segment. `hdr_len` is ignored: the
///   header length is recomputed from `csum_start` and the TCP data offset (or the UDP header).
///   The packet's own length fields are ignored too: `packet.len()` is the truth, as TUN hands
///   over exactly one packet per read.
///
/// # Errors
/// - [`OffloadError::Malformed`]: `hdr` and `packet` disagree (see the variant).
/// - [`OffloadError::Unsupported`]: `GSO_UDP` (UFO) or an unknown GSO type.
/// - [`OffloadError::TooManySegments`]: `out` is shorter than [`Segments::total_len`] (or the
///   layout would not fit in memory at all); nothing is written.
pub fn split(
    hdr: &Header,
    packet: &[u8],
    out: &mut [u8],
    headroom: usize,
) -> Result<Segments, OffloadError> {
    let l = layout(hdr, packet, headroom)?;
    let segs = l.segs;
    if segs.total > out.len() {
        return Err(OffloadError::TooManySegments);
    }
    if l.kind == virtio_net::GSO_NONE {
        let dst = &mut out[segs.packet(0)];
        dst.copy_from_slice(packet);
        // layout() checked the checksum field's position, so this cannot fail.
        return finish_checksum(hdr, dst).map(|()| segs);
    }

    let (headers, payload) = packet.split_at(l.hdr_len);
    let is_tcp = l.kind != virtio_net::GSO_UDP_L4;
    let first_id = if l.version == 4 { read_u16(packet, 4) } else { 0 };
    let first_seq = if is_tcp { read_u32(packet, l.l4_start + 4) } else { 0 };
    // The IPv4 header checksum of each segment is the sum of the header's constant words plus
    // its own length and identification: sum the constant part once (ones' complement sums
    // are linear), not the whole header per segment.
    let v4_base = (l.version == 4).then(|| {
        let mut h = [0u8; 60];
        let h = &mut h[..l.l4_start.min(60)];
        h.copy_from_slice(&packet[..h.len()]);
        for field in [2, 4, 10] {
            write_u16(h, field, 0);
        }
        checksum::data(h)
    });
    for i in 0..segs.count {
        let from = (i * l.gso_size).min(payload.len());
        let chunk = &payload[from..(from + l.gso_size).min(payload.len())];
        let seg = &mut out[segs.packet(i)];
        seg[..l.hdr_len].copy_from_slice(headers);
        seg[l.hdr_len..].copy_from_slice(chunk);
        let seg_len = seg.len();
        let last = i + 1 == segs.count;

        // layout() proved: the IP header lies within hdr_len, and seg_len fits 16 bits.
        let addrs = if let Some(base) = v4_base {
            let mut ip = ipv4::Packet::new_unchecked(&mut seg[..]);
            let ident = first_id.wrapping_add(i as u16);
            ip.set_total_len(seg_len as u16);
            ip.set_ident(ident);
            ip.set_checksum(!checksum::combine(&[base, seg_len as u16, ident]));
            Addrs::V4(ip.src_addr(), ip.dst_addr())
        } else {
            let mut ip = ipv6::Packet::new_unchecked(&mut seg[..]);
            ip.set_payload_len((seg_len - ipv6::HEADER_LEN) as u16);
            Addrs::V6(ip.src_addr(), ip.dst_addr())
        };

        let l4 = &mut seg[l.l4_start..];
        if is_tcp {
            let mut t = tcp::Packet::new_unchecked(l4);
            t.set_seq_number(first_seq.wrapping_add((i * l.gso_size) as u32));
            let mut flags = t.flags();
            if !last {
                flags &= !(tcp::FIN | tcp::PSH);
            }
            if i > 0 {
                // RFC 3168 §6.1.2: CWR goes out once, on the first segment, as the kernel does.
                flags &= !tcp::CWR;
            }
            t.set_flags(flags);
            // Segments are at most 65535 bytes (layout() checked), so the fill cannot fail.
            let _ = match addrs {
                Addrs::V4(s, d) => t.fill_checksum_v4(s, d),
                Addrs::V6(s, d) => t.fill_checksum_v6(s, d),
            };
        } else {
            let mut u = udp::Packet::new_unchecked(l4);
            u.set_len((seg_len - l.l4_start) as u16);
            match addrs {
                Addrs::V4(s, d) => u.fill_checksum_v4(s, d),
                Addrs::V6(s, d) => u.fill_checksum_v6(s, d),
            }
        }
    }
    Ok(segs)
}

/// A segment's addresses, for the pseudo header.
enum Addrs {
    V4(Ipv4Addr, Ipv4Addr),
    V6(Ipv6Addr, Ipv6Addr),
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::testutil::{Pkt, checksums_valid, payload};
    use super::*;

    /// The header TUN would give for `p` as a super-packet cut every `gso` bytes.
    fn gso_hdr(p: &Pkt, gso: u16) -> Header {
        let gso_type = match (p.udp, p.v6) {
            (true, _) => virtio_net::GSO_UDP_L4,
            (false, false) => virtio_net::GSO_TCPV4,
            (false, true) => virtio_net::GSO_TCPV6,
        };
        Header {
            flags: virtio_net::F_NEEDS_CSUM,
            gso_type,
            hdr_len: (p.ip_len() + p.l4_len()) as u16,
            gso_size: gso,
            csum_start: p.ip_len() as u16,
            csum_offset: if p.udp { 6 } else { 16 },
        }
    }

    /// Splits into a 0xa5-filled buffer and returns the segments' packets, checking the
    /// layout (headroom untouched, slots back to back) on the way.
    fn split_all(hdr: &Header, packet: &[u8], headroom: usize) -> Vec<Vec<u8>> {
        // Sized from the plan (plus a guard tail) so that tiny gso sizes over big payloads,
        // which need megabytes, are tested rather than refused for lack of room.
        let planned = plan(hdr, packet, headroom).unwrap();
        let mut out = vec![0xa5u8; planned.total_len() + 4096];
        let segs = split(hdr, packet, &mut out, headroom).unwrap();
        assert_eq!(planned, segs);
        assert!(out[segs.total_len()..].iter().all(|&b| b == 0xa5));
        (0..segs.count())
            .map(|i| {
                let slot = segs.slot(i);
                assert_eq!(slot.start, i * segs.stride());
                assert!(out[slot.start..slot.start + headroom].iter().all(|&b| b == 0xa5));
                assert_eq!(segs.packet(i).len(), segs.seg_len(i));
                out[segs.packet(i)].to_vec()
            })
            .collect()
    }

    /// Turns the full checksum of a built packet into a partial one (the pseudo-header sum), as
    /// TUN hands it over with `F_NEEDS_CSUM`.
    fn make_partial(p: &mut [u8], csum_start: usize, csum_offset: usize) {
        let at = csum_start + csum_offset;
        let l4_len = p.len() - csum_start;
        let ph = if p[0] >> 4 == 4 {
            let ip = ipv4::Packet::new_unchecked(&p[..]);
            checksum::pseudo_header_v4(ip.src_addr(), ip.dst_addr(), p[9], l4_len as u16)
        } else {
            let ip = ipv6::Packet::new_unchecked(&p[..]);
            checksum::pseudo_header_v6(ip.src_addr(), ip.dst_addr(), p[6], l4_len as u32)
        };
        write_u16(p, at, ph);
    }

    #[test]
    fn gso_none_finishes_partial_checksum() {
        for pkt in [Pkt::tcp4(100), Pkt::tcp6(7), Pkt::udp4(33), Pkt::udp6(0)] {
            let full = pkt.build();
            let mut partial = full.clone();
            let off = if pkt.udp { 6 } else { 16 };
            make_partial(&mut partial, pkt.ip_len(), off);
            assert_ne!(partial, full);
            let hdr = Header {
                flags: virtio_net::F_NEEDS_CSUM,
                csum_start: pkt.ip_len() as u16,
                csum_offset: off as u16,
                ..Header::NONE
            };
            assert_eq!(split_all(&hdr, &partial, 22), vec![full.clone()]);
            let mut in_place = partial.clone();
            finish_checksum(&hdr, &mut in_place).unwrap();
            assert_eq!(in_place, full);
            // Without NEEDS_CSUM nothing is finished: a plain copy.
            assert_eq!(split_all(&Header::NONE, &partial, 0), vec![partial.clone()]);
        }
    }

    #[test]
    fn tcp4_tso_split() {
        let mut p = Pkt::tcp4(2500);
        p.flags = tcp::ACK | tcp::PSH | tcp::FIN | tcp::CWR;
        p.opts = vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2];
        let mut sp = p.build();
        make_partial(&mut sp, 20, 16);
        let mut hdr = gso_hdr(&p, 1000);
        hdr.gso_type |= virtio_net::GSO_ECN;
        // hdr_len is not trusted.
        hdr.hdr_len = sp.len() as u16;
        let segs = split_all(&hdr, &sp, 22);
        assert_eq!(segs.len(), 3);
        for (i, s) in segs.iter().enumerate() {
            assert!(checksums_valid(s), "segment {i}");
            let ip = ipv4::Packet::new_checked(&s[..]).unwrap();
            assert_eq!(usize::from(ip.total_len()), s.len());
            assert_eq!(ip.ident(), 100 + i as u16);
            let t = tcp::Packet::new_checked(ip.payload()).unwrap();
            assert_eq!(t.seq_number(), 1000 + 1000 * i as u32);
            assert_eq!(t.options(), &p.opts[..]);
            let want = match i {
                0 => tcp::ACK | tcp::CWR,
                1 => tcp::ACK,
                _ => tcp::ACK | tcp::PSH | tcp::FIN,
            };
            assert_eq!(t.flags(), want, "segment {i}");
            assert_eq!(t.payload(), &p.payload[i * 1000..(i * 1000 + 1000).min(2500)]);
        }
        assert_eq!(segs[2].len(), 20 + 32 + 500);
    }

    #[test]
    fn tcp6_and_udp_split() {
        for (p, gso) in [
            (Pkt::tcp6(4000), 1400u16),
            (Pkt::udp4(3000), 1000),
            (Pkt::udp6(1001), 1000),
            (Pkt::tcp4(1000), 1000),
            (Pkt::tcp4(0), 1000),
        ] {
            let sp = p.build();
            let segs = split_all(&gso_hdr(&p, gso), &sp, 8);
            assert_eq!(segs.len(), p.payload.len().div_ceil(usize::from(gso)).max(1));
            let mut joined = Vec::new();
            for s in &segs {
                assert!(checksums_valid(s));
                joined.extend_from_slice(payload(s));
                if p.udp {
                    assert_eq!(usize::from(read_u16(s, p.ip_len() + 4)), s.len() - p.ip_len());
                }
                if p.v6 {
                    assert_eq!(usize::from(read_u16(s, 4)), s.len() - 40);
                }
            }
            assert_eq!(joined, p.payload);
        }
    }

    #[test]
    fn stride_makes_a_udp_segment_buffer() {
        let p = Pkt::tcp4(3000);
        let sp = p.build();
        let mut out = vec![0u8; 4000];
        let segs = split(&gso_hdr(&p, 1400), &sp, &mut out, 22).unwrap();
        assert_eq!(segs.count(), 3);
        assert_eq!(segs.stride(), 22 + 40 + 1400);
        assert_eq!(segs.total_len(), 2 * segs.stride() + 22 + 40 + 200);
        assert_eq!(segs.seg_len(3), 0);
        assert!(segs.packet(3).is_empty() && segs.slot(3).is_empty());
        assert_eq!(segs.packet(3).start, segs.total_len());
        assert!(out[segs.packet(3)].is_empty());
    }

    #[test]
    fn errors() {
        let p = Pkt::tcp4(3000);
        let sp = p.build();
        let good = gso_hdr(&p, 1000);
        let mut out = vec![0u8; 10_000];
        let cases = [
            (Header { gso_size: 0, ..good }, OffloadError::Malformed),
            (Header { csum_start: 24, ..good }, OffloadError::Malformed),
            (Header { csum_start: 0, ..good }, OffloadError::Malformed),
            (Header { gso_type: virtio_net::GSO_TCPV6, ..good }, OffloadError::Malformed),
            (Header { gso_type: virtio_net::GSO_UDP_L4, ..good }, OffloadError::Malformed),
            (Header { gso_type: virtio_net::GSO_UDP, ..good }, OffloadError::Unsupported),
            (Header { gso_type: 42, ..good }, OffloadError::Unsupported),
            (
                Header { csum_offset: 3019, ..Header { gso_type: 0, ..good } },
                OffloadError::Malformed,
            ),
        ];
        for (hdr, want) in cases {
            assert_eq!(split(&hdr, &sp, &mut out, 0), Err(want), "{hdr:?}");
        }
        // Out of space: one byte short, and many tiny segments.
        let need = plan(&good, &sp, 22).unwrap().total_len();
        assert_eq!(split(&good, &sp, &mut out[..need - 1], 22), Err(OffloadError::TooManySegments));
        let tiny = Header { gso_size: 1, ..good };
        assert_eq!(split(&tiny, &sp, &mut out, 22), Err(OffloadError::TooManySegments));
        assert_eq!(split(&good, &sp, &mut out, usize::MAX), Err(OffloadError::TooManySegments));
        // A bad TCP data offset, a fragment, an empty packet.
        let mut bad = sp.clone();
        bad[20 + 12] = 0x40;
        assert_eq!(split(&good, &bad, &mut out, 0), Err(OffloadError::Malformed));
        let mut frag = sp.clone();
        frag[6] = 0x20;
        assert_eq!(split(&good, &frag, &mut out, 0), Err(OffloadError::Malformed));
        assert_eq!(split(&good, &[], &mut out, 0), Err(OffloadError::Malformed));
        assert_eq!(split(&Header::NONE, &[], &mut out, 0).map(|s| s.total_len()), Ok(0));
    }

    /// A random super-packet: (IPv6?, UDP?, payload length, gso size, headroom).
    fn super_packet() -> impl Strategy<Value = (Pkt, u16, usize)> {
        (any::<bool>(), any::<bool>(), 0usize..20_000, 1u16..3000, 0usize..40, any::<[u8; 4]>())
            .prop_map(|(v6, udp, len, gso, headroom, r)| {
                let mut p = match (v6, udp) {
                    (false, false) => Pkt::tcp4(len),
                    (true, false) => Pkt::tcp6(len),
                    (false, true) => Pkt::udp4(len),
                    (true, true) => Pkt::udp6(len),
                };
                p.seq = u32::from_be_bytes(r);
                p.id = u16::from_be_bytes([r[0], r[1]]);
                p.payload.iter_mut().enumerate().for_each(|(i, b)| *b = (i as u8) ^ r[2]);
                if r[3] & 1 == 1 && !udp {
                    p.opts = vec![1, 1, 8, 10, r[0], r[1], r[2], r[3], 0, 0, 0, 0];
                }
                (p, gso, headroom)
            })
    }

    proptest! {
        /// (a) Every segment has valid checksums and at most gso_size payload; the payloads
        /// concatenate to the original one.
        #[test]
        fn split_segments_are_valid_and_cover_the_payload((p, gso, headroom) in super_packet()) {
            let mut sp = p.build();
            make_partial(&mut sp, p.ip_len(), if p.udp { 6 } else { 16 });
            let segs = split_all(&gso_hdr(&p, gso), &sp, headroom);
            let mut joined = Vec::new();
            for (i, s) in segs.iter().enumerate() {
                prop_assert!(checksums_valid(s));
                let pl = payload(s);
                prop_assert!(pl.len() <= usize::from(gso));
                if i + 1 < segs.len() {
                    prop_assert_eq!(pl.len(), usize::from(gso));
                }
                joined.extend_from_slice(pl);
            }
            prop_assert_eq!(joined, p.payload);
        }

        /// (c) Arbitrary headers over arbitrary bytes never panic, and a success stays in
        /// bounds.
        #[test]
        fn split_never_panics(
            hdr in any::<[u8; 10]>(),
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            out_len in 0usize..2000,
            headroom in 0usize..64,
        ) {
            let hdr = Header::parse(&hdr).unwrap();
            let mut out = vec![0u8; out_len];
            if let Ok(segs) = split(&hdr, &bytes, &mut out, headroom) {
                prop_assert!(segs.total_len() <= out_len);
            }
            let mut b = bytes.clone();
            let _ = finish_checksum(&hdr, &mut b);
        }

        /// (c) Near-valid input: a real super-packet with a header and some bytes mangled.
        #[test]
        fn split_never_panics_near_valid(
            (p, gso, headroom) in super_packet(),
            flips in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..4),
            hdr_flip in (0usize..10, any::<u8>()),
            cut in any::<u16>(),
        ) {
            let mut sp = p.build();
            for (at, v) in flips {
                let at = usize::from(at) % sp.len();
                sp[at] ^= v;
            }
            sp.truncate(usize::from(cut).max(1).min(sp.len()));
            let mut raw = [0u8; 10];
            gso_hdr(&p, gso).emit(&mut raw).unwrap();
            raw[hdr_flip.0] ^= hdr_flip.1;
            let hdr = Header::parse(&raw).unwrap();
            let mut out = vec![0u8; 40_000];
            let _ = split(&hdr, &sp, &mut out, headroom);
        }
    }
}
