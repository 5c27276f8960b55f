//! The underlay interface, chosen as flanneld chooses it from `--iface` (repeated),
//! `--iface-regex` (repeated) and `--iface-can-reach`, once at start.
//!
//! # Contract
//! - [`choose`] is pure: the candidates and the host's addresses in, the `--iface` the daemon
//!   gets out (an interface name or one of its IPv4 addresses), or `None` for the default
//!   route's interface when no candidate is given.
//! - The order is flanneld's: each `--iface` (a name, or an address some interface holds),
//!   then each `--iface-regex` (matched, unanchored, against every address first, then every
//!   interface name), then `--iface-can-reach`'s source address (what `ip route get` says).
//!   The first that names an interface with an address wins; none is an error listing what
//!   was tried. An IPv4 address matched is given as itself (so it is the one published, as
//!   flanneld publishes it); an IPv6 one as its interface's name.
//! - [`resolve`] asks the kernel (one netlink dump, one unconnected-then-connected UDP socket)
//!   only when there is a choice to make: a single `--iface` and nothing else goes to the
//!   daemon as it is, which checks it strictly.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::str::FromStr;

use anyhow::Context;

use crate::dataplane::Host;

/// A compiled `--iface-regex`: Go's RE2 syntax as `regex-lite` reads it (ASCII `\d`, `\w`,
/// `\s`, as Go's are; no look-around, as in Go).
#[derive(Clone, Debug)]
pub struct IfaceRegex(regex_lite::Regex);

impl FromStr for IfaceRegex {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        regex_lite::Regex::new(s).map(Self).map_err(|e| format!("not a regular expression: {e}"))
    }
}

impl IfaceRegex {
    /// The expression as given.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

/// What `weft run` was given to choose the underlay interface with.
#[derive(Clone, Debug, Default)]
pub struct Candidates {
    /// `--iface`, in order: names or addresses.
    pub ifaces: Vec<String>,
    /// `--iface-regex`, in order.
    pub regexes: Vec<IfaceRegex>,
    /// `--iface-can-reach`.
    pub can_reach: Option<IpAddr>,
}

/// No candidate named an interface with an address.
#[derive(Debug, thiserror::Error)]
#[error(
    "no interface matches the interfaces and/or regexes given (tried {tried}); interfaces with \
     an address: {available}"
)]
pub struct NoInterface {
    tried: String,
    available: String,
}

/// The `--iface` for the daemon (see the module docs). `addrs` are the host's addresses by
/// interface in the kernel's order; `reach_src` is the source address the kernel would use
/// towards `--iface-can-reach`, if it has a route there.
pub fn choose(
    c: &Candidates,
    addrs: &[(String, IpAddr)],
    reach_src: Option<IpAddr>,
) -> Result<Option<String>, NoInterface> {
    if c.ifaces.is_empty() && c.regexes.is_empty() && c.can_reach.is_none() {
        return Ok(None);
    }
    let given = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => Some(v4.to_string()),
        IpAddr::V6(_) => addrs.iter().find(|(_, a)| *a == ip).map(|(n, _)| n.clone()),
    };
    for spec in &c.ifaces {
        match spec.parse::<IpAddr>() {
            Ok(ip) if addrs.iter().any(|(_, a)| *a == ip) => return Ok(given(ip)),
            Ok(_) => {}
            Err(_) if addrs.iter().any(|(n, _)| n == spec) => return Ok(Some(spec.clone())),
            Err(_) => {}
        }
    }
    for re in &c.regexes {
        if let Some((_, ip)) = addrs.iter().find(|(_, a)| re.0.is_match(&a.to_string())) {
            return Ok(given(*ip));
        }
        if let Some((name, _)) = addrs.iter().find(|(n, _)| re.0.is_match(n)) {
            return Ok(Some(name.clone()));
        }
    }
    if let Some(src) = reach_src
        && addrs.iter().any(|(_, a)| *a == src)
    {
        return Ok(given(src));
    }
    let mut tried: Vec<String> = c.ifaces.iter().map(|i| format!("--iface {i}")).collect();
    tried.extend(c.regexes.iter().map(|r| format!("--iface-regex {}", r.as_str())));
    if let Some(target) = c.can_reach {
        tried.push(match reach_src {
            Some(src) => format!("--iface-can-reach {target} (source {src})"),
            None => format!("--iface-can-reach {target} (no route)"),
        });
    }
    let mut names: Vec<&str> = addrs.iter().map(|(n, _)| n.as_str()).collect();
    names.dedup();
    Err(NoInterface {
        tried: tried.join(", "),
        available: if names.is_empty() { "none".into() } else { names.join(", ") },
    })
}

/// [`choose`] against this host (see the module docs).
pub fn resolve(c: &Candidates) -> anyhow::Result<Option<String>> {
    if c.regexes.is_empty() && c.can_reach.is_none() && c.ifaces.len() <= 1 {
        return Ok(c.ifaces.first().cloned());
    }
    let netlink = Host::open().context("choosing the underlay interface")?;
    let mut addrs: Vec<(String, IpAddr)> = netlink
        .ipv4_addresses_by_interface()
        .context("listing IPv4 addresses")?
        .into_iter()
        .map(|(n, a)| (n, IpAddr::V4(a)))
        .collect();
    let v6 = netlink.ipv6_addresses_by_interface().context("listing IPv6 addresses")?;
    addrs.extend(v6.into_iter().map(|(n, a)| (n, IpAddr::V6(a))));
    let reach_src = c.can_reach.and_then(source_towards);
    Ok(choose(c, &addrs, reach_src)?)
}

/// The source address the kernel picks towards `target` (`ip route get`'s `src`): a UDP
/// socket's local address once connected; nothing is sent.
fn source_towards(target: IpAddr) -> Option<IpAddr> {
    let any: IpAddr = match target {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    socket.connect(SocketAddr::new(target, 9)).ok()?;
    socket.local_addr().ok().map(|a| a.ip()).filter(|ip| !ip.is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "192.0.2.1"),
            ("eth0", "192.0.2.101"),
            ("eth1", "198.51.100.7"),
            ("eth1", "2001:db8::7"),
            ("wg0", "2001:db8:1::1"),
        ]
        .iter()
        .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
        .collect()
    }

    fn cands(ifaces: &[&str], regexes: &[&str], can_reach: Option<&str>) -> Candidates {
        Candidates {
            ifaces: ifaces.iter().map(|s| s.to_string()).collect(),
            regexes: regexes.iter().map(|r| r.parse().unwrap()).collect(),
            can_reach: can_reach.map(|a| a.parse().unwrap()),
        }
    }

    fn pick(c: &Candidates, src: Option<&str>) -> Result<Option<String>, String> {
        choose(c, &addrs(), src.map(|s| s.parse().unwrap())).map_err(|e| e.to_string())
    }

    #[test]
    fn nothing_given_is_the_default_route() {
        assert_eq!(pick(&Candidates::default(), None), Ok(None));
    }

    #[test]
    fn ifaces_are_tried_in_order_names_or_addresses() {
        let some = |s: &str| Ok(Some(s.to_owned()));
        assert_eq!(pick(&cands(&["bond0", "eth1", "eth0"], &[], None), None), some("eth1"));
        assert_eq!(
            pick(&cands(&["10.9.9.9", "192.0.2.101"], &[], None), None),
            some("192.0.2.101")
        );
        // An IPv6 address is given to the daemon as its interface.
        assert_eq!(pick(&cands(&["2001:db8::7"], &[], None), None), some("eth1"));
    }

    #[test]
    fn regexes_match_addresses_first_then_names_after_every_iface() {
        let some = |s: &str| Ok(Some(s.to_owned()));
        assert_eq!(pick(&cands(&[], &[r"^198\.51\."], None), None), some("198.51.100.7"));
        assert_eq!(pick(&cands(&[], &["^eth"], None), None), some("eth0"));
        // `1` matches 127.0.0.1 before any name: Go's unanchored MatchString, addresses first.
        assert_eq!(pick(&cands(&[], &["1"], None), None), some("127.0.0.1"));
        assert_eq!(pick(&cands(&[], &["^wg"], None), None), some("wg0"));
        assert_eq!(pick(&cands(&["nope"], &["nope", r"eth\d"], None), None), some("eth0"));
        assert_eq!(pick(&cands(&["eth1"], &["^eth0$"], None), None), some("eth1"));
    }

    #[test]
    fn can_reach_comes_last_by_its_source_address() {
        let c = cands(&["nope"], &[], Some("203.0.113.1"));
        assert_eq!(pick(&c, Some("192.0.2.101")), Ok(Some("192.0.2.101".into())));
        let c = cands(&["eth1"], &[], Some("203.0.113.1"));
        assert_eq!(pick(&c, Some("192.0.2.101")), Ok(Some("eth1".into())));
    }

    #[test]
    fn nothing_matching_names_what_was_tried_and_what_there_is() {
        let e = pick(&cands(&["bond0"], &["^ens"], Some("203.0.113.1")), None).unwrap_err();
        assert!(
            e.contains(
                "--iface bond0, --iface-regex ^ens, --iface-can-reach 203.0.113.1 (no route)"
            ),
            "{e}"
        );
        assert!(e.contains("lo, eth0, eth1, wg0"), "{e}");
        assert!("(".parse::<IfaceRegex>().unwrap_err().contains("not a regular expression"));
    }

    #[test]
    fn resolve_leaves_a_lone_iface_to_the_daemon_without_asking_the_kernel() {
        let c = cands(&["does-not-exist"], &[], None);
        assert_eq!(resolve(&c).unwrap(), Some("does-not-exist".into()));
        assert_eq!(resolve(&Candidates::default()).unwrap(), None);
    }

    #[test]
    fn the_source_towards_loopback_is_loopback() {
        assert_eq!(
            source_towards("127.0.0.1".parse().unwrap()),
            Some("127.0.0.1".parse().unwrap())
        );
    }
}
