//! The capabilities weft works with, raised from the permitted set into the effective one at
//! start: the only syscall code about them.
//!
//! A non-root process started without ambient capabilities (a Kubernetes DaemonSet's
//! container: the runtime puts the added capabilities in the bounding set only) gets them at
//! exec from the binary's file capabilities. The image's binary carries `cap_net_admin` and
//! `cap_net_raw` as permitted, not effective (scripts/package.sh), so that exec works where
//! the bounding set lacks them; weft raises what it was permitted here. Nothing else changes:
//! no capability is added that the process was not permitted, none is dropped.

use caps::{CapSet, Capability};

/// What weft raises when permitted: the TUN device, addresses and routes, nftables
/// (`NET_ADMIN`); ipip's raw sockets (`NET_RAW`).
const WANTED: [Capability; 2] = [Capability::CAP_NET_ADMIN, Capability::CAP_NET_RAW];

/// Raises every [`WANTED`] capability that is permitted but not effective. Returns the ones
/// raised (to say so at start); an error of the kernel's names the capability.
pub fn raise_permitted() -> Result<Vec<Capability>, String> {
    let permitted = caps::read(None, CapSet::Permitted).map_err(|e| e.to_string())?;
    let effective = caps::read(None, CapSet::Effective).map_err(|e| e.to_string())?;
    let mut raised = Vec::new();
    for cap in WANTED {
        if permitted.contains(&cap) && !effective.contains(&cap) {
            caps::raise(None, CapSet::Effective, cap).map_err(|e| format!("raising {cap}: {e}"))?;
            raised.push(cap);
        }
    }
    Ok(raised)
}
