//! GSO messages that never end on a full segment: how weft keeps UDP GSO on the kernels whose
//! GSO mangles a message that does (the `udp_gso_mangled_v7_0` row of
//! [`crate::dataplane::offload::kernel_bugs::KNOWN_BUGS`]).
//!
//! # The bug it avoids
//! A NIC that segments UDP in hardware through `GSO_PARTIAL` gets from the kernel a chunk of
//! whole segments (and, separately, a shorter remainder, if there is one) and cuts the chunk
//! into datagrams, copying its UDP header as a template. The affected kernels write the
//! template's UDP length as one segment's only while the chunk is not the message's last
//! piece; when the message's length is a multiple of the segment size there is no remainder,
//! the chunk is the last piece and keeps the whole chunk's length (and, in every chunk, the
//! checksum is adjusted by the wrong length). Every datagram of such a message then leaves
//! with a UDP length longer than itself, and receivers' kernels drop them all. A message whose
//! last datagram is shorter than the segment size has a remainder, and is sent right.
//!
//! # Contract
//! Pure: [`TailRule::next`] decides, for what is left of a segmented message, how its next
//! part goes to the kernel; the socket ([`super::BatchSocket`]) follows it. Under
//! [`TailRule::NeverEqual`] no GSO message the socket hands the kernel ends on a full segment:
//! - one whose last datagram is shorter than the segment size goes as it is;
//! - one that would end on a full segment and has at least [`MIN_PADDED`] datagrams gets
//!   [`PAD`] as its last segment, sent from a second `iovec` (nothing is copied);
//! - otherwise (too few datagrams for the pad to pay, or no room for one more segment of
//!   [`PAD_LEN`] bytes) its first datagram goes alone, and the rest is decided again.
//!
//! Callers that lay out GSO messages within [`TailRule::limits`] always leave room for the
//! pad. [`TailRule::Any`] is GSO as the kernel takes it: every message as it is.
//!
//! # The pad at receivers
//! [`PAD`] is [`PAD_LEN`] zero bytes. A weft peer recognizes it ([`is_pad`]) and drops it,
//! counted as `gso_tail_pad`, never as malformed. A kernel VXLAN device (flannel.1) drops it
//! before it looks for a device: a VXLAN header without the VNI flag is not VXLAN, so no
//! device counts it. Its length keeps every outer Ethernet frame at the 60-byte minimum or
//! above (14 + 20 + 8 + 18): a NIC never has to pad a runt segment (a one-byte sentinel,
//! another project's choice, was reported to reset some NICs' firmware).

#![forbid(unsafe_code)]

/// The most datagrams in one GSO send (the kernel's `UDP_MAX_SEGMENTS`).
pub const MAX_GSO_SEGMENTS: usize = 64;
/// The most payload bytes in one GSO send over IPv4: 65535 − 20 (IPv4) − 8 (UDP).
pub const MAX_GSO_BYTES: usize = 65535 - 28;

/// The pad's length: an IPv4 outer frame of 14 + 20 + 8 + 18 = 60 bytes, Ethernet's minimum.
pub const PAD_LEN: usize = 18;

/// The datagram that ends a GSO message which would end on a full segment.
pub static PAD: [u8; PAD_LEN] = [0; PAD_LEN];

/// The fewest datagrams of a message that ends on a full segment worth sending as GSO with the
/// pad: below it, the pad's extra datagram costs about what GSO saves, and the datagrams go
/// alone.
pub const MIN_PADDED: usize = 4;

/// Whether a received datagram is a weft peer's [`PAD`].
pub fn is_pad(datagram: &[u8]) -> bool {
    datagram.len() == PAD_LEN && datagram.iter().all(|&b| b == 0)
}

/// How GSO messages may end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TailRule {
    /// As the caller laid them out.
    #[default]
    Any,
    /// Never on a full segment (see the module docs).
    NeverEqual,
}

/// How big a GSO message a caller may lay out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GsoLimits {
    /// Datagrams per message (1: no GSO).
    pub segments: usize,
    /// Payload bytes per message.
    pub bytes: usize,
}

impl GsoLimits {
    /// No GSO: one datagram per message.
    pub const NONE: Self = Self { segments: 1, bytes: MAX_GSO_BYTES };
}

/// How the next part of a segmented message goes to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// All of what is left, as one GSO message; with [`PAD`] as its last segment if `pad`.
    Gso {
        /// Append [`PAD`].
        pad: bool,
    },
    /// Its first datagram, alone.
    Single,
}

impl TailRule {
    /// The limits of a message laid out for a socket that takes `max_segments` datagrams per
    /// GSO message (1: no GSO): under [`TailRule::NeverEqual`], one segment and [`PAD_LEN`]
    /// bytes fewer, the room the pad needs.
    pub fn limits(self, max_segments: usize) -> GsoLimits {
        let segments = max_segments.clamp(1, MAX_GSO_SEGMENTS);
        match self {
            _ if segments == 1 => GsoLimits::NONE,
            TailRule::Any => GsoLimits { segments, bytes: MAX_GSO_BYTES },
            TailRule::NeverEqual => {
                GsoLimits { segments: segments - 1, bytes: MAX_GSO_BYTES - PAD_LEN }
            }
        }
    }

    /// How to send the next part of a message of which `left` bytes remain, in datagrams of
    /// `seg` bytes (the last possibly shorter), when there are at least two of them
    /// (`left > seg > 0`) and the socket uses GSO. See the module docs.
    pub fn next(self, left: usize, seg: usize) -> Next {
        let equal_tail = seg > 0 && left.is_multiple_of(seg);
        if self == TailRule::Any || !equal_tail {
            return Next::Gso { pad: false };
        }
        let datagrams = left / seg;
        let room = datagrams < MAX_GSO_SEGMENTS && left + PAD_LEN <= MAX_GSO_BYTES;
        if datagrams >= MIN_PADDED && room && seg > PAD_LEN {
            Next::Gso { pad: true }
        } else {
            Next::Single
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// One message as the socket hands it to the kernel.
    #[derive(Debug, PartialEq, Eq)]
    struct Sent {
        /// The message's own datagrams' lengths.
        data: Vec<usize>,
        /// Sent as one GSO message.
        gso: bool,
        /// With [`PAD`] as its last segment.
        pad: bool,
    }

    impl Sent {
        /// The lengths of every segment the kernel cuts it into, the pad's too.
        fn segments(&self) -> Vec<usize> {
            self.data.iter().copied().chain(self.pad.then_some(PAD_LEN)).collect()
        }
    }

    fn alone(len: usize) -> Sent {
        Sent { data: vec![len], gso: false, pad: false }
    }

    /// What a message of `len` bytes in datagrams of `seg` becomes when the socket uses GSO
    /// and follows `rule` (as `BatchSocket::send_batch` does).
    fn wire(rule: TailRule, len: usize, seg: usize) -> Vec<Sent> {
        let mut out = Vec::new();
        let mut left = len;
        while left > 0 {
            if left <= seg {
                out.push(alone(left));
                break;
            }
            match rule.next(left, seg) {
                Next::Single => {
                    out.push(alone(seg));
                    left -= seg;
                }
                Next::Gso { pad } => {
                    let mut data = vec![seg; left / seg];
                    data.extend((!left.is_multiple_of(seg)).then_some(left % seg));
                    out.push(Sent { data, gso: true, pad });
                    left = 0;
                }
            }
        }
        out
    }

    #[test]
    fn a_message_ending_on_a_full_segment_gets_the_pad_or_goes_alone() {
        use TailRule::*;
        let gso = |data: Vec<usize>, pad| Sent { data, gso: true, pad };
        // A short tail already: as it is, under either rule.
        let short = vec![1400, 1400, 1400, 1400, 600];
        assert_eq!(wire(NeverEqual, 4 * 1400 + 600, 1400), [gso(short, false)]);
        // Ending full: padded, the pad its last, shorter segment; as it is under `Any`.
        assert_eq!(wire(NeverEqual, 5 * 1400, 1400), [gso(vec![1400; 5], true)]);
        assert_eq!(wire(NeverEqual, 5 * 1400, 1400)[0].segments().last(), Some(&PAD_LEN));
        assert_eq!(wire(Any, 5 * 1400, 1400), [gso(vec![1400; 5], false)]);
        // Too few datagrams to pad: each alone.
        assert_eq!(wire(NeverEqual, 3 * 1400, 1400), [alone(1400), alone(1400), alone(1400)]);
        // 64 full segments leave no room for the pad: the first goes alone, then 63 + pad.
        assert_eq!(wire(NeverEqual, 64 * 1000, 1000), [alone(1000), gso(vec![1000; 63], true)]);
        // A payload without room for the pad's bytes (46 × 1424 = 65504): the same.
        const { assert!(46 * 1424 + PAD_LEN > MAX_GSO_BYTES) };
        assert_eq!(wire(NeverEqual, 46 * 1424, 1424), [alone(1424), gso(vec![1424; 45], true)]);
        // A segment no longer than the pad cannot be padded (it would not end shorter).
        let w = wire(NeverEqual, 8 * PAD_LEN, PAD_LEN);
        assert!(w.len() == 8 && w.iter().all(|s| *s == alone(PAD_LEN)), "{w:?}");
    }

    #[test]
    fn the_limits_leave_room_for_the_pad() {
        assert_eq!(
            TailRule::NeverEqual.limits(64),
            GsoLimits { segments: 63, bytes: MAX_GSO_BYTES - PAD_LEN }
        );
        assert_eq!(TailRule::Any.limits(64), GsoLimits { segments: 64, bytes: MAX_GSO_BYTES });
        assert_eq!(TailRule::NeverEqual.limits(1), GsoLimits::NONE);
        assert_eq!(TailRule::Any.limits(0), GsoLimits::NONE);
        assert_eq!(TailRule::Any.limits(500).segments, MAX_GSO_SEGMENTS);
    }

    #[test]
    fn only_the_pad_is_a_pad() {
        assert!(is_pad(&PAD));
        assert!(!is_pad(&[0; PAD_LEN + 1]) && !is_pad(&[0; PAD_LEN - 1]) && !is_pad(&[]));
        let mut almost = PAD;
        almost[PAD_LEN - 1] = 1;
        assert!(!is_pad(&almost));
    }

    proptest! {
        /// Whatever the message, under `NeverEqual` every datagram of it reaches the wire, in
        /// order; no GSO message ends on a full segment or breaks the kernel's limits; and one
        /// laid out within the limits goes as one GSO message unless it is too short to pad.
        /// Under `Any` it is one GSO message, as laid out.
        #[test]
        fn no_gso_message_ends_on_a_full_segment(
            seg in 1usize..9000,
            n in 2usize..=64,
            tail in 0usize..9000,
        ) {
            let tail = tail % seg;
            let len = (n - 1) * seg + if tail == 0 { seg } else { tail };
            prop_assume!(len <= MAX_GSO_BYTES);
            let mut want = vec![seg; len / seg];
            want.extend((!len.is_multiple_of(seg)).then_some(len % seg));
            let w = wire(TailRule::NeverEqual, len, seg);
            let sent: Vec<usize> = w.iter().flat_map(|s| s.data.clone()).collect();
            prop_assert_eq!(sent, want);
            for s in &w {
                let segments = s.segments();
                if s.gso {
                    prop_assert!(segments.last() < Some(&seg), "{:?} ends full", s);
                    prop_assert!(segments.len() <= MAX_GSO_SEGMENTS);
                    prop_assert!(segments.iter().sum::<usize>() <= MAX_GSO_BYTES);
                } else {
                    prop_assert!(segments.len() == 1 && !s.pad);
                }
            }
            let limits = TailRule::NeverEqual.limits(MAX_GSO_SEGMENTS);
            let within = n <= limits.segments && len <= limits.bytes;
            if within && seg > PAD_LEN && (!len.is_multiple_of(seg) || n >= MIN_PADDED) {
                prop_assert_eq!(w.len(), 1, "{:?}", w);
            }
            let any = wire(TailRule::Any, len, seg);
            prop_assert!(any.len() == 1 && any[0].gso && !any[0].pad);
        }
    }
}
