//! Raw IPv4 sockets for the ipip backend: the same [`BatchSocket`] (`sendmmsg`/`recvmmsg`,
//! caller-owned buffers, the same errors), over `SOCK_RAW` instead of UDP.
//!
//! - **Sending** ([`BatchSocket::open_ipip_tx`]): an `IPPROTO_RAW` socket, which implies
//!   `IP_HDRINCL` and receives nothing. Each message is a whole outer IPv4 packet
//!   ([`crate::dataplane::wire::ipip::emit_outer`]); the kernel fills in a zero source
//!   address (the socket's binding, or the route's source behind NAT) and a zero
//!   identification, sets the total length and the header checksum, and fragments nothing (a
//!   packet past the device MTU is `EMSGSIZE`). There is no GSO for raw IP: every message is
//!   one packet, so [`BatchSocket::gso_limits`] says one datagram and TSO super-packets from TUN
//!   are split in user space before encapsulation.
//! - **Receiving** ([`BatchSocket::open_ipip_rx`]): an `IPPROTO_IPIP` socket bound on the public
//!   IP gets every protocol-4 packet to that address, outer header included, after the
//!   kernel verified the header checksum and reassembled fragments. Every raw socket of the
//!   protocol gets its own copy of each packet (raw sockets have no `SO_REUSEPORT` group), so
//!   with several workers each worker's socket carries a classic BPF filter
//!   ([`spread_filter`]) that keeps the packets whose inner addresses hash to that worker and
//!   drops the rest in the kernel: one flow stays on one worker, and each packet is read once.
//!   There is no GRO cmsg for raw sockets: each message is one packet. (A NIC's GRO can merge
//!   IP-in-IP flows before local delivery; weft's buffers hold 64 KiB, but the merged inner
//!   packet is then larger than the TUN MTU; see docs/dataplane.md, "ipip".)
//!
//! Both need `CAP_NET_RAW`, which weft's other backends do not (docs/install.md).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use socket2::{Domain, Protocol, SockAddr, SockFilter, Socket, Type};

use super::gso_retry::GsoRetryConfig;
use super::gso_tail::TailRule;
use super::{BatchSocket, MAX_BATCH, RecvMeta, UdpConfig, UdpError, size_buffers};
use crate::dataplane::wire::ipip;

/// `IPPROTO_RAW`: send-only raw IPv4, the header included.
const IPPROTO_RAW: i32 = libc::IPPROTO_RAW;

/// Classic BPF opcodes ([`spread_filter`]), from `linux/filter.h` (libc has no `BPF_*`
/// constants for Linux).
mod bpf {
    pub(super) const LD_W_IND: u16 = 0x40; // BPF_LD | BPF_W | BPF_IND
    pub(super) const LD_W_LEN: u16 = 0x80; // BPF_LD | BPF_W | BPF_LEN
    pub(super) const LDX_B_MSH: u16 = 0xb1; // BPF_LDX | BPF_B | BPF_MSH
    pub(super) const LDX_MEM: u16 = 0x61; // BPF_LDX | BPF_W | BPF_MEM
    pub(super) const ST: u16 = 0x02; // BPF_ST
    pub(super) const TXA: u16 = 0x87; // BPF_MISC | BPF_TXA
    pub(super) const ALU_ADD_K: u16 = 0x04; // BPF_ALU | BPF_ADD | BPF_K
    pub(super) const ALU_XOR_X: u16 = 0xac; // BPF_ALU | BPF_XOR | BPF_X
    pub(super) const ALU_MOD_K: u16 = 0x94; // BPF_ALU | BPF_MOD | BPF_K
    pub(super) const JGE_X: u16 = 0x3d; // BPF_JMP | BPF_JGE | BPF_X
    pub(super) const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    pub(super) const RET_K: u16 = 0x06; // BPF_RET | BPF_K
}

/// A filter's "keep the whole packet" (the return value is how many bytes to keep).
const KEEP: u32 = u32::MAX;

/// The classic BPF program that keeps, of the IP-in-IP packets a raw socket sees, those of
/// worker `worker` of `workers` (at least 2): the XOR of the inner source and destination
/// addresses, modulo `workers`. Both directions of a flow hash alike, and one flow's packets
/// stay on one worker, in order. A packet too short to hold an inner header goes to worker 0,
/// whose receive path counts it as malformed.
///
/// The outer header's length is read from its IHL (`ldxb 4*([0]&0xf)`), so outer options
/// are skipped.
pub(crate) fn spread_filter(worker: usize, workers: usize) -> Vec<SockFilter> {
    spread_program(worker, workers)
        .into_iter()
        .map(|(code, jt, jf, k)| SockFilter::new(code, jt, jf, k))
        .collect()
}

/// One classic BPF instruction: opcode, jump if true, jump if false, constant.
type Insn = (u16, u8, u8, u32);

/// [`spread_filter`]'s program, as plain instructions.
fn spread_program(worker: usize, workers: usize) -> Vec<Insn> {
    let workers = u32::try_from(workers.max(1)).unwrap_or(u32::MAX);
    let worker = u32::try_from(worker).unwrap_or(0) % workers;
    let short = if worker == 0 { KEEP } else { 0 };
    let f = |code, jt, jf, k| (code, jt, jf, k);
    vec![
        // X = outer header length; M[1] = X + the inner header's 20 bytes.
        f(bpf::LDX_B_MSH, 0, 0, 0),
        f(bpf::TXA, 0, 0, 0),
        f(bpf::ALU_ADD_K, 0, 0, 20),
        f(bpf::ST, 0, 0, 1),
        // A short packet goes to worker 0.
        f(bpf::LD_W_LEN, 0, 0, 0),
        f(bpf::LDX_MEM, 0, 0, 1),
        f(bpf::JGE_X, 1, 0, 0),
        f(bpf::RET_K, 0, 0, short),
        // A = inner source ^ inner destination, modulo the workers.
        f(bpf::LDX_B_MSH, 0, 0, 0),
        f(bpf::LD_W_IND, 0, 0, 12),
        f(bpf::ST, 0, 0, 0),
        f(bpf::LD_W_IND, 0, 0, 16),
        f(bpf::LDX_MEM, 0, 0, 0),
        f(bpf::ALU_XOR_X, 0, 0, 0),
        f(bpf::ALU_MOD_K, 0, 0, workers),
        f(bpf::JEQ_K, 0, 1, worker),
        f(bpf::RET_K, 0, 0, KEEP),
        f(bpf::RET_K, 0, 0, 0),
    ]
}

/// The worker [`spread_filter`] gives an IP-in-IP `packet` to, computed as the filter does:
/// the reference its tests compare the kernel against.
#[cfg(test)]
pub(crate) fn spread_worker(packet: &[u8], workers: usize) -> usize {
    let hl = usize::from(packet.first().map_or(0, |b| b & 0xf)) * 4;
    let word =
        |at: usize| packet.get(at..at + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    match (packet.len() >= hl + 20, word(hl + 12), word(hl + 16)) {
        (true, Some(src), Some(dst)) => ((src ^ dst) % workers as u32) as usize,
        _ => 0,
    }
}

/// A raw socket's configuration for [`BatchSocket::ready`]: no GSO, no GRO (neither exists
/// for raw IP; the probes would fail anyway).
fn raw_config(bind: Ipv4Addr) -> UdpConfig {
    UdpConfig {
        bind: SocketAddr::V4(SocketAddrV4::new(bind, 0)),
        reuse_port: false,
        gso: false,
        gro: false,
        gso_retry: GsoRetryConfig::default(),
        gso_tail: TailRule::Any,
        buffer_bytes: 0,
    }
}

/// A raw IPv4 socket of `protocol`, its buffers sized, bound on `bind`.
fn open_raw(protocol: i32, bind: Ipv4Addr, buffer_bytes: usize) -> Result<Socket, UdpError> {
    let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(protocol)))
        .map_err(UdpError::RawSocket)?;
    size_buffers(&socket, buffer_bytes)?;
    let addr = SocketAddr::V4(SocketAddrV4::new(bind, 0));
    socket.bind(&SockAddr::from(addr)).map_err(|source| UdpError::Bind { addr, source })?;
    Ok(socket)
}

impl BatchSocket {
    /// The socket IP-in-IP packets leave from: `IPPROTO_RAW`, bound on `bind` (the public IP,
    /// or the wildcard behind NAT).
    pub(crate) fn open_ipip_tx(bind: Ipv4Addr, buffer_bytes: usize) -> Result<Self, UdpError> {
        let socket = open_raw(IPPROTO_RAW, bind, buffer_bytes)?;
        Self::ready(socket, raw_config(bind))
    }

    /// Worker `worker`'s socket of `workers` for IP-in-IP packets to `bind`: `IPPROTO_IPIP`,
    /// with [`spread_filter`] when there are several workers. What was queued before the
    /// filter was attached (every raw socket of the protocol gets every packet) is drained.
    pub(crate) fn open_ipip_rx(
        bind: Ipv4Addr,
        worker: usize,
        workers: usize,
        buffer_bytes: usize,
    ) -> Result<Self, UdpError> {
        let socket = open_raw(i32::from(ipip::PROTOCOL), bind, buffer_bytes)?;
        if workers > 1 {
            socket
                .attach_filter(&spread_filter(worker, workers))
                .map_err(|source| UdpError::SetOption { option: "SO_ATTACH_FILTER", source })?;
        }
        let mut sock = Self::ready(socket, raw_config(bind))?;
        if workers > 1 {
            sock.drain()?;
        }
        Ok(sock)
    }

    /// Reads and discards whatever is queued.
    fn drain(&mut self) -> Result<(), UdpError> {
        let mut bufs = [[0u8; 64]; MAX_BATCH];
        let mut metas = [RecvMeta::default(); MAX_BATCH];
        while self.recv_batch(&mut bufs, &mut metas, Duration::ZERO)? > 0 {}
        Ok(())
    }

    /// Whether this is a raw IPv4 socket of the ipip backend (to adopt it as one).
    pub(crate) fn is_raw(socket: &Socket) -> bool {
        matches!(
            (socket.r#type(), socket.protocol()),
            (Ok(Type::RAW), Ok(Some(p))) if p == Protocol::from(IPPROTO_RAW)
                || p == Protocol::from(i32::from(ipip::PROTOCOL))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(outer_ihl: u8, src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
        let hl = usize::from(outer_ihl) * 4;
        let mut p = vec![0u8; hl + 20];
        p[0] = 0x40 | outer_ihl;
        p[hl] = 0x45;
        p[hl + 12..hl + 16].copy_from_slice(&src);
        p[hl + 16..hl + 20].copy_from_slice(&dst);
        p
    }

    #[test]
    fn the_reference_spreads_by_inner_addresses_alone() {
        let a = packet(5, [10, 244, 1, 2], [10, 244, 2, 3]);
        let b = packet(5, [10, 244, 2, 3], [10, 244, 1, 2]);
        let c = packet(6, [10, 244, 1, 2], [10, 244, 2, 3]);
        for workers in 2..5 {
            assert_eq!(spread_worker(&a, workers), spread_worker(&b, workers), "both ways");
            assert_eq!(spread_worker(&a, workers), spread_worker(&c, workers), "outer options");
        }
        assert_eq!(spread_worker(&a[..39], 2), 0, "short: worker 0");
        let seen: std::collections::BTreeSet<_> = (0..16u8)
            .map(|i| spread_worker(&packet(5, [10, 244, 1, i], [10, 244, 2, 3]), 4))
            .collect();
        assert_eq!(seen.len(), 4, "flows spread over every worker");
    }

    /// Runs a classic BPF program over `packet` as the kernel's interpreter does, for the
    /// opcodes [`spread_program`] uses: the bytes to keep (0: drop). A load past the end ends
    /// the program with 0, as in the kernel.
    fn run(program: &[Insn], packet: &[u8]) -> u32 {
        let (mut a, mut x, mut mem, mut pc) = (0u32, 0u32, [0u32; 16], 0usize);
        let word = |at: usize| {
            packet.get(at..at + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        while let Some(&(code, jt, jf, k)) = program.get(pc) {
            pc += 1;
            match code {
                bpf::LD_W_IND => match word(x as usize + k as usize) {
                    Some(w) => a = w,
                    None => return 0,
                },
                bpf::LD_W_LEN => a = packet.len() as u32,
                bpf::LDX_B_MSH => match packet.get(k as usize) {
                    Some(b) => x = u32::from(b & 0xf) * 4,
                    None => return 0,
                },
                bpf::LDX_MEM => x = mem[k as usize],
                bpf::ST => mem[k as usize] = a,
                bpf::TXA => a = x,
                bpf::ALU_ADD_K => a = a.wrapping_add(k),
                bpf::ALU_XOR_X => a ^= x,
                bpf::ALU_MOD_K => a %= k,
                bpf::JGE_X => pc += usize::from(if a >= x { jt } else { jf }),
                bpf::JEQ_K => pc += usize::from(if a == k { jt } else { jf }),
                bpf::RET_K => return k,
                other => panic!("opcode {other:#x} not interpreted"),
            }
        }
        panic!("the program fell off its end")
    }

    #[test]
    fn every_packet_goes_to_exactly_the_worker_the_reference_names() {
        // Never empty: a raw socket delivers whole IPv4 packets, at least a header long.
        let mut packets = vec![vec![0x45], vec![0x45; 39], vec![0x4f; 40]];
        for i in 0..40u8 {
            packets.push(packet(5, [10, 244, 1, i], [10, 244, 2 + i % 3, 3]));
            packets.push(packet(5 + i % 3, [192, 168, i, 1], [10, 0, 0, i]));
            let mut long = packet(5, [10, 244, 9, i], [10, 244, 2, 7]);
            long.extend_from_slice(&[i; 1400]);
            packets.push(long);
        }
        for workers in 2..5 {
            let programs: Vec<_> = (0..workers).map(|w| spread_program(w, workers)).collect();
            assert!(programs.iter().all(|p| p.len() <= 4096), "within BPF_MAXINSNS");
            for p in &packets {
                let kept: Vec<usize> =
                    (0..workers).filter(|&w| run(&programs[w], p) != 0).collect();
                assert_eq!(kept, [spread_worker(p, workers)], "{workers} workers, {p:?}");
                assert_eq!(run(&programs[kept[0]], p), KEEP, "kept whole");
            }
        }
    }
}
