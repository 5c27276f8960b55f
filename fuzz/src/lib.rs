//! Shared pieces of the fuzz targets: packets with valid checksums built from structured input
//! (so the fuzzer gets past checksum checks), and route tables built through the route module's
//! public API.

use std::net::{Ipv4Addr, Ipv6Addr};

use arbitrary::{Arbitrary, Result, Unstructured};
use weft::dataplane::wire::{checksum, ip, ipv4, ipv6, tcp, udp};
use weft::lease::record::Subnet;
use weft::route::{Peer, Peer6, PeerBackend, RouteTable};

/// A TCP or UDP packet over IPv4 or IPv6, every checksum valid unless `corrupt` says otherwise.
#[derive(Arbitrary, Clone, Debug)]
pub struct ArbPacket {
    pub v6: bool,
    pub udp: bool,
    /// Index into a few addresses (so flows repeat) or, when large, raw.
    pub src: u8,
    pub dst: u8,
    pub sport: u8,
    pub dport: u8,
    pub seq: u32,
    pub ack: u8,
    pub flags: u8,
    pub id: u16,
    pub df: bool,
    pub tos: u8,
    pub ttl: u8,
    pub window: u8,
    /// TCP option words (0..=10).
    pub opt_words: u8,
    pub payload_len: u16,
    /// (offset, xor) applied after the checksums are filled.
    pub corrupt: Option<(u16, u8)>,
}

fn addr4(i: u8) -> Ipv4Addr {
    if i < 8 { Ipv4Addr::new(10, 244, i % 4, 2 + i / 4) } else { Ipv4Addr::new(10, i, 1, i) }
}

fn addr6(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, u16::from(i % 4), u16::from(i))
}

impl ArbPacket {
    /// The packet bytes; `payload_len` is capped at `max_payload`.
    pub fn build(&self, max_payload: usize) -> Vec<u8> {
        self.build_with(max_payload, None)
    }

    /// As [`build`](Self::build), with these IPv4 source and destination addresses (ignored
    /// for IPv6).
    pub fn build_with(&self, max_payload: usize, addrs: Option<(Ipv4Addr, Ipv4Addr)>) -> Vec<u8> {
        let opts = usize::from(self.opt_words % 11) * 4;
        let l4_len = if self.udp { udp::HEADER_LEN } else { tcp::HEADER_LEN + opts };
        let ip_len = if self.v6 { ipv6::HEADER_LEN } else { ipv4::HEADER_LEN };
        let payload = usize::from(self.payload_len).min(max_payload);
        let total = ip_len + l4_len + payload;
        let mut p = vec![0u8; total];
        let proto = if self.udp { ip::proto::UDP } else { ip::proto::TCP };
        for (i, b) in p[ip_len + l4_len..].iter_mut().enumerate() {
            *b = i as u8;
        }
        {
            let l4 = &mut p[ip_len..];
            l4[0..2].copy_from_slice(&(40000 + u16::from(self.sport % 4)).to_be_bytes());
            l4[2..4].copy_from_slice(&(5201 + u16::from(self.dport % 4)).to_be_bytes());
            if self.udp {
                l4[4..6].copy_from_slice(&((l4_len + payload) as u16).to_be_bytes());
            } else {
                l4[4..8].copy_from_slice(&self.seq.to_be_bytes());
                l4[8..12].copy_from_slice(&u32::from(self.ack % 4).to_be_bytes());
                l4[12] = ((l4_len / 4) as u8) << 4;
                l4[13] = self.flags;
                l4[14..16].copy_from_slice(&(500 + u16::from(self.window % 4)).to_be_bytes());
                for o in &mut l4[20..20 + opts] {
                    *o = 1; // NOP
                }
            }
        }
        if self.v6 {
            let (s, d) = (addr6(self.src), addr6(self.dst));
            let mut ip = ipv6::Packet::new_unchecked(&mut p[..]);
            ip.set_version(6);
            ip.set_traffic_class(self.tos);
            ip.set_payload_len((l4_len + payload) as u16);
            ip.set_next_header(proto);
            ip.set_hop_limit(self.ttl);
            ip.set_src_addr(s);
            ip.set_dst_addr(d);
            fill_l4_v6(&mut p[ip_len..], self.udp, s, d);
        } else {
            let (s, d) = addrs.unwrap_or((addr4(self.src), addr4(self.dst)));
            let mut ip = ipv4::Packet::new_unchecked(&mut p[..]);
            ip.set_version(4);
            ip.set_header_len(20);
            ip.set_dscp_ecn(self.tos);
            ip.set_total_len(total as u16);
            ip.set_ident(self.id);
            ip.set_dont_frag(self.df);
            ip.set_ttl(self.ttl);
            ip.set_protocol(proto);
            ip.set_src_addr(s);
            ip.set_dst_addr(d);
            ip.fill_checksum();
            fill_l4_v4(&mut p[ip_len..], self.udp, s, d);
        }
        if let Some((at, x)) = self.corrupt {
            let n = p.len();
            p[usize::from(at) % n] ^= x;
        }
        p
    }
}

fn fill_l4_v4(l4: &mut [u8], is_udp: bool, s: Ipv4Addr, d: Ipv4Addr) {
    if is_udp {
        udp::Packet::new_unchecked(l4).fill_checksum_v4(s, d);
    } else {
        let _ = tcp::Packet::new_unchecked(l4).fill_checksum_v4(s, d);
    }
}

fn fill_l4_v6(l4: &mut [u8], is_udp: bool, s: Ipv6Addr, d: Ipv6Addr) {
    if is_udp {
        udp::Packet::new_unchecked(l4).fill_checksum_v6(s, d);
    } else {
        let _ = tcp::Packet::new_unchecked(l4).fill_checksum_v6(s, d);
    }
}

/// Either a well-formed packet or raw bytes.
#[derive(Arbitrary, Clone, Debug)]
pub enum AnyPacket {
    Built(ArbPacket),
    Raw(Vec<u8>),
}

impl AnyPacket {
    pub fn bytes(&self, max_payload: usize) -> Vec<u8> {
        match self {
            AnyPacket::Built(p) => p.build(max_payload),
            AnyPacket::Raw(b) => b.clone(),
        }
    }
}

/// Whether the ones' complement sum over `data` verifies (sums to 0xffff).
pub fn sums_to_ones(parts: &[u16]) -> bool {
    checksum::combine(parts) == 0xffff
}

/// A peer of a fuzzed route table: subnet and backend drawn from the input.
#[derive(Arbitrary, Clone, Debug)]
pub struct ArbPeer {
    /// Subnet index inside the network (taken modulo the number of subnets).
    pub index: u32,
    /// `None`: the table's subnet length; `Some(l)`: `l % 33` (other lengths, on purpose).
    pub len: Option<u8>,
    /// Host part of 192.0.2.x for the public IP (0 and 255 included).
    pub public: u8,
    pub backend: u8,
    pub mac: Option<[u8; 6]>,
    pub vni: Option<u32>,
    pub stale: bool,
    /// An IPv6 half `fd00:10:244:<n>::/(48 + len % 17)` behind `2001:db8::<public>`, with the
    /// VTEP MAC `mac` (or 02:..:02): `(n, len)`.
    pub ipv6: Option<(u16, u8)>,
}

/// A network (prefix 8..=30 mostly, any when `wide`) and its subnet length.
#[derive(Arbitrary, Clone, Copy, Debug)]
pub struct ArbNetwork {
    pub addr: u32,
    pub prefix: u8,
    pub subnet_len: u8,
}

impl ArbNetwork {
    pub fn net(&self) -> ipnet::Ipv4Net {
        let prefix = 8 + self.prefix % 23; // 8..=30
        ipnet::Ipv4Net::new(Ipv4Addr::from(self.addr), prefix).unwrap().trunc()
    }

    pub fn subnet_len(&self) -> u8 {
        // Mostly prefix..=prefix+12 (a table of at most 4096 slots), sometimes anything to 32.
        let p = self.net().prefix_len();
        if self.subnet_len >= 240 {
            self.subnet_len % 33
        } else {
            (p + self.subnet_len % 13).min(32)
        }
    }

    /// The `i`th subnet of length `len` inside the network (or around it if `len` is shorter).
    pub fn subnet(&self, i: u32, len: u8) -> Subnet {
        let net = self.net();
        let base = u32::from(net.network());
        let shift = 32 - u32::from(len);
        let extra = u32::from(len.saturating_sub(net.prefix_len()));
        let count = if extra >= 32 { u32::MAX } else { (1u32 << extra).max(1) };
        let off = if shift >= 32 { 0 } else { (i % count) << shift };
        let addr = base.wrapping_add(off);
        let mask = if len == 0 { 0 } else { u32::MAX << shift };
        Subnet::from_parts(Ipv4Addr::from(addr & mask), len).unwrap()
    }

    pub fn peer(&self, p: &ArbPeer) -> Peer {
        let len = p.len.map_or(self.subnet_len(), |l| l % 33);
        Peer {
            subnet: self.subnet(p.index, len),
            public_ip: Ipv4Addr::new(192, 0, 2, p.public),
            backend: match p.backend % 4 {
                0 => PeerBackend::Vxlan,
                1 => PeerBackend::Udp,
                2 => PeerBackend::Ipip,
                _ => PeerBackend::Other,
            },
            vtep_mac: p.mac.map(weft::dataplane::wire::ethernet::MacAddr),
            vni: p.vni,
            node: None,
            stale: p.stale,
            incarnation: None,
            ipv6: p.ipv6.map(|(n, len)| {
                let len = 48 + len % 17;
                let net =
                    ipnet::Ipv6Net::new(Ipv6Addr::new(0xfd00, 0x10, 0x244, n, 0, 0, 0, 0), len)
                        .unwrap()
                        .trunc();
                Peer6 {
                    subnet: weft::lease::record::Ipv6Subnet::new(net).unwrap(),
                    public_ip: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(p.public)),
                    vtep_mac: weft::dataplane::wire::ethernet::MacAddr(p.mac.unwrap_or([2; 6])),
                    wireguard: None,
                }
            }),
        }
    }

    pub fn table(&self, peers: &[ArbPeer]) -> RouteTable {
        RouteTable::build(self.net(), self.subnet_len(), peers.iter().map(|p| self.peer(p)))
    }
}

/// The longest-prefix match over `peers`, the slow obvious way (later peers win ties, as
/// `RouteTable::build` keeps the later of two peers with one subnet).
pub fn naive_lookup(peers: &[Peer], dst: Ipv4Addr) -> Option<&Peer> {
    peers.iter().filter(|p| p.subnet.contains(dst)).max_by_key(|p| p.subnet.prefix_len())
}

/// Reads an `Unstructured` to its end, for targets that take a byte tail after a structure.
pub fn rest<'a>(u: &mut Unstructured<'a>) -> Result<&'a [u8]> {
    u.bytes(u.len())
}
