//! Packet builders with valid checksums, and checkers, for the offload tests.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::VIRTIO_HEADROOM;
use crate::dataplane::wire::{checksum, ip, ipv4, ipv6, tcp, udp};

/// A TCP or UDP packet to build. Defaults: IPv4 10.244.1.2:40000 -> 10.244.2.3:5201, ACK, DF,
/// TTL 64, window 502, no options.
#[derive(Clone, Debug)]
pub(crate) struct Pkt {
    pub(crate) v6: bool,
    pub(crate) udp: bool,
    pub(crate) src: [u8; 16],
    pub(crate) dst: [u8; 16],
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) seq: u32,
    pub(crate) ack: u32,
    pub(crate) flags: u8,
    pub(crate) id: u16,
    pub(crate) df: bool,
    pub(crate) mf: bool,
    pub(crate) tos: u8,
    pub(crate) ttl: u8,
    pub(crate) window: u16,
    pub(crate) opts: Vec<u8>,
    pub(crate) payload: Vec<u8>,
}

impl Pkt {
    pub(crate) fn tcp4(payload_len: usize) -> Self {
        let mut src = [0; 16];
        let mut dst = [0; 16];
        src[..4].copy_from_slice(&[10, 244, 1, 2]);
        dst[..4].copy_from_slice(&[10, 244, 2, 3]);
        Self {
            v6: false,
            udp: false,
            src,
            dst,
            sport: 40000,
            dport: 5201,
            seq: 1000,
            ack: 77,
            flags: tcp::ACK,
            id: 100,
            df: true,
            mf: false,
            tos: 0,
            ttl: 64,
            window: 502,
            opts: Vec::new(),
            payload: (0..payload_len).map(|i| i as u8).collect(),
        }
    }

    pub(crate) fn tcp6(payload_len: usize) -> Self {
        let mut p = Self::tcp4(payload_len);
        p.v6 = true;
        p.src = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 1, 2).octets();
        p.dst = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 2, 3).octets();
        p
    }

    pub(crate) fn udp4(payload_len: usize) -> Self {
        Self { udp: true, flags: 0, ..Self::tcp4(payload_len) }
    }

    pub(crate) fn udp6(payload_len: usize) -> Self {
        Self { udp: true, flags: 0, ..Self::tcp6(payload_len) }
    }

    fn v4_addrs(&self) -> (Ipv4Addr, Ipv4Addr) {
        let a = |b: &[u8; 16]| Ipv4Addr::new(b[0], b[1], b[2], b[3]);
        (a(&self.src), a(&self.dst))
    }

    /// The IP header length.
    pub(crate) fn ip_len(&self) -> usize {
        if self.v6 { ipv6::HEADER_LEN } else { ipv4::HEADER_LEN }
    }

    /// The L4 header length.
    pub(crate) fn l4_len(&self) -> usize {
        if self.udp { udp::HEADER_LEN } else { tcp::HEADER_LEN + self.opts.len() }
    }

    /// The packet bytes, with valid checksums.
    pub(crate) fn build(&self) -> Vec<u8> {
        let ip_len = self.ip_len();
        let l4_hdr = self.l4_len();
        let l4_total = l4_hdr + self.payload.len();
        let total = ip_len + l4_total;
        let mut p = vec![0u8; total];
        let proto = if self.udp { ip::proto::UDP } else { ip::proto::TCP };
        if self.v6 {
            p[0] = 0x60 | (self.tos >> 4);
            p[1] = self.tos << 4;
            p[4..6].copy_from_slice(&(l4_total as u16).to_be_bytes());
            p[6] = proto;
            p[7] = self.ttl;
            p[8..24].copy_from_slice(&self.src);
            p[24..40].copy_from_slice(&self.dst);
        } else {
            p[0] = 0x45;
            p[1] = self.tos;
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            p[4..6].copy_from_slice(&self.id.to_be_bytes());
            p[6] = if self.df { 0x40 } else { 0 } | if self.mf { 0x20 } else { 0 };
            p[8] = self.ttl;
            p[9] = proto;
            p[12..16].copy_from_slice(&self.src[..4]);
            p[16..20].copy_from_slice(&self.dst[..4]);
            ipv4::Packet::new_unchecked(&mut p[..]).fill_checksum();
        }
        let (v4s, v4d) = self.v4_addrs();
        let (v6s, v6d) = (Ipv6Addr::from(self.src), Ipv6Addr::from(self.dst));
        let l4 = &mut p[ip_len..];
        l4[0..2].copy_from_slice(&self.sport.to_be_bytes());
        l4[2..4].copy_from_slice(&self.dport.to_be_bytes());
        l4[l4_hdr..].copy_from_slice(&self.payload);
        if self.udp {
            let mut u = udp::Packet::new_unchecked(l4);
            u.set_len(l4_total as u16);
            if self.v6 { u.fill_checksum_v6(v6s, v6d) } else { u.fill_checksum_v4(v4s, v4d) }
        } else {
            let mut t = tcp::Packet::new_unchecked(l4);
            t.set_seq_number(self.seq);
            t.set_ack_number(self.ack);
            t.set_header_len(l4_hdr as u8);
            t.set_flags(self.flags);
            t.set_window_len(self.window);
            t.options_mut().copy_from_slice(&self.opts);
            let r =
                if self.v6 { t.fill_checksum_v6(v6s, v6d) } else { t.fill_checksum_v4(v4s, v4d) };
            r.unwrap();
        }
        p
    }

    /// `n` consecutive segments of this flow, each with `self.payload.len()` bytes except the
    /// last with `last` bytes; sequence numbers and IDs continue from `self`.
    pub fn run(&self, n: usize, last: usize) -> Vec<Vec<u8>> {
        let mut p = self.clone();
        let mut out = Vec::new();
        for i in 0..n {
            if i + 1 == n {
                p.payload.truncate(last);
            }
            out.push(p.build());
            p.seq = p.seq.wrapping_add(p.payload.len() as u32);
            p.id = p.id.wrapping_add(1);
        }
        out
    }
}

/// Buffers for [`super::GroTable::coalesce`]: each packet behind `VIRTIO_HEADROOM` bytes, in a
/// buffer of `VIRTIO_HEADROOM + cap` bytes (at least the packet).
pub(crate) fn batch(pkts: &[Vec<u8>], cap: usize) -> (Vec<Vec<u8>>, Vec<usize>) {
    let bufs = pkts
        .iter()
        .map(|p| {
            let mut b = vec![0xa5; VIRTIO_HEADROOM + cap.max(p.len())];
            b[VIRTIO_HEADROOM..][..p.len()].copy_from_slice(p);
            b
        })
        .collect();
    (bufs, pkts.iter().map(Vec::len).collect())
}

/// Whether the IP header checksum (IPv4) and the TCP/UDP checksum of `p` are valid.
pub(crate) fn checksums_valid(p: &[u8]) -> bool {
    match ip::version(p) {
        Some(4) => {
            let Ok(ip) = ipv4::Packet::new_checked(p) else { return false };
            let (s, d) = (ip.src_addr(), ip.dst_addr());
            ip.verify_checksum()
                && l4_valid(ip.payload(), ip.protocol(), |proto, len| {
                    checksum::pseudo_header_v4(s, d, proto, len as u16)
                })
        }
        Some(6) => {
            let Ok(ip) = ipv6::Packet::new_checked(p) else { return false };
            let (s, d) = (ip.src_addr(), ip.dst_addr());
            l4_valid(ip.payload(), ip.next_header(), |proto, len| {
                checksum::pseudo_header_v6(s, d, proto, len as u32)
            })
        }
        _ => false,
    }
}

fn l4_valid(l4: &[u8], proto: u8, ph: impl Fn(u8, usize) -> u16) -> bool {
    checksum::combine(&[ph(proto, l4.len()), checksum::data(l4)]) == 0xffff
}

/// The TCP/UDP payload of a valid packet.
pub(crate) fn payload(p: &[u8]) -> &[u8] {
    let (ip_len, proto) = if p[0] >> 4 == 4 { (ipv4::HEADER_LEN, p[9]) } else { (40, p[6]) };
    let l4 = &p[ip_len..];
    let l4_len = if proto == ip::proto::UDP { 8 } else { usize::from(l4[12] >> 4) * 4 };
    &l4[l4_len..]
}
