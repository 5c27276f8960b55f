//! The one harness of the suites under `integration/` (and of `benches/leases.rs`). Each test
//! binary compiles this module on its own and uses a different part of it, so unused items are
//! expected.
//!
//! - [`etcd`]: real etcd, one server or a 3-member cluster, on loopback, started with the
//!   scripts' command line (`scripts/lib/etcd.sh`), as is the etcd in [`netns`]'s hub.
//! - [`weft`]: real `weft run` processes in the root namespace (`--dataplane none`); its flags
//!   ([`weft::RunArgs`]) are also those of [`netns`]'s hosts, plus what a TUN host adds.
//! - [`netns`]: hosts in network namespaces with the TUN data plane, pods, a hub with etcd.
//! - [`kernel_flannel`]: a [`netns`] host set up and programmed as flannel's kernel vxlan
//!   backend does (IPv4 and IPv6), for interop tests.
//! - [`kube`]: a real kube-apiserver with its own etcd, in a [`netns`] lab's hub or on
//!   loopback (`scripts/lib/kube-apiserver.sh`), and the Node, RBAC and token helpers the
//!   Kubernetes suites use.
//! - [`process`]: every child dies with its test (`PR_SET_PDEATHSIG`); the door to the
//!   scripts' shell libraries (`scripts/lib/`), where the lab is defined once for the tests,
//!   the demo, the bench and the chaos soak.
//!
//! Which suites need what is in Cargo.toml's features: `etcd` (the etcd suites), `netns`
//! (root, namespaces, TUN, iperf3) and `kube` (the built kube-apiserver, kubectl, curl);
//! scripts/test.sh turns them on.
#![allow(dead_code)]

pub mod etcd;
pub mod kernel_flannel;
pub mod kube;
pub mod netns;
pub mod process;
pub mod weft;
