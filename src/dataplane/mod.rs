//! The data plane: packets move TUN -> route lookup -> VXLAN/UDP encapsulation -> UDP socket,
//! and back, in user space.
//!
//! Contract: [`wire`] is pure (no I/O, no allocation, never panics on input); only driver modules
//! touch file descriptors.

pub mod driver;
pub mod fake;
pub mod offload;
pub mod pipeline;
pub mod sys;
pub mod udp;
pub mod wire;
pub mod worker;
