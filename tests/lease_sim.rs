//! The lease simulation: SCENARIOS.md S1–S12 against the in-memory store and a manual clock,
//! seeded random schedules, and a baseline comparison with flannel's lease logic.

mod sim;

use sim::*;

#[test]
fn smoke() {
    let mut w = World::new(1, network_of(4));
    w.join("a");
    w.advance(TTL * 3);
    assert!(w.believed("a").is_some());
    w.assert_clean();
}
