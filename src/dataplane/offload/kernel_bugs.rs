//! Kernels with known bugs in the offloads weft's speed rests on, and what weft turns off on
//! them.
//!
//! # Contract
//! - [`KNOWN_BUGS`] is the one table: each row a range of kernel releases (by mainline
//!   version), the offload it breaks, and where it is documented. A distribution kernel may
//!   carry a backported fix under an affected version: `on` overrides (`--udp-gso on`).
//! - [`decide`] is pure: given the running kernel's release (as `uname -r` prints it, or `None`
//!   when it cannot be read), an offload and the flag's [`OffloadMode`], it says whether the
//!   offload is used and why ([`Decision`]). `auto` uses it unless the release lies in a known
//!   bug's range; then it is off, or, for a bug weft can avoid ([`KnownBug::workaround`]), on
//!   with the workaround. `on` (the offload as usual, no workaround) and `off` are the
//!   operator's word.
//! - A release that does not parse is no known bug's: `auto` then uses the offload (weft still
//!   turns UDP GSO off per socket when a send fails, see [`crate::dataplane::sys::udp::gso_retry`]).

#![forbid(unsafe_code)]

use std::fmt;

/// An offload weft can turn off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Offload {
    /// `UDP_SEGMENT` on send (`--udp-gso`).
    UdpGso,
    /// `UDP_GRO` on receive (`--udp-gro`).
    UdpGro,
    /// The TUN device's `IFF_VNET_HDR` offloads: TSO/USO and checksum (`--tun-offload`).
    TunOffload,
}

impl Offload {
    /// Every offload, in label order.
    pub const ALL: [Self; 3] = [Self::UdpGso, Self::UdpGro, Self::TunOffload];

    /// The metric label and the flag's name without `--`.
    pub fn label(self) -> &'static str {
        match self {
            Self::UdpGso => "udp_gso",
            Self::UdpGro => "udp_gro",
            Self::TunOffload => "tun_offload",
        }
    }
}

/// `--udp-gso`, `--udp-gro`, `--tun-offload`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OffloadMode {
    /// Used unless the running kernel is known to break it.
    #[default]
    Auto,
    /// Used whatever the kernel (a distribution kernel with the fix backported).
    On,
    /// Never used.
    Off,
}

/// A kernel release's mainline version: `7.1.4` of `7.1.4-arch1-1`, `6.6.44` of
/// `6.6.44-generic`; a missing patch level is 0 (`7.0-rc1` is 7.0.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KernelVersion(pub u32, pub u32, pub u32);

impl KernelVersion {
    /// The version a release string starts with, if it starts with `MAJOR.MINOR`: the patch
    /// level is the digits after a second dot right behind the minor number, else 0.
    pub fn parse(release: &str) -> Option<Self> {
        fn number(s: &str) -> Option<(u32, &str)> {
            let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            Some((s[..end].parse().ok()?, &s[end..]))
        }
        let (major, rest) = number(release)?;
        let (minor, rest) = number(rest.strip_prefix('.')?)?;
        let patch = rest.strip_prefix('.').and_then(number).map_or(0, |(patch, _)| patch);
        Some(Self(major, minor, patch))
    }
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// One known bug: the releases `from..fixed` (mainline versions; `fixed` is the first without
/// it) break `offload`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownBug {
    /// A short name, the metric's `reason` label.
    pub id: &'static str,
    /// What goes wrong.
    pub what: &'static str,
    /// The first affected version.
    pub from: KernelVersion,
    /// The first version with the fix.
    pub fixed: KernelVersion,
    /// The offload it breaks.
    pub offload: Offload,
    /// What weft does to keep the offload on without meeting the bug, if it can (`auto` then
    /// keeps it on that way); `None`: `auto` turns the offload off.
    pub workaround: Option<&'static str>,
    /// Where it is documented.
    pub sources: &'static str,
}

/// Every known bug weft acts on. Sources: the kernel commits and the Tailscale issues that
/// reported them.
pub const KNOWN_BUGS: &[KnownBug] = &[
    KnownBug {
        id: "udp_gso_mangled_v7_0",
        what: "UDP GSO sends can go out with mangled UDP headers and checksums, which peers drop",
        from: KernelVersion(7, 0, 0),
        fixed: KernelVersion(7, 1, 5),
        offload: Offload::UdpGso,
        workaround: Some(
            "no GSO message ends on a full segment: an 18-byte pad datagram ends one that \
             would, or its datagrams go alone (dataplane::sys::udp::gso_tail)",
        ),
        sources: "introduced by b10b446 (v7.0-rc1), fixed by 78effd8 and 5f17ae0 (v7.1.5); \
                  tailscale/tailscale#19777, #21335",
    },
    KnownBug {
        id: "tun_gso_einval_v6_6_44",
        what: "TUN writes with GSO are refused with EINVAL (virtio_net_hdr csum_start check)",
        from: KernelVersion(6, 6, 44),
        fixed: KernelVersion(6, 6, 45),
        offload: Offload::TunOffload,
        workaround: None,
        sources: "tailscale/tailscale#13041; fixed by the virtio_net_hdr csum_start patch",
    },
    KnownBug {
        id: "udp_gro_forwarding_before_5_12",
        what: "UDP GRO on sockets is unsafe for forwarding before 5.12",
        from: KernelVersion(0, 0, 0),
        fixed: KernelVersion(5, 12, 0),
        offload: Offload::UdpGro,
        workaround: None,
        sources: "wireguard-go disables UDP GRO before 5.12",
    },
];

/// Whether an offload is used, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The offload.
    pub offload: Offload,
    /// Whether it is used.
    pub enabled: bool,
    /// Whether it is used with the known bug's workaround (`auto` on a kernel in its range).
    pub workaround: bool,
    /// Why: `default` (`auto`, no known bug), `flag` (`on` or `off`), or the known bug's id
    /// (off, or on with its workaround).
    pub reason: &'static str,
    /// The known bug in the running kernel's range, if any (also under `on`).
    pub bug: Option<&'static KnownBug>,
}

/// What to do with `offload` on a kernel of `version` under `mode` (see the module docs).
pub fn decide(version: Option<KernelVersion>, offload: Offload, mode: OffloadMode) -> Decision {
    let bug = version.and_then(|v| {
        KNOWN_BUGS.iter().find(|b| b.offload == offload && b.from <= v && v < b.fixed)
    });
    let (enabled, workaround, reason) = match (mode, bug) {
        (OffloadMode::On, _) => (true, false, "flag"),
        (OffloadMode::Off, _) => (false, false, "flag"),
        (OffloadMode::Auto, Some(b)) => (b.workaround.is_some(), b.workaround.is_some(), b.id),
        (OffloadMode::Auto, None) => (true, false, "default"),
    };
    Decision { offload, enabled, workaround, reason, bug }
}

/// The decisions of one run, for each [`Offload`] in [`Offload::ALL`]'s order, with the kernel
/// release they were made for: `weft_dataplane_offload_enabled{offload,reason}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadDecisions {
    /// The running kernel's release, as read (`None`: could not be read).
    pub release: Option<String>,
    /// One decision per offload, in [`Offload::ALL`]'s order.
    pub decisions: [Decision; 3],
}

impl OffloadDecisions {
    /// Decides each offload for `release` under its mode (`modes` in [`Offload::ALL`]'s order).
    pub fn new(release: Option<&str>, modes: [OffloadMode; 3]) -> Self {
        let version = release.and_then(KernelVersion::parse);
        let decisions = [0, 1, 2].map(|i| decide(version, Offload::ALL[i], modes[i]));
        Self { release: release.map(str::to_owned), decisions }
    }

    /// Whether `offload` is used.
    pub fn enabled(&self, offload: Offload) -> bool {
        self.decisions.iter().any(|d| d.offload == offload && d.enabled)
    }

    /// Whether `offload` is used with its known bug's workaround.
    pub fn workaround(&self, offload: Offload) -> bool {
        self.decisions.iter().any(|d| d.offload == offload && d.enabled && d.workaround)
    }
}

impl prometheus_client::collector::Collector for OffloadDecisions {
    fn encode(&self, mut e: prometheus_client::encoding::DescriptorEncoder<'_>) -> fmt::Result {
        crate::metrics::gauge_family(
            &mut e,
            "weft_dataplane_offload_enabled",
            "Whether an offload is used (1) or not (0), and why: default, flag, or a known \
             kernel bug (0: it turned the offload off; 1: the offload is on with the bug's \
             workaround).",
            self.decisions.iter().map(|d| {
                ([("offload", d.offload.label()), ("reason", d.reason)], u64::from(d.enabled))
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_are_read_as_their_mainline_version() {
        let v = |s| KernelVersion::parse(s);
        assert_eq!(v("7.1.4-arch1-1"), Some(KernelVersion(7, 1, 4)));
        assert_eq!(v("6.6.44-generic"), Some(KernelVersion(6, 6, 44)));
        assert_eq!(v("7.0.0-rc1"), Some(KernelVersion(7, 0, 0)));
        assert_eq!(v("7.0-rc1"), Some(KernelVersion(7, 0, 0)));
        assert_eq!(v("6.1.0-28-amd64"), Some(KernelVersion(6, 1, 0)));
        assert_eq!(v("5.10.226"), Some(KernelVersion(5, 10, 226)));
        assert_eq!(v("6.17"), Some(KernelVersion(6, 17, 0)));
        for bad in ["", "linux", "7", "7.", ".7.1", "-7.1.0", "7.x.1", "99999999999.1"] {
            assert_eq!(v(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn auto_turns_off_exactly_the_offload_a_known_bug_breaks_in_its_range() {
        let at = |s: &str, o, m| decide(KernelVersion::parse(s), o, m);
        use Offload::*;
        use OffloadMode::*;
        // The v7.0–v7.1.4 UDP GSO bug: its first and last affected releases, and either side.
        // It has a workaround: `auto` keeps GSO on with it.
        for affected in ["7.0.0", "7.0-rc1", "7.0.12", "7.1.0", "7.1.4-ubuntu"] {
            let d = at(affected, UdpGso, Auto);
            let got = (d.enabled, d.workaround, d.reason);
            assert_eq!(got, (true, true, "udp_gso_mangled_v7_0"), "{affected}");
            assert!(at(affected, UdpGro, Auto).enabled, "{affected}: GRO is not affected");
            assert!(at(affected, TunOffload, Auto).enabled, "{affected}");
        }
        for fine in ["6.19.9", "7.1.5", "7.2.0", "8.0.0"] {
            let d = at(fine, UdpGso, Auto);
            assert_eq!((d.reason, d.workaround), ("default", false), "{fine}");
        }
        // 6.6.44's TUN GSO refusal: no workaround, so off.
        let d = at("6.6.44", TunOffload, Auto);
        assert_eq!((d.enabled, d.workaround), (false, false));
        assert!(at("6.6.43", TunOffload, Auto).enabled);
        assert!(at("6.6.45", TunOffload, Auto).enabled);
        // UDP GRO before 5.12.
        assert!(!at("5.11.22", UdpGro, Auto).enabled);
        assert!(at("5.12.0", UdpGro, Auto).enabled);
        // The operator's word wins (`on`: GSO as usual, without the workaround); the bug is
        // still named.
        let d = at("7.1.4", UdpGso, On);
        assert_eq!((d.enabled, d.workaround, d.reason), (true, false, "flag"));
        let d = at("7.1.4", UdpGso, Off);
        assert_eq!((d.enabled, d.workaround, d.reason), (false, false, "flag"));
        assert_eq!(d.bug.map(|b| b.id), Some("udp_gso_mangled_v7_0"));
        assert_eq!(
            (at("7.2.0", UdpGso, Off).enabled, at("7.2.0", UdpGso, Off).reason),
            (false, "flag")
        );
        // An unreadable release is no known bug's.
        assert_eq!(decide(None, UdpGso, Auto).reason, "default");
    }

    #[test]
    fn a_runs_decisions_are_rendered_with_their_reasons() {
        use OffloadMode::*;
        let d = OffloadDecisions::new(Some("7.1.3-generic"), [Auto, Auto, Off]);
        assert!(d.enabled(Offload::UdpGso) && d.workaround(Offload::UdpGso));
        assert!(d.enabled(Offload::UdpGro) && !d.workaround(Offload::UdpGro));
        assert!(!d.enabled(Offload::TunOffload));
        let on = OffloadDecisions::new(Some("7.1.3-generic"), [On, Auto, Auto]);
        assert!(on.enabled(Offload::UdpGso) && !on.workaround(Offload::UdpGso));
        let off = OffloadDecisions::new(Some("6.6.44"), [Auto, Auto, Auto]);
        assert!(!off.enabled(Offload::TunOffload) && !off.workaround(Offload::TunOffload));
        let text = crate::metrics::render_collector(std::sync::Arc::new(d)).unwrap();
        for line in [
            "weft_dataplane_offload_enabled{offload=\"udp_gso\",reason=\"udp_gso_mangled_v7_0\"} 1",
            "weft_dataplane_offload_enabled{offload=\"udp_gro\",reason=\"default\"} 1",
            "weft_dataplane_offload_enabled{offload=\"tun_offload\",reason=\"flag\"} 0",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[test]
    fn every_range_is_non_empty_and_names_its_sources() {
        for b in KNOWN_BUGS {
            assert!(b.from < b.fixed, "{}", b.id);
            assert!(!b.sources.is_empty() && !b.what.is_empty(), "{}", b.id);
        }
    }
}
