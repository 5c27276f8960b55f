//! Which forwarding thread last carried each flow, to count the flows that move between
//! threads: the one way weft can reorder a flow without dropping anything.
//!
//! Two threads carrying one flow at once each send (or write) their share in order, but not in
//! order with each other: a batch read by one can leave after a later batch read by the other,
//! and TCP takes the overtaken segments for lost (fast retransmits, a halved window). A flow
//! moves between TUN queues when the kernel's multiqueue flow table follows it (the queue that
//! last wrote the reverse direction, `tun_flow_update`), and between receiving sockets when its
//! outer 5-tuple changes (`SO_REUSEPORT` hashes it). A move at a flow's start is harmless (little
//! is in flight); a flow that keeps moving is a bug, and `weft_dataplane_flow_moves_total` shows
//! it.
//!
//! # Contract
//! [`FlowOwners::carried`] is two relaxed atomic operations on the per-packet path (a load, and
//! a store only when the owner changes), no lock, no allocation. It is a sample, not a ledger:
//! the table has [`SLOTS`] slots, two flows sharing a slot are told apart by the hash's upper
//! bits (a move is counted only when the same upper bits are found under another owner), and
//! two flows with the same hash count as one.

use std::sync::atomic::{AtomicU32, Ordering};

/// Slots in the table (a power of two): 16 KiB, plenty for the flows a host carries at once.
pub const SLOTS: usize = 4096;
/// The hash bits that pick the slot; the rest tell flows in one slot apart.
const SLOT_MASK: u32 = SLOTS as u32 - 1;

/// The last owner of every flow (by slot); shared by the forwarding threads of one data plane.
#[derive(Debug)]
pub struct FlowOwners {
    /// `(flow hash & !SLOT_MASK) | owner`, owner from 1 (0: never carried).
    slots: Box<[AtomicU32]>,
}

impl Default for FlowOwners {
    fn default() -> Self {
        Self { slots: (0..SLOTS).map(|_| AtomicU32::new(0)).collect() }
    }
}

impl FlowOwners {
    /// Records that thread `owner` (1..=[`SLOT_MASK`]; others are folded into that range)
    /// carries the flow hashed `flow`; true when that flow was last carried by another thread.
    pub fn carried(&self, flow: u32, owner: u32) -> bool {
        let owner = (owner & SLOT_MASK).max(1);
        let tag = (flow & !SLOT_MASK) | owner;
        let slot = &self.slots[(flow & SLOT_MASK) as usize];
        let last = slot.load(Ordering::Relaxed);
        if last == tag {
            return false;
        }
        slot.store(tag, Ordering::Relaxed);
        last & SLOT_MASK != 0 && last & !SLOT_MASK == flow & !SLOT_MASK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_that_changes_threads_is_a_move_and_staying_is_not() {
        let t = FlowOwners::default();
        let flow = 0xdead_b00f;
        assert!(!t.carried(flow, 1), "a flow's first owner is no move");
        assert!(!t.carried(flow, 1));
        assert!(t.carried(flow, 2), "to thread 2");
        assert!(!t.carried(flow, 2));
        assert!(t.carried(flow, 1), "and back");
    }

    #[test]
    fn flows_sharing_a_slot_are_told_apart() {
        let t = FlowOwners::default();
        let (a, b) = (0x0001_0007, 0x0002_0007);
        assert_eq!(a & SLOT_MASK, b & SLOT_MASK);
        assert!(!t.carried(a, 1));
        assert!(!t.carried(b, 2), "another flow in the slot is not a move of the first");
        assert!(!t.carried(a, 2), "the slot forgot a; not counted rather than counted wrongly");
        assert!(t.carried(a, 1));
    }

    #[test]
    fn owner_zero_and_large_owners_still_count() {
        let t = FlowOwners::default();
        assert!(!t.carried(5, 0));
        assert!(t.carried(5, 2));
        assert!(t.carried(5, SLOTS as u32 + 1), "folded to 1");
    }
}
