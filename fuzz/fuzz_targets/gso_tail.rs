//! The equal-tail rule (`gso_tail::TailRule::next`), followed as the socket follows it for a
//! message of any length and segment size: every datagram goes once, in order; no GSO message
//! ends on a full segment under `NeverEqual` or breaks the kernel's limits (64 segments,
//! 65507 bytes, the pad included); one laid out within `TailRule::limits` goes as one GSO
//! message unless it is too short to pad; under `Any` it goes as laid out.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use weft::dataplane::sys::udp::gso_tail::{MIN_PADDED, Next, PAD_LEN, TailRule};

const MAX_SEGMENTS: usize = 64;
const MAX_BYTES: usize = 65507;

#[derive(Arbitrary, Debug)]
struct Input {
    never_equal: bool,
    seg: u16,
    datagrams: u8,
    tail: u16,
}

fuzz_target!(|input: Input| {
    let rule = if input.never_equal { TailRule::NeverEqual } else { TailRule::Any };
    let seg = usize::from(input.seg.max(1));
    // 2 to 64 datagrams: more is refused before any send (`Transmit::check`).
    let n = usize::from(input.datagrams % 63) + 2;
    let tail = usize::from(input.tail) % seg;
    let len = (n - 1) * seg + if tail == 0 { seg } else { tail };
    if len > MAX_BYTES {
        return;
    }
    let (mut left, mut sent, mut messages) = (len, 0, 0);
    while left > 0 {
        messages += 1;
        if left <= seg {
            sent += left;
            break;
        }
        match rule.next(left, seg) {
            Next::Single => {
                assert_eq!(rule, TailRule::NeverEqual, "Any never sends a datagram alone");
                sent += seg;
                left -= seg;
            }
            Next::Gso { pad } => {
                let last = if pad {
                    PAD_LEN
                } else if left % seg == 0 {
                    seg
                } else {
                    left % seg
                };
                let segments = left.div_ceil(seg) + usize::from(pad);
                let bytes = left + if pad { PAD_LEN } else { 0 };
                if rule == TailRule::NeverEqual {
                    assert!(last < seg, "a GSO message of {left} bytes in {seg} ends full");
                } else {
                    assert!(!pad, "Any never pads");
                }
                assert!(segments <= MAX_SEGMENTS && bytes <= MAX_BYTES, "{segments} / {bytes}");
                sent += left;
                left = 0;
            }
        }
    }
    assert_eq!(sent, len);
    let limits = rule.limits(MAX_SEGMENTS);
    let within = n <= limits.segments && len <= limits.bytes;
    let paddable = len % seg != 0 || (n >= MIN_PADDED && seg > PAD_LEN);
    if rule == TailRule::Any || (within && paddable) {
        assert_eq!(messages, 1, "{n} datagrams of {seg} ({len} bytes) under {rule:?}");
    }
});
