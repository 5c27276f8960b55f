//! weft: a flannel-compatible overlay network daemon whose data plane runs in user space.
//!
//! Three planes, and one rule: **only driver modules do I/O**.
//! - Control plane ([`lease`]): each host leases one subnet of the cluster network from etcd.
//!   The allocation policy ([`lease::policy`]) and the lease lifecycle ([`lease::keeper`]) are
//!   pure code that takes `now` and store results as arguments; [`lease::driver`] runs them
//!   against a [`lease::store::Store`] (etcd, or in memory for the simulation), a clock, hooks
//!   and the health server.
//! - Config ([`config`]): flannel's network config schema.
//! - Routes ([`route`]): every peer's lease as an immutable, wait-free route table; the
//!   lease-to-route rules ([`route::set`]) are pure, [`route::watcher`] feeds them from etcd.
//! - Data plane ([`dataplane`]): TUN -> route lookup -> VXLAN/UDP and back. Packet views
//!   ([`dataplane::wire`]), forwarding decisions ([`dataplane::transport`]) and offload
//!   split/coalesce ([`dataplane::offload`]) are pure; the TUN device, the batched UDP sockets
//!   and netlink are private syscall layers behind [`dataplane::Dataplane`], its front door.
//! - [`daemon`] wires them into `weft run`; [`cli`] reads a flanneld command line as flanneld
//!   does and chooses the underlay among flanneld's interface candidates; [`health`] serves
//!   `/healthz`, `/readyz`, `/metrics`
//!   (every component's metrics rendered by [`metrics`]);
//!   [`instance`] keeps a second `weft run` on the same state dir or TUN device waiting.
//!
//! Files weft owns (`subnet.env`, the state dir) are written and read by [`atomic_file`].
//!
//! The process's edges: [`logging`] (log lines through a queue that never blocks or panics),
//! [`stop`] (signals on a thread of their own; every panic a clean, non-zero stop),
//! [`panics`] (which panics a supervisor catches), [`rlimit`] (the soft open file limit
//! raised to the hard one at start) and [`capabilities`] (the permitted network capabilities
//! raised into the effective set at start).
//!
//! Time comes from [`time`]: a boot-time clock for drivers, a manual clock for tests.

#![warn(missing_docs)]
// `unsafe` lives only in the syscall modules that allow it below (dataplane::sys's tun, udp and
// sched, fds, and the boot-time clock); every other module is checked to have none.
#![deny(unsafe_code)]
// Each `unsafe` block says, in a `// SAFETY:` comment, why what it does is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod atomic_file;
pub mod capabilities;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod dataplane;
#[allow(unsafe_code)]
pub mod fds;
pub mod health;
pub mod instance;
pub mod lease;
pub mod logging;
pub mod metrics;
pub mod panics;
pub mod rlimit;
pub mod route;
pub mod secret_file;
pub mod stop;
#[allow(unsafe_code)]
pub mod time;
pub mod vocab;
