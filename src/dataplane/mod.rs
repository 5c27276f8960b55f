//! The data plane: packets move TUN -> route lookup -> VXLAN/UDP encapsulation -> UDP socket,
//! and back, in user space.
//!
//! Contract: [`wire`], [`pipeline`], [`offload`], [`gso_retry`], [`gso_tail`] and
//! [`malformed_peers`] are pure (no I/O, no allocation on the per-packet path, never panic on
//! input); so are [`drift`], which plans the repairs of the TUN device's link state, and
//! [`supervise`]'s restart policy. Only the syscall layers ([`tun`]: the TUN device's ioctls
//! and I/O; [`udp`]: batched sockets) and the netlink
//! driver ([`netlink`]: the device's link, address and route, over rtnetlink, with no `unsafe`)
//! touch file descriptors, and only [`driver`] creates them and the threads that run
//! [`worker`]'s loops; `fake` stands in for both edges in tests (only with the `test-util`
//! feature or in unit tests).

pub mod counters;
pub mod drift;
pub mod driver;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
pub(crate) mod gso_retry;
pub mod gso_tail;
pub mod kernel_bugs;
pub(crate) mod link_watch;
pub mod malformed_peers;
pub(crate) mod netlink;
pub mod offload;
pub mod pipeline;
pub(crate) mod supervise;
#[allow(unsafe_code)]
pub(crate) mod tun;
#[allow(unsafe_code)]
pub(crate) mod udp;
#[cfg(feature = "test-util")]
pub use udp::{LoopbackRun, LoopbackSend, loopback_run};
pub mod wire;
pub mod worker;
