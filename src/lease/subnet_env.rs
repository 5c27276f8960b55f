//! flannel's `subnet.env`: the file that tells the CNI `flannel` plugin (and anything else that
//! reads flannel's output) which subnet this host holds.
//!
//! Contract:
//! - [`SubnetEnv::render`] writes flannel's exact bytes: four `KEY=value` lines in flannel's
//!   order, no quotes, no `export`, each ending in `\n`. `FLANNEL_SUBNET` is the lease's first
//!   host address (network address plus one) with the lease's prefix length, as flannel writes it:
//!   ```text
//!   FLANNEL_NETWORK=10.5.0.0/16
//!   FLANNEL_SUBNET=10.5.52.1/24
//!   FLANNEL_MTU=1450
//!   FLANNEL_IPMASQ=false
//!   ```
//!   On a dual-stack network, flannel's IPv6 pair comes between `FLANNEL_SUBNET` and
//!   `FLANNEL_MTU`, written the same way: `FLANNEL_IPV6_NETWORK=fd00:10:244::/56` and
//!   `FLANNEL_IPV6_SUBNET=fd00:10:244:1::1/64`.
//! - [`SubnetEnv::parse`] reads what flannel's godotenv reader reads: blank lines and `#` comments
//!   are skipped, `export ` prefixes and quotes are tolerated, unknown keys (an operator's
//!   additions) are ignored, and for repeated keys the last one wins. The IPv6 pair is optional,
//!   but one of the two without the other is corrupt.
//!   `FLANNEL_SUBNET=10.5.52.1/24` means the subnet `10.5.52.0/24`.
//! - The file is a hint from the past, never an authority: whoever wrote it (an older weft,
//!   flannel, an operator, a crash halfway through a non-atomic copy) may have been wrong. So
//!   [`read`] never fails hard; it says the file is [`ReadOutcome::Missing`], or
//!   [`ReadOutcome::Valid`], or [`ReadOutcome::Corrupt`] with the reason, and a corrupt file is
//!   warned about and ignored, not half-trusted. Parsing never panics.
//! - A truncated file reads as corrupt, not as a different valid file: every key is required and
//!   `FLANNEL_IPMASQ`, the last line, takes only `true` or `false`, so cutting the file anywhere
//!   before its final newline loses a key or leaves an invalid value.
//! - [`write_atomic`] replaces the file by renaming a complete, fsynced temp file over it (like
//!   flannel's `renameio.WriteFile`), so a reader sees the old file or the new one, never a mix.
//!   Both directions go through [`crate::atomic_file`]: a symlink is neither followed on read
//!   nor written through.

#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use ipnet::{Ipv4Net, Ipv6Net};

use crate::atomic_file::{self, FileError, ReadError};
use crate::config::{MAX_IPV6_SUBNET_LEN, MAX_SUBNET_LEN};
use crate::lease::record::{Ipv6Subnet, Subnet};

/// Files larger than this are refused unread: a real `subnet.env` is about 100 bytes.
pub(crate) const MAX_FILE_LEN: u64 = 64 * 1024;

/// The contents of `subnet.env`: the IPv4 pair, the IPv6 pair or both (at least one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubnetEnv {
    /// The IPv4 pair, unless the network is IPv6-only (flannel writes it only with
    /// `EnableIPv4`).
    pub(crate) ipv4: Option<SubnetEnv4>,
    /// The MTU of the overlay interface (`FLANNEL_MTU`).
    pub(crate) mtu: u32,
    /// Whether the daemon masquerades traffic leaving the overlay (`FLANNEL_IPMASQ`).
    pub(crate) ipmasq: bool,
    /// The IPv6 pair, on a dual-stack or IPv6-only network.
    pub(crate) ipv6: Option<SubnetEnv6>,
}

/// The IPv4 pair of `subnet.env`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubnetEnv4 {
    /// The cluster network (`FLANNEL_NETWORK`).
    pub(crate) network: Ipv4Net,
    /// This host's leased subnet (`FLANNEL_SUBNET`, written as its first host address).
    pub(crate) subnet: Subnet,
}

/// The IPv6 pair of a dual-stack or IPv6-only `subnet.env`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubnetEnv6 {
    /// The cluster's IPv6 network (`FLANNEL_IPV6_NETWORK`).
    pub(crate) network: Ipv6Net,
    /// This host's IPv6 subnet (`FLANNEL_IPV6_SUBNET`, written as its first host address).
    pub(crate) subnet: Ipv6Subnet,
}

/// What a line of the file got wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    /// No `=` in the line.
    #[error("not KEY=value")]
    NoEquals,
    /// The key is empty or has characters a variable name can't.
    #[error("not a variable name before '='")]
    BadKey,
    /// A quoted value has no closing quote.
    #[error("unclosed quote")]
    UnclosedQuote,
    /// Something other than a comment follows a quoted value.
    #[error("text after the closing quote")]
    TextAfterQuote,
}

/// Why `subnet.env` could not be read, written or trusted. Messages name the path or the key.
#[derive(Debug, thiserror::Error)]
pub enum SubnetEnvError {
    /// Writing the file (or creating its directory) failed.
    #[error(transparent)]
    Io(#[from] FileError),
    /// The file exists but could not be read (a symlink, not a regular file, an I/O error).
    #[error(transparent)]
    Unreadable(ReadError),
    /// The file is larger than [`MAX_FILE_LEN`].
    #[error("{}: larger than {MAX_FILE_LEN} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// The file is not UTF-8 text.
    #[error("not UTF-8 text")]
    NotUtf8,
    /// A line is not `KEY=value`.
    #[error("line {line}: {problem}")]
    MalformedLine {
        /// The line number, from 1.
        line: usize,
        /// What is wrong with it.
        problem: LineProblem,
    },
    /// Neither pair is present: no `FLANNEL_NETWORK` and no `FLANNEL_IPV6_NETWORK`.
    #[error("FLANNEL_NETWORK and FLANNEL_IPV6_NETWORK: both missing (one pair is required)")]
    NoSubnet,
    /// A required key is absent.
    #[error("{key}: missing")]
    Missing {
        /// The key.
        key: &'static str,
    },
    /// A key's value does not parse.
    #[error("{key}: {value:?} is not {expected}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value (shortened if long).
        value: String,
        /// What the key takes, e.g. "an IPv4 CIDR".
        expected: &'static str,
    },
    /// `FLANNEL_SUBNET` is a comma list of more than one entry, which flannel ignores too.
    #[error("FLANNEL_SUBNET: holds {count} entries; exactly one is expected")]
    MultipleSubnets {
        /// The number of entries.
        count: usize,
    },
    /// `FLANNEL_SUBNET` is longer than any config allows, so flannel's `+1` spelling of it does
    /// not read back as the same subnet.
    #[error("FLANNEL_SUBNET: {subnet} is longer than /{MAX_SUBNET_LEN}")]
    SubnetTooLong {
        /// The subnet.
        subnet: Ipv4Net,
    },
    /// `FLANNEL_SUBNET` is not inside `FLANNEL_NETWORK`.
    #[error("FLANNEL_SUBNET: {subnet} is outside FLANNEL_NETWORK {network}")]
    SubnetOutsideNetwork {
        /// The subnet.
        subnet: Subnet,
        /// The network.
        network: Ipv4Net,
    },
    /// `FLANNEL_NETWORK` has host bits set (refused on write; on read they are masked off).
    #[error("FLANNEL_NETWORK: {network} has host bits set")]
    NetworkHostBits {
        /// The network.
        network: Ipv4Net,
    },
    /// `FLANNEL_IPV6_SUBNET` is longer than any config allows (`IPv6SubnetLen` is at most 126),
    /// so its first host address would not read back as the same subnet.
    #[error("FLANNEL_IPV6_SUBNET: {subnet} is longer than /{MAX_IPV6_SUBNET_LEN}")]
    Ipv6SubnetTooLong {
        /// The subnet.
        subnet: Ipv6Subnet,
    },
    /// `FLANNEL_IPV6_SUBNET` is not inside `FLANNEL_IPV6_NETWORK`, or `FLANNEL_IPV6_NETWORK` has
    /// host bits set (on write).
    #[error("FLANNEL_IPV6_SUBNET: {subnet} is outside FLANNEL_IPV6_NETWORK {network}")]
    Ipv6SubnetOutsideNetwork {
        /// The subnet.
        subnet: Ipv6Subnet,
        /// The network.
        network: Ipv6Net,
    },
}

/// What [`read`] found.
#[derive(Debug)]
pub(crate) enum ReadOutcome {
    /// There is no file (or no directory holding it).
    Missing,
    /// The file parsed and is consistent.
    Valid(SubnetEnv),
    /// The file exists but can't be read or trusted; the caller warns and ignores it.
    Corrupt(SubnetEnvError),
}

impl ReadOutcome {
    /// The contents, if valid.
    #[cfg(test)]
    pub(crate) fn into_valid(self) -> Option<SubnetEnv> {
        match self {
            Self::Valid(env) => Some(env),
            Self::Missing | Self::Corrupt(_) => None,
        }
    }
}

const NETWORK: &str = "FLANNEL_NETWORK";
const SUBNET: &str = "FLANNEL_SUBNET";
const MTU: &str = "FLANNEL_MTU";
const IPMASQ: &str = "FLANNEL_IPMASQ";
const IPV6_NETWORK: &str = "FLANNEL_IPV6_NETWORK";
const IPV6_SUBNET: &str = "FLANNEL_IPV6_SUBNET";

impl SubnetEnv {
    /// The file's bytes, exactly as flannel writes them. Only a [`SubnetEnv::validate`]d value
    /// reads back as itself.
    pub fn render(&self) -> String {
        let ipv4 = self.ipv4.map_or_else(String::new, |v4| {
            format!(
                "{NETWORK}={}\n{SUBNET}={}/{}\n",
                v4.network,
                v4.subnet.first_host(),
                v4.subnet.prefix_len()
            )
        });
        let ipv6 = self.ipv6.map_or_else(String::new, |v6| {
            format!(
                "{IPV6_NETWORK}={}\n{IPV6_SUBNET}={}/{}\n",
                v6.network,
                v6.subnet.first_host(),
                v6.subnet.prefix_len()
            )
        });
        format!("{ipv4}{ipv6}{MTU}={}\n{IPMASQ}={}\n", self.mtu, self.ipmasq)
    }

    /// The lease's identity this file names ([`Subnet`]): the IPv4 subnet, or on an IPv6-only
    /// network the IPv6 one. `None` only for a value built with neither pair.
    pub fn subnet(&self) -> Option<Subnet> {
        match (self.ipv4, self.ipv6) {
            (Some(v4), _) => Some(v4.subnet),
            (None, Some(v6)) => Some(Subnet::from(v6.subnet)),
            (None, None) => None,
        }
    }

    /// Checks that [`SubnetEnv::render`] of this value reads back as it: it has a pair, each
    /// network has no host bits, and each subnet is at most a /30 (a /126) inside its network.
    ///
    /// # Errors
    /// [`SubnetEnvError::NoSubnet`], [`SubnetEnvError::NetworkHostBits`],
    /// [`SubnetEnvError::SubnetTooLong`], [`SubnetEnvError::SubnetOutsideNetwork`] or their
    /// IPv6 counterparts.
    pub fn validate(&self) -> Result<(), SubnetEnvError> {
        if self.ipv4.is_none() && self.ipv6.is_none() {
            return Err(SubnetEnvError::NoSubnet);
        }
        if let Some(v4) = self.ipv4 {
            if v4.network.addr() != v4.network.network() {
                return Err(SubnetEnvError::NetworkHostBits { network: v4.network });
            }
            check_subnet(v4.network, v4.subnet)?;
        }
        match self.ipv6 {
            Some(v6) if v6.network.addr() != v6.network.network() => {
                Err(SubnetEnvError::Ipv6SubnetOutsideNetwork {
                    subnet: v6.subnet,
                    network: v6.network,
                })
            }
            Some(v6) => check_subnet6(v6.network, v6.subnet),
            None => Ok(()),
        }
    }

    /// Parses the file's text the way flannel's godotenv reader does (see the module docs).
    ///
    /// # Errors
    /// [`SubnetEnvError`] naming the line or the key and the problem.
    pub fn parse(text: &str) -> Result<Self, SubnetEnvError> {
        let (mut network, mut subnet, mut mtu, mut ipmasq) = (None, None, None, None);
        let (mut network6, mut subnet6) = (None, None);
        for (i, line) in text.lines().enumerate() {
            let Some((key, value)) = parse_line(line)
                .map_err(|problem| SubnetEnvError::MalformedLine { line: i + 1, problem })?
            else {
                continue;
            };
            match key {
                NETWORK => network = Some(value),
                SUBNET => subnet = Some(value),
                MTU => mtu = Some(value),
                IPMASQ => ipmasq = Some(value),
                IPV6_NETWORK => network6 = Some(value),
                IPV6_SUBNET => subnet6 = Some(value),
                _ => {}
            }
        }
        let missing = |key| SubnetEnvError::Missing { key };

        let ipv4 = match (network, subnet) {
            (None, None) if network6.is_some() || subnet6.is_some() => None,
            (None, None) => return Err(SubnetEnvError::NoSubnet),
            (None, Some(_)) => return Err(missing(NETWORK)),
            (Some(_), None) => return Err(missing(SUBNET)),
            (Some(network), Some(subnet)) => Some(parse_ipv4_pair(network, subnet)?),
        };

        let text = mtu.ok_or_else(|| missing(MTU))?;
        let mtu = parse_decimal(text).ok_or_else(|| bad_value(MTU, text, "a number"))?;

        let text = ipmasq.ok_or_else(|| missing(IPMASQ))?;
        // Only flannel's two spellings (any case), not Go's ParseBool's `t`/`f`/`1`/`0`: those
        // would let a file cut inside `true` or `false` read as valid.
        let ipmasq = if text.eq_ignore_ascii_case("true") {
            true
        } else if text.eq_ignore_ascii_case("false") {
            false
        } else {
            return Err(bad_value(IPMASQ, text, "true or false"));
        };

        let ipv6 = match (network6, subnet6) {
            (None, None) => None,
            (None, Some(_)) => return Err(missing(IPV6_NETWORK)),
            (Some(_), None) => return Err(missing(IPV6_SUBNET)),
            (Some(network), Some(subnet)) => Some(parse_ipv6_pair(network, subnet)?),
        };

        Ok(Self { ipv4, mtu, ipmasq, ipv6 })
    }
}

/// `FLANNEL_NETWORK` (masked, as Go's net.ParseCIDR masks it) and `FLANNEL_SUBNET` (the first
/// host address: the subnet is its network), which must lie inside it.
fn parse_ipv4_pair(network: &str, subnet: &str) -> Result<SubnetEnv4, SubnetEnvError> {
    let text = network;
    // Masked, as Go's net.ParseCIDR masks it for flannel's reader.
    let network = parse_cidr(text)
        .ok_or_else(|| bad_value(NETWORK, text, "an IPv4 CIDR (a.b.c.d/len)"))?
        .trunc();

    let text = subnet;
    let count = text.split(',').count();
    if count > 1 {
        return Err(SubnetEnvError::MultipleSubnets { count });
    }
    let net =
        parse_cidr(text).ok_or_else(|| bad_value(SUBNET, text, "an IPv4 CIDR (a.b.c.d/len)"))?;
    if net.prefix_len() > MAX_SUBNET_LEN {
        return Err(SubnetEnvError::SubnetTooLong { subnet: net });
    }
    // The file holds the first host address; the subnet is its network.
    let subnet = Subnet::new(net.trunc())
        .map_err(|_| bad_value(SUBNET, text, "an IPv4 CIDR (a.b.c.d/len)"))?;
    check_subnet(network, subnet)?;

    Ok(SubnetEnv4 { network, subnet })
}

/// `FLANNEL_IPV6_NETWORK` (masked, as Go's net.ParseCIDR masks it) and `FLANNEL_IPV6_SUBNET`
/// (the first host address: the subnet is its network), which must lie inside it.
fn parse_ipv6_pair(network: &str, subnet: &str) -> Result<SubnetEnv6, SubnetEnvError> {
    const EXPECTED: &str = "an IPv6 CIDR (addr/len)";
    let network =
        parse_cidr6(network).ok_or_else(|| bad_value(IPV6_NETWORK, network, EXPECTED))?.trunc();
    let net = parse_cidr6(subnet).ok_or_else(|| bad_value(IPV6_SUBNET, subnet, EXPECTED))?;
    let subnet =
        Ipv6Subnet::new(net.trunc()).map_err(|_| bad_value(IPV6_SUBNET, subnet, EXPECTED))?;
    check_subnet6(network, subnet)?;
    Ok(SubnetEnv6 { network, subnet })
}

fn check_subnet6(network: Ipv6Net, subnet: Ipv6Subnet) -> Result<(), SubnetEnvError> {
    if subnet.prefix_len() > MAX_IPV6_SUBNET_LEN {
        return Err(SubnetEnvError::Ipv6SubnetTooLong { subnet });
    }
    if network.contains(&subnet.net()) {
        Ok(())
    } else {
        Err(SubnetEnvError::Ipv6SubnetOutsideNetwork { subnet, network })
    }
}

/// `addr/len` with a plain decimal length of at most 128.
fn parse_cidr6(text: &str) -> Option<Ipv6Net> {
    let (addr, len) = text.split_once('/')?;
    let addr: Ipv6Addr = addr.parse().ok()?;
    if len.is_empty() || len.len() > 3 {
        return None;
    }
    Ipv6Net::new(addr, parse_decimal(len)?.try_into().ok()?).ok()
}

fn check_subnet(network: Ipv4Net, subnet: Subnet) -> Result<(), SubnetEnvError> {
    let Some(net) = subnet.v4() else {
        // An IPv6 subnet in the IPv4 pair: a value built wrong, never written.
        return Err(SubnetEnvError::SubnetOutsideNetwork { subnet, network });
    };
    if net.prefix_len() > MAX_SUBNET_LEN {
        return Err(SubnetEnvError::SubnetTooLong { subnet: net });
    }
    if !network.contains(&net) {
        return Err(SubnetEnvError::SubnetOutsideNetwork { subnet, network });
    }
    Ok(())
}

/// One line: `Ok(None)` for a blank or comment line, else the key and the unquoted value.
fn parse_line(line: &str) -> Result<Option<(&str, &str)>, LineProblem> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let line = match line.strip_prefix("export") {
        Some(rest) if rest.starts_with([' ', '\t']) => rest.trim_start(),
        _ => line,
    };
    let (key, value) = line.split_once('=').ok_or(LineProblem::NoEquals)?;
    let key = key.trim_end();
    let key_ok = !key.is_empty()
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !key_ok {
        return Err(LineProblem::BadKey);
    }
    Ok(Some((key, unquote(value.trim_start())?)))
}

/// A value without its quotes, or without a trailing ` # comment` if unquoted (godotenv's rules,
/// minus escapes and `${VAR}` expansion, which no value of this file needs).
fn unquote(value: &str) -> Result<&str, LineProblem> {
    let Some(quote) = value.chars().next().filter(|c| matches!(c, '"' | '\'')) else {
        let end = value
            .char_indices()
            .find(|&(i, c)| c == '#' && value[..i].ends_with([' ', '\t']))
            .map_or(value.len(), |(i, _)| i);
        return Ok(value[..end].trim_end());
    };
    // Quotes are ASCII, so these byte offsets are char boundaries.
    let inner = &value[1..];
    let close = inner.find(quote).ok_or(LineProblem::UnclosedQuote)?;
    let rest = inner[close + 1..].trim_start();
    if !rest.is_empty() && !rest.starts_with('#') {
        return Err(LineProblem::TextAfterQuote);
    }
    Ok(&inner[..close])
}

/// `a.b.c.d/len` with a plain decimal length.
fn parse_cidr(text: &str) -> Option<Ipv4Net> {
    let (addr, len) = text.split_once('/')?;
    let addr: Ipv4Addr = addr.parse().ok()?;
    if len.is_empty() || len.len() > 2 {
        return None;
    }
    Ipv4Net::new(addr, parse_decimal(len)?.try_into().ok()?).ok()
}

/// Plain decimal digits only: `u32::from_str` would also take `+1450`.
fn parse_decimal(text: &str) -> Option<u32> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn bad_value(key: &'static str, value: &str, expected: &'static str) -> SubnetEnvError {
    // Bounded: the file may be garbage of any length.
    const LIMIT: usize = 40;
    let mut value = value.to_owned();
    if value.len() > LIMIT {
        let mut cut = LIMIT;
        while !value.is_char_boundary(cut) {
            cut -= 1;
        }
        value.truncate(cut);
        value.push('…');
    }
    SubnetEnvError::BadValue { key, value, expected }
}

/// Reads `subnet.env` (without following a symlink). Never fails hard: see [`ReadOutcome`].
pub(crate) fn read(path: &Path) -> ReadOutcome {
    let bytes = match atomic_file::read(path, MAX_FILE_LEN) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return ReadOutcome::Missing,
        Err(ReadError::TooLarge { path, .. }) => {
            return ReadOutcome::Corrupt(SubnetEnvError::TooLarge { path });
        }
        Err(e) => return ReadOutcome::Corrupt(SubnetEnvError::Unreadable(e)),
    };
    let Ok(text) = String::from_utf8(bytes) else {
        return ReadOutcome::Corrupt(SubnetEnvError::NotUtf8);
    };
    match SubnetEnv::parse(&text) {
        Ok(env) => ReadOutcome::Valid(env),
        Err(e) => ReadOutcome::Corrupt(e),
    }
}

/// Writes `subnet.env` with [`atomic_file::write`] (mode 0644, as flannel), creating missing
/// parent directories (mode 0755, as flannel).
///
/// On failure the old file, if any, is untouched and the temp file is removed.
///
/// # Errors
/// [`SubnetEnvError::Io`] naming the path that failed, or a [`SubnetEnv::validate`] error: a
/// value that would not read back is never written.
pub(crate) fn write_atomic(path: &Path, env: &SubnetEnv) -> Result<(), SubnetEnvError> {
    env.validate()?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    atomic_file::create_dir(dir, 0o755)?;
    atomic_file::write(path, env.render().as_bytes(), atomic_file::PUBLIC_MODE)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use proptest::prelude::*;

    use super::*;

    const FLANNEL_EXAMPLE: &str = "FLANNEL_NETWORK=10.5.0.0/16\nFLANNEL_SUBNET=10.5.52.1/24\n\
                                   FLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n";

    fn example() -> SubnetEnv {
        SubnetEnv {
            ipv4: Some(SubnetEnv4 {
                network: "10.5.0.0/16".parse().unwrap(),
                subnet: "10.5.52.0/24".parse().unwrap(),
            }),
            mtu: 1450,
            ipmasq: false,
            ipv6: None,
        }
    }

    /// What flannel writes on a dual-stack network (its WriteSubnetFile's order).
    const FLANNEL_DUAL_EXAMPLE: &str = "FLANNEL_NETWORK=10.5.0.0/16\nFLANNEL_SUBNET=10.5.52.1/24\n\
                                        FLANNEL_IPV6_NETWORK=fd00:10:5::/56\n\
                                        FLANNEL_IPV6_SUBNET=fd00:10:5:34::1/64\n\
                                        FLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n";

    fn dual_example() -> SubnetEnv {
        SubnetEnv {
            ipv6: Some(SubnetEnv6 {
                network: "fd00:10:5::/56".parse().unwrap(),
                subnet: "fd00:10:5:34::/64".parse().unwrap(),
            }),
            ..example()
        }
    }

    /// What flannel writes on an IPv6-only network: no IPv4 pair (its WriteSubnetFile writes
    /// it only with EnableIPv4).
    const FLANNEL_IPV6_ONLY_EXAMPLE: &str = "FLANNEL_IPV6_NETWORK=fd00:10:5::/56\n\
                                             FLANNEL_IPV6_SUBNET=fd00:10:5:34::1/64\n\
                                             FLANNEL_MTU=1430\nFLANNEL_IPMASQ=false\n";

    #[test]
    fn renders_and_reads_an_ipv6_only_file_as_flannel() {
        let env = SubnetEnv { ipv4: None, mtu: 1430, ..dual_example() };
        assert_eq!(env.render(), FLANNEL_IPV6_ONLY_EXAMPLE);
        assert_eq!(SubnetEnv::parse(FLANNEL_IPV6_ONLY_EXAMPLE).unwrap(), env);
        env.validate().unwrap();
        // Its lease's identity is the IPv6 subnet; a dual-stack file's is the IPv4 one.
        assert_eq!(env.subnet(), Some("fd00:10:5:34::/64".parse().unwrap()));
        assert_eq!(dual_example().subnet(), Some("10.5.52.0/24".parse().unwrap()));
        // Cut anywhere before its last newline, it is corrupt, never another valid file.
        for cut in 0..FLANNEL_IPV6_ONLY_EXAMPLE.len() - 1 {
            let text = &FLANNEL_IPV6_ONLY_EXAMPLE[..cut];
            assert!(SubnetEnv::parse(text).is_err(), "cut at {cut}: {text:?}");
        }
        // One key of the IPv4 pair without the other is corrupt here too.
        let half = format!("FLANNEL_SUBNET=10.5.52.1/24\n{FLANNEL_IPV6_ONLY_EXAMPLE}");
        assert!(matches!(
            SubnetEnv::parse(&half),
            Err(SubnetEnvError::Missing { key: "FLANNEL_NETWORK" })
        ));
    }

    #[test]
    fn renders_and_reads_the_dual_stack_pair_as_flannel() {
        assert_eq!(dual_example().render(), FLANNEL_DUAL_EXAMPLE);
        assert_eq!(SubnetEnv::parse(FLANNEL_DUAL_EXAMPLE).unwrap(), dual_example());
        dual_example().validate().unwrap();
        // Either key alone is corrupt, and so is a subnet outside the network or not IPv6.
        let without = |key: &str| {
            FLANNEL_DUAL_EXAMPLE
                .lines()
                .filter(|l| !l.starts_with(key))
                .collect::<Vec<_>>()
                .join("\n")
        };
        for (text, want) in [
            (without("FLANNEL_IPV6_NETWORK="), "FLANNEL_IPV6_NETWORK: missing"),
            (without("FLANNEL_IPV6_SUBNET="), "FLANNEL_IPV6_SUBNET: missing"),
            (
                FLANNEL_DUAL_EXAMPLE.replace("fd00:10:5:34::1/64", "fd00:10:6::1/64"),
                "FLANNEL_IPV6_SUBNET: fd00:10:6::/64 is outside FLANNEL_IPV6_NETWORK fd00:10:5::/56",
            ),
            (
                FLANNEL_DUAL_EXAMPLE.replace("fd00:10:5:34::1/64", "10.0.0.1/24"),
                "FLANNEL_IPV6_SUBNET: \"10.0.0.1/24\" is not an IPv6 CIDR (addr/len)",
            ),
            (
                FLANNEL_DUAL_EXAMPLE.replace("fd00:10:5:34::1/64", "fd00:10:5:34::1/128"),
                "FLANNEL_IPV6_SUBNET: fd00:10:5:34::1/128 is longer than /126",
            ),
            (
                FLANNEL_DUAL_EXAMPLE.replace("fd00:10:5:34::1/64", "fd00:10:5:34::1/0129"),
                "FLANNEL_IPV6_SUBNET: \"fd00:10:5:34::1/0129\" is not an IPv6 CIDR (addr/len)",
            ),
        ] {
            assert_eq!(SubnetEnv::parse(&text).unwrap_err().to_string(), want, "{text}");
        }
        // A network with host bits is masked on read, refused on write.
        let mut bad = dual_example();
        bad.ipv6 =
            Some(SubnetEnv6 { network: "fd00:10:5::1/56".parse().unwrap(), ..bad.ipv6.unwrap() });
        assert!(bad.validate().is_err());
    }

    #[test]
    fn renders_flannel_example_byte_for_byte() {
        assert_eq!(example().render(), FLANNEL_EXAMPLE);
        assert_eq!(SubnetEnv::parse(FLANNEL_EXAMPLE).unwrap(), example());
    }

    #[test]
    fn reads_like_godotenv() {
        let texts = [
            // Comments, blank lines, export, quotes, CRLF, unknown keys, other order.
            "# written by flannel\n\nexport FLANNEL_NETWORK=10.5.0.0/16\n\
             FLANNEL_SUBNET=\"10.5.52.1/24\"\r\n  FLANNEL_MTU = '1450'  \n\
             FLANNEL_SOMETHING_ELSE=fc00::/48\nFLANNEL_IPMASQ=false # no masquerade\n",
            "FLANNEL_IPMASQ=FALSE\nFLANNEL_MTU=1450\nFLANNEL_SUBNET=10.5.52.0/24\n\
             FLANNEL_NETWORK=10.5.0.0/16",
            // The last of a repeated key wins; the network is masked, as net.ParseCIDR does.
            "FLANNEL_NETWORK=10.9.0.0/16\nFLANNEL_NETWORK=10.5.0.1/16\n\
             FLANNEL_SUBNET=10.5.52.200/24\nFLANNEL_MTU=1450\nexport\tFLANNEL_IPMASQ=\"false\" # x\n",
        ];
        for text in texts {
            assert_eq!(SubnetEnv::parse(text).unwrap(), example(), "{text}");
        }
        let masq = FLANNEL_EXAMPLE.replace("IPMASQ=false", "IPMASQ=true");
        assert!(SubnetEnv::parse(&masq).unwrap().ipmasq);
    }

    #[test]
    #[rustfmt::skip]
    fn errors_name_the_key_or_line() {
        let replace = |from: &str, to: &str| FLANNEL_EXAMPLE.replace(from, to);
        let without = |key: &str| {
            FLANNEL_EXAMPLE
                .lines()
                .filter(|l| !l.starts_with(&format!("{key}=")))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let cases = [
            (without(NETWORK), "FLANNEL_NETWORK: missing"),
            (without(SUBNET), "FLANNEL_SUBNET: missing"),
            (without(MTU), "FLANNEL_MTU: missing"),
            (without(IPMASQ), "FLANNEL_IPMASQ: missing"),
            (String::new(), "FLANNEL_NETWORK and FLANNEL_IPV6_NETWORK: both missing"),
            (replace("10.5.0.0/16", "10.5.0.0"), "FLANNEL_NETWORK: \"10.5.0.0\" is not an IPv4 CIDR"),
            (replace("10.5.0.0/16", "10.5.0.0/+6"), "FLANNEL_NETWORK: \"10.5.0.0/+6\" is not"),
            (replace("10.5.52.1/24", "10.5.52.1/33"), "FLANNEL_SUBNET: \"10.5.52.1/33\" is not"),
            (replace("10.5.52.1/24", ""), "FLANNEL_SUBNET: \"\" is not an IPv4 CIDR"),
            (replace("10.5.52.1/24", "10.5.52.1/24,fc00::1/64"), "FLANNEL_SUBNET: holds 2 entries"),
            (replace("10.5.52.1/24", "10.5.52.1/24,"), "FLANNEL_SUBNET: holds 2 entries"),
            (replace("10.5.52.1/24", "10.5.52.1/31"), "FLANNEL_SUBNET: 10.5.52.1/31 is longer than /30"),
            (replace("10.5.52.1/24", "10.6.52.1/24"),
                "FLANNEL_SUBNET: 10.6.52.0/24 is outside FLANNEL_NETWORK 10.5.0.0/16"),
            (replace("10.5.52.1/24", "10.5.52.1/8"), "FLANNEL_SUBNET: 10.0.0.0/8 is outside"),
            (replace("1450", "abc"), "FLANNEL_MTU: \"abc\" is not a number"),
            (replace("1450", "-1"), "FLANNEL_MTU: \"-1\" is not a number"),
            (replace("1450", "+1450"), "FLANNEL_MTU: \"+1450\" is not a number"),
            (replace("1450", "99999999999"), "FLANNEL_MTU: \"99999999999\" is not a number"),
            (replace("=false", "=no"), "FLANNEL_IPMASQ: \"no\" is not true or false"),
            (replace("=false", "=f"), "FLANNEL_IPMASQ: \"f\" is not true or false"),
            (replace("FLANNEL_MTU=", "FLANNEL_MTU "), "line 3: not KEY=value"),
            (replace("FLANNEL_MTU=", "FLANNEL MTU="), "line 3: not a variable name"),
            (replace("FLANNEL_MTU=", "="), "line 3: not a variable name"),
            (replace("=1450", "=\"1450"), "line 3: unclosed quote"),
            (replace("=1450", "='1450'x"), "line 3: text after the closing quote"),
        ];
        for (text, want) in cases {
            let got = match SubnetEnv::parse(&text) {
                Ok(env) => panic!("{text:?}: accepted as {env:?}"),
                Err(e) => e.to_string(),
            };
            assert!(
                got.starts_with(want),
                "{text:?}\n  got:  {got}\n  want: {want}..."
            );
        }
    }

    #[test]
    fn long_bad_values_are_shortened() {
        let text = FLANNEL_EXAMPLE.replace("1450", &"9x".repeat(5000));
        let e = SubnetEnv::parse(&text).unwrap_err().to_string();
        assert!(e.len() < 100, "{e}");
    }

    #[test]
    fn validate_refuses_what_would_not_read_back() {
        let with4 = |f: &dyn Fn(&mut SubnetEnv4)| {
            let mut env = example();
            env.ipv4.as_mut().map(f);
            env.validate()
        };
        let e = with4(&|v4| v4.network = "10.5.0.1/16".parse().unwrap());
        assert!(matches!(e, Err(SubnetEnvError::NetworkHostBits { .. })));
        let e = with4(&|v4| v4.subnet = "10.6.0.0/24".parse().unwrap());
        assert!(matches!(e, Err(SubnetEnvError::SubnetOutsideNetwork { .. })));
        let e = with4(&|v4| v4.subnet = "10.5.0.0/31".parse().unwrap());
        assert!(matches!(e, Err(SubnetEnvError::SubnetTooLong { .. })));
        // An IPv6 subnet in the IPv4 pair, and a file of neither pair.
        let e = with4(&|v4| v4.subnet = "fd00:10:5::/64".parse().unwrap());
        assert!(matches!(e, Err(SubnetEnvError::SubnetOutsideNetwork { .. })));
        let none = SubnetEnv { ipv4: None, ..example() };
        assert!(matches!(none.validate(), Err(SubnetEnvError::NoSubnet)));
        assert!(example().validate().is_ok());
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn write_atomic_creates_parents_and_replaces_cleanly() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run/flannel");
        let path = dir.join("subnet.env");
        assert!(matches!(read(&path), ReadOutcome::Missing));

        write_atomic(&path, &example()).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), FLANNEL_EXAMPLE);
        assert_eq!(mode(&path), 0o644);
        // At most 0755: the umask may take bits away, never add group or other write.
        assert_eq!(mode(&dir) & !0o755, 0);
        assert_eq!(read(&path).into_valid(), Some(example()));

        // Overwrite a file that was left with other permissions.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let mut next = example();
        next.ipv4.as_mut().unwrap().subnet = "10.5.9.0/24".parse().unwrap();
        next.ipmasq = true;
        write_atomic(&path, &next).unwrap();
        assert_eq!(mode(&path), 0o644);
        assert_eq!(read(&path).into_valid(), Some(next));
        assert_eq!(names(&dir), ["subnet.env"], "no temp files left behind");
    }

    #[test]
    fn write_atomic_refuses_invalid_and_unwritable() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("subnet.env");
        let mut bad = example();
        bad.ipv4.as_mut().unwrap().subnet = "10.6.0.0/24".parse().unwrap();
        assert!(matches!(
            write_atomic(&path, &bad),
            Err(SubnetEnvError::SubnetOutsideNetwork { .. })
        ));
        assert!(names(tmp.path()).is_empty());

        // The target is a directory: the rename fails, and the temp file is cleaned up.
        fs::create_dir(&path).unwrap();
        let e = write_atomic(&path, &example()).unwrap_err();
        assert!(e.to_string().contains("subnet.env"), "{e}");
        assert_eq!(names(tmp.path()), ["subnet.env"]);
        assert!(matches!(read(&path), ReadOutcome::Corrupt(SubnetEnvError::Unreadable(_))));

        // A parent that is a file.
        let plain = tmp.path().join("plain");
        fs::write(&plain, b"").unwrap();
        let e = write_atomic(&plain.join("x/subnet.env"), &example()).unwrap_err();
        assert!(matches!(&e, SubnetEnvError::Io(e) if e.path.ends_with("plain/x")), "{e}");
        // A symlinked subnet.env is not followed: it reads as corrupt and is replaced.
        let link = tmp.path().join("link.env");
        std::os::unix::fs::symlink(&plain, &link).unwrap();
        assert!(matches!(read(&link), ReadOutcome::Corrupt(SubnetEnvError::Unreadable(_))));
        write_atomic(&link, &example()).unwrap();
        assert_eq!(fs::read(&plain).unwrap(), b"");
    }

    #[test]
    fn read_reports_corrupt_files() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("subnet.env");
        let cases: [&[u8]; 5] = [
            b"",
            b"\xff\xfe\x00garbage",
            b"FLANNEL_NETWORK=10.5.0.0/16\nFLANNEL_SUBNET=10.5.5",
            &FLANNEL_EXAMPLE.as_bytes()[..FLANNEL_EXAMPLE.len() - 3],
            b"\0\0\0\0\0\0\0\0",
        ];
        for bytes in cases {
            fs::write(&path, bytes).unwrap();
            assert!(matches!(read(&path), ReadOutcome::Corrupt(_)), "{bytes:?}");
        }
        fs::write(&path, vec![b'#'; MAX_FILE_LEN as usize + 1]).unwrap();
        assert!(matches!(read(&path), ReadOutcome::Corrupt(SubnetEnvError::TooLarge { .. })));
        assert!(matches!(read(&tmp.path().join("nope/subnet.env")), ReadOutcome::Missing));
    }

    fn any_env() -> impl Strategy<Value = SubnetEnv> {
        (0u8..=MAX_SUBNET_LEN, any::<u32>(), any::<u32>(), any::<u8>(), any::<u32>(), any::<bool>())
            .prop_map(|(net_len, net_addr, pick, extra, mtu, ipmasq)| {
                let network = Ipv4Net::new(Ipv4Addr::from(net_addr), net_len).unwrap().trunc();
                let sub_len = net_len + extra % (MAX_SUBNET_LEN - net_len + 1);
                let host_bits = !u32::from(network.netmask());
                let addr = u32::from(network.network()) | (pick & host_bits);
                let subnet = Ipv4Net::new(Ipv4Addr::from(addr), sub_len).unwrap().trunc();
                let ipv4 = Some(SubnetEnv4 { network, subnet: Subnet::new(subnet).unwrap() });
                SubnetEnv { ipv4, mtu, ipmasq, ipv6: None }
            })
    }

    /// Text made of pieces of real files, so that the fuzzing reaches past the first line.
    fn env_like_text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("FLANNEL_NETWORK=".to_owned()),
            Just("FLANNEL_SUBNET=".to_owned()),
            Just("FLANNEL_MTU=".to_owned()),
            Just("FLANNEL_IPMASQ=".to_owned()),
            Just("export ".to_owned()),
            Just("\n".to_owned()),
            Just("\"".to_owned()),
            Just("'".to_owned()),
            Just(" #".to_owned()),
            Just("10.5.0.0/16".to_owned()),
            Just("10.5.52.1/24".to_owned()),
            Just(",".to_owned()),
            Just("true".to_owned()),
            "[0-9./]{0,12}",
            any::<String>(),
        ];
        prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #[test]
        fn render_parse_round_trips(env in any_env()) {
            prop_assert!(env.validate().is_ok());
            prop_assert_eq!(SubnetEnv::parse(&env.render()).unwrap(), env);
        }

        #[test]
        fn truncated_files_are_corrupt(env in any_env()) {
            let text = env.render();
            // Cutting only the final newline loses nothing; any other cut must be refused.
            for cut in 0..text.len() - 1 {
                let got = SubnetEnv::parse(&text[..cut]);
                prop_assert!(got.is_err(), "{:?} accepted as {:?}", &text[..cut], got);
            }
        }

        #[test]
        fn parse_never_panics(text in any::<String>()) {
            let _ = SubnetEnv::parse(&text);
        }

        #[test]
        fn parse_never_panics_on_env_like_text(text in env_like_text()) {
            if let Ok(env) = SubnetEnv::parse(&text) {
                // Whatever it accepts is consistent.
                prop_assert!(env.validate().is_ok());
            }
        }

        #[test]
        fn read_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let tmp = tempfile::tempdir().unwrap();
            let path = tmp.path().join("subnet.env");
            fs::write(&path, &bytes).unwrap();
            prop_assert!(!matches!(read(&path), ReadOutcome::Missing));
        }
    }
}
