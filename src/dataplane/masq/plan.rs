//! Masquerading (`--ip-masq`) and forward-accept rules: the nftables ruleset weft wants for
//! this host's lease, and what to do about the one the kernel has. Pure: the driver
//! ([`super`]) reads weft's tables, asks [`wanted`] and [`plan`], and writes the whole
//! ruleset in one nftables transaction ([`super::nft`] encodes it).
//!
//! Contract:
//! - [`wanted`] is flanneld's masquerade rules (`pkg/trafficmngr/iptables`, `masqRules`; the
//!   nftables manager has the same rules), in flanneld's order, for each address family the
//!   network carries (IPv4 with `Network`, IPv6 with `IPv6Network`), in a table of weft's own,
//!   [`TABLE`] (`table ip weft`, `table ip6 weft`), chain `postrouting` (nat, hook
//!   postrouting, priority srcnat), with `N` the network, `S` this host's subnet:
//!   1. `meta mark & 0x4000 == 0x4000 return` (kube-proxy's mark: never masquerade twice);
//!   2. `saddr S daddr N return` and 3. `saddr N daddr S return` (pod to cluster and back);
//!   4. `saddr != N daddr S return` (traffic from outside to this host's pods keeps its
//!      source; this is the iptables manager's `! -s N -d S`: the nftables manager writes
//!      `daddr N` there, which leaves rule 6 nothing to match, see docs/configuration.md);
//!   5. `saddr N daddr != M masquerade` (the network's traffic to anything but multicast,
//!      `M` 224.0.0.0/4 or ff00::/8);
//!   6. `saddr != N daddr N masquerade` (anything else into the network).
//!
//!   Masquerades are `fully-random` unless `random_fully` is off. With `forward`, chain
//!   `forward` (filter, hook forward, priority filter) accepts `saddr N` and `daddr N`, as
//!   flanneld's `--iptables-forward-rules`. No subnet yet (before the first lease): no rules
//!   that name it, the table waits ([`wanted`] returns nothing for that family).
//! - [`plan`]: the tables as the kernel has them (decoded rule by rule; a rule weft cannot
//!   read is `None`, never equal) against the wanted ones: nothing, an install (no table, or
//!   one that drifted), or leave alone (a table of another weft's, by its owner comment).
//!   Deterministic; says what drifted so the driver can log it.

#![forbid(unsafe_code)]

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// The name of weft's tables (one per address family).
pub(crate) const TABLE: &str = "weft";
/// The masquerade chain.
pub(crate) const POSTROUTING: &str = "postrouting";
/// The forward-accept chain.
pub(crate) const FORWARD: &str = "forward";
/// kube-proxy's mark (flannel's `KubeProxyMark`, `0x4000/0x4000`).
pub(crate) const KUBE_PROXY_MARK: u32 = 0x4000;

/// An nftables address family weft writes a table in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Family {
    /// `ip`.
    Ip,
    /// `ip6`.
    Ip6,
}

impl Family {
    /// nftables' name of it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Ip => "ip",
            Self::Ip6 => "ip6",
        }
    }
}

/// Where a base chain hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hook {
    /// `type nat hook postrouting priority srcnat` (100).
    Postrouting,
    /// `type filter hook forward priority filter` (0).
    Forward,
}

impl Hook {
    /// The chain's name.
    pub(crate) fn chain(self) -> &'static str {
        match self {
            Self::Postrouting => POSTROUTING,
            Self::Forward => FORWARD,
        }
    }
}

/// One match of a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Match {
    /// `meta mark & m == m`.
    Mark(u32),
    /// `saddr net` (`negated`: `saddr != net`).
    Saddr { net: IpNet, negated: bool },
    /// `daddr net` (`negated`: `daddr != net`).
    Daddr { net: IpNet, negated: bool },
}

/// What a rule does once it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// `return`.
    Return,
    /// `accept`.
    Accept,
    /// `masquerade` (`fully-random`).
    Masquerade { fully_random: bool },
}

/// A rule: every match, then the action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rule {
    /// The matches, in order.
    pub(crate) matches: Vec<Match>,
    /// The action.
    pub(crate) action: Action,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for m in &self.matches {
            match *m {
                Match::Mark(mask) => write!(f, "meta mark & {mask:#010x} == {mask:#010x} ")?,
                Match::Saddr { net, negated } | Match::Daddr { net, negated } => {
                    let family = if net.addr().is_ipv4() { "ip" } else { "ip6" };
                    let field = if matches!(m, Match::Saddr { .. }) { "saddr" } else { "daddr" };
                    let not = if negated { "!= " } else { "" };
                    write!(f, "{family} {field} {not}{net} ")?;
                }
            }
        }
        match self.action {
            Action::Return => f.write_str("return"),
            Action::Accept => f.write_str("accept"),
            Action::Masquerade { fully_random: true } => f.write_str("masquerade fully-random"),
            Action::Masquerade { fully_random: false } => f.write_str("masquerade"),
        }
    }
}

/// A base chain and its rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chain {
    /// Where it hooks (and so its name, type and priority).
    pub(crate) hook: Hook,
    /// Its rules, in order.
    pub(crate) rules: Vec<Rule>,
}

/// One of weft's tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Table {
    /// Its family.
    pub(crate) family: Family,
    /// Its chains.
    pub(crate) chains: Vec<Chain>,
}

impl Table {
    /// How many rules it has.
    pub(crate) fn rule_count(&self) -> usize {
        self.chains.iter().map(|c| c.rules.len()).sum()
    }
}

/// What the rules are made from: the flags, the network config and this host's lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Inputs {
    /// The IPv4 `Network`, if the network carries IPv4.
    pub(crate) network: Option<Ipv4Net>,
    /// This host's IPv4 subnet, once leased.
    pub(crate) subnet: Option<Ipv4Net>,
    /// The `IPv6Network`, if the network carries IPv6.
    pub(crate) network6: Option<Ipv6Net>,
    /// This host's IPv6 subnet, once leased.
    pub(crate) subnet6: Option<Ipv6Net>,
    /// `--ip-masq-random-fully`.
    pub(crate) random_fully: bool,
    /// `--iptables-forward-rules`.
    pub(crate) forward: bool,
}

/// The tables weft wants (see the module docs): IPv4's first, then IPv6's.
pub(crate) fn wanted(i: &Inputs) -> Vec<Table> {
    let mut out = Vec::new();
    let multicast4 = Ipv4Net::new(Ipv4Addr::new(224, 0, 0, 0), 4).map(IpNet::V4);
    let multicast6 = Ipv6Net::new(Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8).map(IpNet::V6);
    let families = [
        (Family::Ip, i.network.map(IpNet::V4), i.subnet.map(IpNet::V4), multicast4),
        (Family::Ip6, i.network6.map(IpNet::V6), i.subnet6.map(IpNet::V6), multicast6),
    ];
    for (family, network, subnet, multicast) in families {
        let (Some(network), Some(subnet), Ok(multicast)) = (network, subnet, multicast) else {
            continue;
        };
        let (network, subnet) = (network.trunc(), subnet.trunc());
        let mut chains = vec![Chain {
            hook: Hook::Postrouting,
            rules: masq_rules(network, subnet, multicast, i.random_fully),
        }];
        if i.forward {
            chains.push(Chain { hook: Hook::Forward, rules: forward_rules(network) });
        }
        out.push(Table { family, chains });
    }
    out
}

fn saddr(net: IpNet) -> Match {
    Match::Saddr { net, negated: false }
}

fn daddr(net: IpNet) -> Match {
    Match::Daddr { net, negated: false }
}

fn not_saddr(net: IpNet) -> Match {
    Match::Saddr { net, negated: true }
}

fn not_daddr(net: IpNet) -> Match {
    Match::Daddr { net, negated: true }
}

/// flanneld's masquerade rules, in its order (see the module docs).
fn masq_rules(network: IpNet, subnet: IpNet, multicast: IpNet, fully_random: bool) -> Vec<Rule> {
    let masq = Action::Masquerade { fully_random };
    let rule = |matches: Vec<Match>, action| Rule { matches, action };
    vec![
        rule(vec![Match::Mark(KUBE_PROXY_MARK)], Action::Return),
        rule(vec![saddr(subnet), daddr(network)], Action::Return),
        rule(vec![saddr(network), daddr(subnet)], Action::Return),
        rule(vec![not_saddr(network), daddr(subnet)], Action::Return),
        rule(vec![saddr(network), not_daddr(multicast)], masq),
        rule(vec![not_saddr(network), daddr(network)], masq),
    ]
}

/// flanneld's forward-accept rules.
fn forward_rules(network: IpNet) -> Vec<Rule> {
    vec![
        Rule { matches: vec![saddr(network)], action: Action::Accept },
        Rule { matches: vec![daddr(network)], action: Action::Accept },
    ]
}

/// A base chain of one of weft's tables as the kernel has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SeenChain {
    /// Its name.
    pub(crate) name: String,
    /// Its hook, if it is one of the two weft makes exactly (type, hook, priority, accept
    /// policy); `None` for any other chain.
    pub(crate) hook: Option<Hook>,
    /// Its rules, decoded; `None` for a rule weft does not write (another expression).
    pub(crate) rules: Vec<Option<Rule>>,
}

/// One of weft's tables (by name) as the kernel has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SeenTable {
    /// Its family.
    pub(crate) family: Family,
    /// The owner its comment names (`weft node <id>`), if it has that comment.
    pub(crate) owner: Option<String>,
    /// Its chains.
    pub(crate) chains: Vec<SeenChain>,
}

/// The comment weft gives its tables: which node's they are.
pub(crate) fn owner_comment(node: &str) -> String {
    format!("weft node {node}")
}

/// The node a table's comment names, if it is weft's.
pub(crate) fn owner_of(comment: &str) -> Option<&str> {
    comment.strip_prefix("weft node ")
}

/// What to do about weft's tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// They are as wanted.
    Nothing,
    /// Write the wanted tables (and delete the other families' of weft's) in one transaction.
    Install {
        /// What was wrong, for the log; empty: nothing was there (a first install).
        drift: Vec<String>,
    },
    /// A table named [`TABLE`] is another node's (another weft beside this one, with another
    /// state dir): leave it alone.
    Foreign {
        /// The family and the node it names.
        owners: Vec<(Family, String)>,
    },
}

/// What to do to take `seen` (weft's tables in the kernel) to `wanted`, for node `me`.
pub(crate) fn plan(wanted: &[Table], seen: &[SeenTable], me: &str) -> Plan {
    let owners: Vec<(Family, String)> = seen
        .iter()
        .filter_map(|t| t.owner.as_deref().filter(|o| *o != me).map(|o| (t.family, o.to_owned())))
        .collect();
    if !owners.is_empty() {
        return Plan::Foreign { owners };
    }
    let mut drift = Vec::new();
    let mut any_seen = false;
    for table in wanted {
        let name = format!("table {} {TABLE}", table.family.name());
        let Some(have) = seen.iter().find(|t| t.family == table.family) else {
            drift.push(format!("{name} was missing"));
            continue;
        };
        any_seen = true;
        if have.owner.is_none() {
            drift.push(format!("{name} had no owner comment"));
        }
        for chain in &table.chains {
            let cname = chain.hook.chain();
            match have.chains.iter().find(|c| c.name == cname) {
                None => drift.push(format!("{name}: chain {cname} was missing")),
                Some(c) if c.hook != Some(chain.hook) => {
                    drift.push(format!("{name}: chain {cname} was hooked otherwise"));
                }
                Some(c) => {
                    let want: Vec<Option<&Rule>> = chain.rules.iter().map(Some).collect();
                    let have: Vec<Option<&Rule>> = c.rules.iter().map(Option::as_ref).collect();
                    if want != have {
                        drift.push(format!(
                            "{name}: chain {cname} had {} rules, {} of them as wanted",
                            have.len(),
                            have.iter().zip(&want).filter(|(h, w)| h == w).count()
                        ));
                    }
                }
            }
        }
        for c in &have.chains {
            if !table.chains.iter().any(|w| w.hook.chain() == c.name) {
                drift.push(format!("{name}: chain {} is not weft's", c.name));
            }
        }
    }
    for have in seen {
        if !wanted.iter().any(|t| t.family == have.family) {
            any_seen = true;
            drift.push(format!("table {} {TABLE} is no longer wanted", have.family.name()));
        }
    }
    if drift.is_empty() {
        Plan::Nothing
    } else if !any_seen {
        Plan::Install { drift: Vec::new() }
    } else {
        Plan::Install { drift }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Inputs {
        Inputs {
            network: Some("10.244.0.0/16".parse().unwrap()),
            subnet: Some("10.244.3.0/24".parse().unwrap()),
            network6: None,
            subnet6: None,
            random_fully: true,
            forward: true,
        }
    }

    fn texts(t: &Table, hook: Hook) -> Vec<String> {
        t.chains
            .iter()
            .find(|c| c.hook == hook)
            .unwrap()
            .rules
            .iter()
            .map(|r| r.to_string())
            .collect()
    }

    /// flanneld's rules, in flanneld's order, with its matches.
    #[test]
    fn ipv4_rules_are_flanneld_s_in_its_order() {
        let tables = wanted(&inputs());
        assert_eq!(tables.len(), 1);
        assert_eq!(tables[0].family, Family::Ip);
        assert_eq!(
            texts(&tables[0], Hook::Postrouting),
            [
                "meta mark & 0x00004000 == 0x00004000 return",
                "ip saddr 10.244.3.0/24 ip daddr 10.244.0.0/16 return",
                "ip saddr 10.244.0.0/16 ip daddr 10.244.3.0/24 return",
                "ip saddr != 10.244.0.0/16 ip daddr 10.244.3.0/24 return",
                "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random",
                "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random",
            ]
        );
        assert_eq!(
            texts(&tables[0], Hook::Forward),
            ["ip saddr 10.244.0.0/16 accept", "ip daddr 10.244.0.0/16 accept"]
        );
        assert_eq!(tables[0].rule_count(), 8);
    }

    #[test]
    fn random_fully_off_and_no_forward_rules() {
        let tables = wanted(&Inputs { random_fully: false, forward: false, ..inputs() });
        assert_eq!(tables[0].chains.len(), 1, "no forward chain");
        let t = texts(&tables[0], Hook::Postrouting);
        assert_eq!(t[4], "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade");
        assert_eq!(t[5], "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade");
    }

    /// Dual stack: an ip6 table beside the ip one, ff00::/8 as multicast; IPv6-only: ip6 alone.
    #[test]
    fn ipv6_gets_a_table_of_its_own() {
        let dual = Inputs {
            network6: Some("fd00:10:244::/56".parse().unwrap()),
            subnet6: Some("fd00:10:244:3::/64".parse().unwrap()),
            ..inputs()
        };
        let tables = wanted(&dual);
        assert_eq!(tables.iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ip, Family::Ip6]);
        let t = texts(&tables[1], Hook::Postrouting);
        assert_eq!(t[1], "ip6 saddr fd00:10:244:3::/64 ip6 daddr fd00:10:244::/56 return");
        assert_eq!(
            t[4],
            "ip6 saddr fd00:10:244::/56 ip6 daddr != ff00::/8 masquerade fully-random"
        );
        assert_eq!(texts(&tables[1], Hook::Forward)[1], "ip6 daddr fd00:10:244::/56 accept");
        let v6_only = Inputs { network: None, subnet: None, ..dual };
        assert_eq!(wanted(&v6_only).iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ip6]);
    }

    /// Before the first lease nothing names a subnet: no table at all.
    #[test]
    fn no_lease_no_rules() {
        assert!(wanted(&Inputs { subnet: None, ..inputs() }).is_empty());
    }

    fn seen_of(tables: &[Table], owner: &str) -> Vec<SeenTable> {
        tables
            .iter()
            .map(|t| SeenTable {
                family: t.family,
                owner: Some(owner.to_owned()),
                chains: t
                    .chains
                    .iter()
                    .map(|c| SeenChain {
                        name: c.hook.chain().to_owned(),
                        hook: Some(c.hook),
                        rules: c.rules.iter().cloned().map(Some).collect(),
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn the_same_tables_need_nothing_and_nothing_there_is_a_first_install() {
        let want = wanted(&inputs());
        assert_eq!(plan(&want, &seen_of(&want, "n1"), "n1"), Plan::Nothing);
        assert_eq!(plan(&want, &[], "n1"), Plan::Install { drift: vec![] });
        assert_eq!(plan(&[], &[], "n1"), Plan::Nothing, "no lease, no table: nothing");
    }

    /// A deleted rule, a changed one, an unknown one, a missing chain: each a drift, named.
    #[test]
    fn drift_is_found_and_named() {
        let want = wanted(&inputs());
        let mut seen = seen_of(&want, "n1");
        seen[0].chains[0].rules.remove(2);
        let Plan::Install { drift } = plan(&want, &seen, "n1") else { panic!() };
        assert_eq!(drift, ["table ip weft: chain postrouting had 5 rules, 2 of them as wanted"]);

        let mut seen = seen_of(&want, "n1");
        seen[0].chains[1].rules[0] = None;
        let Plan::Install { drift } = plan(&want, &seen, "n1") else { panic!() };
        assert_eq!(drift, ["table ip weft: chain forward had 2 rules, 1 of them as wanted"]);

        let mut seen = seen_of(&want, "n1");
        seen[0].chains.remove(1);
        seen[0].chains[0].hook = None;
        let Plan::Install { drift } = plan(&want, &seen, "n1") else { panic!() };
        assert_eq!(
            drift,
            [
                "table ip weft: chain postrouting was hooked otherwise",
                "table ip weft: chain forward was missing"
            ]
        );

        // A subnet change: the rules name the old subnet.
        let moved = wanted(&Inputs { subnet: Some("10.244.9.0/24".parse().unwrap()), ..inputs() });
        assert!(
            matches!(plan(&moved, &seen_of(&want, "n1"), "n1"), Plan::Install { drift } if drift.len() == 1)
        );
        // No lease any more, or IPv6 turned off: the table goes.
        let Plan::Install { drift } = plan(&[], &seen_of(&want, "n1"), "n1") else { panic!() };
        assert_eq!(drift, ["table ip weft is no longer wanted"]);
        // Made by hand, without weft's comment: taken (and said).
        let mut seen = seen_of(&want, "n1");
        seen[0].owner = None;
        let Plan::Install { drift } = plan(&want, &seen, "n1") else { panic!() };
        assert_eq!(drift, ["table ip weft had no owner comment"]);
    }

    /// Another node's table (a second weft beside this one) is left alone.
    #[test]
    fn another_weft_s_table_is_left_alone() {
        let want = wanted(&inputs());
        assert_eq!(
            plan(&want, &seen_of(&want, "other"), "n1"),
            Plan::Foreign { owners: vec![(Family::Ip, "other".to_owned())] }
        );
    }

    #[test]
    fn owner_comment_round_trips() {
        assert_eq!(owner_of(&owner_comment("abc-123")), Some("abc-123"));
        assert_eq!(owner_of("rules for flannel-ipv4"), None);
    }
}
