//! The network config (`<prefix>/config`): flannel's JSON schema, parsed case-insensitively as
//! Go's encoding/json does, with flannel's defaults, and validated with errors that name the
//! field and the problem.
//!
//! STUB: the API below is fixed; the bodies are being written.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::lease::record::Subnet;

/// The data-plane backend named by `Backend.Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// VXLAN (RFC 7348), flannel's `vxlan`: default port 8472, VNI 1.
    Vxlan,
    /// flannel's `udp`: the raw IP packet in UDP, default port 8285.
    Udp,
}

/// The backend section of the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    /// The backend type.
    pub kind: BackendKind,
    /// The UDP port peers send to.
    pub port: u16,
    /// The VXLAN network identifier (vxlan only; 1 by default).
    pub vni: u32,
}

/// A validated network config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// The cluster network (`Network`).
    pub network: Ipv4Net,
    /// The prefix length of each host's subnet (`SubnetLen`).
    pub subnet_len: u8,
    /// The lowest subnet that may be leased (`SubnetMin`).
    pub subnet_min: Ipv4Addr,
    /// The highest subnet that may be leased (`SubnetMax`).
    pub subnet_max: Ipv4Addr,
    /// The backend.
    pub backend: Backend,
}

/// Why a config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Placeholder while the stub stands.
    #[error("not implemented")]
    Unimplemented,
}

impl NetworkConfig {
    /// Parses and validates config JSON.
    pub fn parse(_json: &[u8]) -> Result<Self, ConfigError> {
        Err(ConfigError::Unimplemented)
    }

    /// Every leasable subnet, from `subnet_min` to `subnet_max` inclusive, ascending.
    pub fn subnets(&self) -> impl Iterator<Item = Subnet> + '_ {
        let step = 1u64 << (32 - u32::from(self.subnet_len));
        let lo = u64::from(u32::from(self.subnet_min));
        let hi = u64::from(u32::from(self.subnet_max));
        (0..)
            .map(move |i| lo + i * step)
            .take_while(move |a| *a <= hi)
            .filter_map(move |a| {
                Subnet::from_parts(Ipv4Addr::from(a as u32), self.subnet_len).ok()
            })
    }

    /// Whether `subnet` may be leased under this config (inside the range, right length).
    pub fn fits(&self, subnet: Subnet) -> bool {
        subnet.prefix_len() == self.subnet_len
            && subnet.network() >= self.subnet_min
            && subnet.network() <= self.subnet_max
    }
}
