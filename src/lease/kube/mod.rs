//! The Kubernetes subnet manager (`--kube-subnet-mgr`): flannel's leases kept on Node objects
//! rather than in etcd.
//!
//! A node's subnet is its `spec.podCIDRs`, assigned by the controller manager; weft announces
//! its own lease in annotations on its Node and reads every other Node's the same way
//! (flannel's `pkg/subnet/kube`; docs/kubernetes.md).
//!
//! - [`annotations`]: flannel's annotation names, what a Node announces, the patches (pure).
//! - [`nodes`]: every Node's lease, one holder per subnet, as listings and watch batches for
//!   the route watcher (pure).

pub mod annotations;
pub mod api;
pub mod nodes;
pub mod own;
