//! TUN offloads in pure code: splitting TSO/USO super-packets read from TUN ([`split`]) and
//! coalescing received TCP/UDP segments into super-packets for one TUN write ([`GroTable`]).
//!
//! A TUN device opened with `IFF_VNET_HDR` and `TUNSETOFFLOAD(TUN_F_CSUM | TUN_F_TSO4 |
//! TUN_F_TSO6 [| TUN_F_USO4 | TUN_F_USO6])` hands over, and accepts, packets of up to 64 KiB
//! behind a [`virtio_net::Header`] that says how to cut them into wire-sized segments. One
//! syscall then moves ~45 segments instead of one; that is the whole point (docs/benchmarks.md).
//! The rules follow the kernel's GSO/GRO and wireguard-go's `tun/offload_linux.go`.
//!
//! # Contract
//! - Pure: no I/O, no locks, no logging; nothing here panics on any input (headers and packet
//!   bytes are untrusted), and the per-packet path does not allocate: callers own every buffer,
//!   and [`GroTable`] keeps scratch space it reuses from batch to batch.
//! - TX ([`split`]): the caller reads `virtio_net_hdr` + packet from TUN, and `split` writes each
//!   segment, with fixed IP and L4 headers and a complete L4 checksum, into one flat output
//!   buffer at a fixed stride, `headroom` bytes after its slot's start, so encapsulation can
//!   write its headers in place and the whole run is one `UDP_SEGMENT` send. See [`Segments`].
//! - RX ([`GroTable::coalesce`]): the caller hands a batch of IP packets, each behind
//!   [`VIRTIO_HEADROOM`] free bytes, and gets back which buffers to write to TUN, each now
//!   starting with its `virtio_net_hdr`.
//! - Every offload is switchable (kernel bugs have made each one wrong at some point,
//!   docs/benchmarks.md): [`GroConfig`] turns TCP and UDP coalescing on and off, and a caller
//!   without TSO simply never sees a GSO header.
//!
//!
//! # Use
//! ```no_run
//! use weft::dataplane::offload::{GroTable, split};
//! use weft::dataplane::transport::HEADROOM;
//! use weft::dataplane::wire::virtio_net::{self, Header};
//!
//! /// TX: `read` is one TUN read (header + packet); `out` is reused for every read.
//! fn tx(read: &[u8], out: &mut [u8]) {
//!     let Ok(hdr) = Header::parse(read) else { return };
//!     let Ok(segs) = split(&hdr, &read[virtio_net::LEN..], out, HEADROOM) else { return };
//!     for i in 0..segs.count() {
//!         let _slot = &mut out[segs.slot(i)];
//!         // Forwarder::encap(&routes, _slot, segs.seg_len(i), ..) fills _slot[..HEADROOM].
//!     }
//!     // All segments go to one peer: send out[..segs.total_len()] with
//!     // UDP_SEGMENT = segs.stride() (at most 64 segments per send).
//! }
//!
//! /// RX: each packet at bufs[i][VIRTIO_HEADROOM..][..lens[i]].
//! fn rx(table: &mut GroTable, bufs: &mut [Vec<u8>], lens: &mut [usize]) {
//!     for &i in table.coalesce(bufs, lens) {
//!         let _write = &bufs[i][..lens[i]]; // one write() to TUN
//!     }
//! }
//! ```
//!
//! [`virtio_net::Header`]: super::wire::virtio_net::Header

#![forbid(unsafe_code)]

mod gro;
pub mod kernel_bugs;
mod split;

#[cfg(test)]
pub mod testutil;

pub use gro::{GroConfig, GroTable, GroWrite, MAX_CHAIN, PacketRef, VIRTIO_HEADROOM};
pub use split::{Segments, finish_checksum, plan, split};

/// Why a packet could not be split (or its checksum finished).
///
/// Small and `Copy` so the data path can count failures per reason without allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum OffloadError {
    /// The output buffer cannot hold every segment the packet splits into (for `GSO_NONE`, the
    /// one packet); nothing useful was written.
    #[error("output buffer too small for the segments")]
    TooManySegments,
    /// The `virtio_net_hdr` and the packet disagree: the checksum position is outside the
    /// packet, the IP version or protocol does not match the GSO type, a header length is
    /// impossible, the GSO size is zero, or a segment would not fit a 16-bit length field.
    #[error("virtio_net header and packet are inconsistent")]
    Malformed,
    /// A GSO type this code does not split (`GSO_UDP`, UDP fragmentation offload, or an unknown
    /// value).
    #[error("unsupported GSO type")]
    Unsupported,
}
