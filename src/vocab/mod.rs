//! The crate's vocabulary: the value types every layer speaks of — subnets and lease names
//! ([`Subnet`], [`Ipv6Subnet`], [`LeaseName`]), MAC addresses and VNIs ([`MacAddr`], [`Vni`]),
//! WireGuard keys ([`WgPublicKey`], [`WgSecret`]).
//!
//! The ground floor: this module imports nothing of weft's, and every other layer may use it
//! (`tests/layers.rs` holds the house to that).

#![forbid(unsafe_code)]

mod link;
mod subnet;
mod wireguard;

pub use link::{MacAddr, Vni, VniOutOfRange};
pub use subnet::{ForeignSubnet, Ipv6Subnet, LeaseName, Subnet, SubnetError};
pub use wireguard::{WG_KEY_LEN, WgKeyError, WgPublicKey, WgSecret};
