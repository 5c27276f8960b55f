//! The lease control plane: which subnet this host holds, and keeping it.
//!
//! - [`keys`]: the store's key layout; builds and parses every key (both stores use it).
//! - [`record`]: subnet keys, lease values, identity, history (pure parsing).
//! - [`store`]: the store trait; [`etcd`] and `memory` (the simulation's, only with the
//!   `test-util` feature or in unit tests) implement it.
//! - [`policy`]: which subnet to try, in which order (pure).
//! - [`keeper`]: the lease lifecycle state machine (pure; `handle_*`/`poll_*`).
//! - [`subnet_env`]: flannel's `subnet.env`, read and written atomically.
//! - [`driver`]: runs the keeper against a store, a clock, hooks and health.
//! - [`kube`]: the Kubernetes subnet manager: leases on Node objects.
//! - [`hooks`]: runs the hooks (scrubbed environment, timeout, bounded output) and keeps the
//!   journal of hooks owed across a crash.

pub mod driver;
pub mod etcd;
pub(crate) mod hooks;
#[cfg(test)]
mod join_races;
pub mod keeper;
pub mod keys;
pub mod kube;
#[cfg(any(test, feature = "test-util"))]
pub mod memory;
pub mod policy;
pub mod record;
pub mod status;
pub mod store;
pub mod subnet_env;
