//! Descriptor and syscall code, and nothing else: the layer of the data plane that touches file
//! descriptors and the kernel.
//!
//! - [`tun`]: the TUN device's ioctls and its queues' reads and writes;
//! - [`udp`]: the batched UDP sockets (and ipip's raw sockets), with the rules that shape
//!   their GSO messages ([`udp::gso_tail`]) and retry GSO after a failure (`udp::gso_retry`);
//! - [`netlink`]: the kernel's link, address and route tables over rtnetlink, with the pure
//!   decoders of its messages and the plain data it reads and writes
//!   (`netlink::{ObservedLink, SeenRoute, PeerRoute}`);
//! - [`link_watch`]: notice of changes to links, addresses and routes;
//! - [`host`]: the host's interfaces and default routes, as the daemon reads them;
//! - [`sched`]: a forwarding thread's scheduling slice.
//!
//! # Contract
//! This layer sits just above [`super::wire`] (the packet formats: ipip's protocol number) and
//! below everything else in the data plane: it imports no planner (not the transports, the
//! workers' send planning, drift repair nor the kernel route planner), and `tests/layers.rs`
//! holds it so. What the planners need of the kernel's state is plain data defined here
//! (`netlink::types`), so that they depend on it and not the other way round. `unsafe` lives
//! in [`tun`], [`udp`] and [`sched`] only, each block with a `// SAFETY:` comment.

pub(crate) mod host;
pub(crate) mod link_watch;
pub(crate) mod netlink;
#[allow(unsafe_code)]
pub(crate) mod sched;
#[allow(unsafe_code)]
pub(crate) mod tun;
#[allow(unsafe_code)]
pub mod udp;
