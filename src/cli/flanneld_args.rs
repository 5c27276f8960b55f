//! flanneld's command line, read as flanneld reads it and rewritten as `weft run`'s, so that a
//! flanneld unit's `ExecStart=` line works with the binary's name changed.
//!
//! # Contract
//! - [`normalize`] is pure: argv, weft's own `run` flags and an environment lookup in, argv
//!   for clap (or a [`FlagError`]) and [`Notice`]s out. It never panics, whatever the bytes.
//! - It rewrites only `weft run …` and a command line that starts with a flag (`weft
//!   -etcd-endpoints=…`, flanneld's form, which means `weft run`); every other command line
//!   is returned as it came.
//! - Flags are read with Go's `flag` rules, which flanneld uses: one dash or two (`-iface`,
//!   `--iface`), the value after `=` or in the next argument (taken whatever it looks like),
//!   a bool as `-ip-masq` or `-ip-masq=false` (strconv.ParseBool's spellings), the last of a
//!   repeated single-valued flag winning, `-h`/`-help` for help. Where Go would stop reading
//!   flags (at `--` or at the first argument that is not a flag) and silently ignore the rest,
//!   weft refuses, naming the argument.
//! - Every flag of flanneld's ([`FLANNELD_FLAGS`]) becomes weft's flag of the same meaning, or
//!   is accepted and ignored with a [`Notice`] saying why (iptables tuning), or is refused with
//!   what to do instead (`--ip-blackhole-route`). weft's own flags are accepted with one dash too.
//! - A flanneld flag not on the command line is read from `FLANNELD_<NAME>` as flanneld does
//!   (its `flagutil.SetFlagsFromEnv`), unless weft's own variable for it (`WEFT_<NAME>`) is set.
//! - Error messages and notices name flags, never a flag's value (an etcd password).

use std::ffi::{OsStr, OsString};

/// How Go's `flag` package reads a flanneld flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `-x` (true) or `-x=BOOL`; never the next argument.
    Bool,
    /// `-x=V` or `-x V`; given twice, the last wins.
    Value,
    /// An integer (`strconv.ParseInt` with base 0: `60`, `0x3c`), otherwise as [`Kind::Value`].
    Int,
    /// `-x=V` or `-x V`, every occurrence kept in order (`--iface`, `--iface-regex`).
    Repeated,
}

/// What a flanneld flag is in weft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Becomes {
    /// weft's `run` flag of this name, with the same meaning. A bool is weft's switch (given
    /// when true); an empty value of a flag whose flanneld default is empty means "not given".
    Weft(&'static str),
    /// A bool given to weft's flag of this name as its value (`--name=true|false`).
    WeftBool(&'static str),
    /// A bool given to weft's flag of this name negated (`-x-disable` -> `--x=false`).
    WeftNot(&'static str),
    /// Print the version and exit.
    Version,
    /// Accepted and ignored, with this reason as a notice.
    Ignored(&'static str),
    /// A bool accepted when false; when true ignored with this reason as a notice.
    IgnoredIfTrue(&'static str),
    /// A bool accepted when false; when true refused with this message.
    RefusedIfTrue(&'static str),
}

/// One flag of flanneld's (`main.go`'s flag set, klog's `-v`, `-vmodule`, `-log_backtrace_at`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlanneldFlag {
    /// The name, without dashes.
    pub name: &'static str,
    /// How its value is read.
    pub kind: Kind,
    /// What weft makes of it.
    pub becomes: Becomes,
    /// Whether flanneld's default is the empty string, so that an empty value (`-public-ip=`,
    /// what a unit's `${UNSET}` expands to) means the flag was not given.
    pub empty_is_unset: bool,
}

const fn flag(name: &'static str, kind: Kind, becomes: Becomes) -> FlanneldFlag {
    FlanneldFlag { name, kind, becomes, empty_is_unset: false }
}

const fn flag_default_empty(name: &'static str, kind: Kind, becomes: Becomes) -> FlanneldFlag {
    FlanneldFlag { name, kind, becomes, empty_is_unset: true }
}

/// Every flag flanneld defines (v0.19 to v0.28), in `main.go`'s order, then klog's three.
pub const FLANNELD_FLAGS: &[FlanneldFlag] = &[
    flag("etcd-endpoints", Kind::Value, Becomes::Weft("etcd-endpoints")),
    flag("etcd-prefix", Kind::Value, Becomes::Weft("etcd-prefix")),
    flag_default_empty("etcd-keyfile", Kind::Value, Becomes::Weft("etcd-keyfile")),
    flag_default_empty("etcd-certfile", Kind::Value, Becomes::Weft("etcd-certfile")),
    flag_default_empty("etcd-cafile", Kind::Value, Becomes::Weft("etcd-cafile")),
    flag_default_empty("etcd-username", Kind::Value, Becomes::Weft("etcd-username")),
    flag_default_empty("etcd-password", Kind::Value, Becomes::Weft("etcd-password")),
    flag_default_empty("iface", Kind::Repeated, Becomes::Weft("iface")),
    flag_default_empty("iface-regex", Kind::Repeated, Becomes::Weft("iface-regex")),
    flag_default_empty("iface-can-reach", Kind::Value, Becomes::Weft("iface-can-reach")),
    flag("subnet-file", Kind::Value, Becomes::Weft("subnet-file")),
    flag_default_empty("public-ip", Kind::Value, Becomes::Weft("public-ip")),
    flag_default_empty("public-ipv6", Kind::Value, Becomes::Weft("public-ipv6")),
    // weft's own parser takes flanneld's bare minutes and a duration (`30s`).
    flag("subnet-lease-renew-margin", Kind::Value, Becomes::Weft("subnet-lease-renew-margin")),
    flag("ip-masq", Kind::Bool, Becomes::Weft("ip-masq")),
    flag("ip-masq-fully-random-disable", Kind::Bool, Becomes::WeftNot("ip-masq-random-fully")),
    flag("kube-subnet-mgr", Kind::Bool, Becomes::Weft("kube-subnet-mgr")),
    flag_default_empty("kube-api-url", Kind::Value, Becomes::Weft("kube-api-url")),
    flag("kube-annotation-prefix", Kind::Value, Becomes::Weft("kube-annotation-prefix")),
    flag_default_empty("kubeconfig-file", Kind::Value, Becomes::Weft("kubeconfig-file")),
    flag("version", Kind::Bool, Becomes::Version),
    flag("healthz-ip", Kind::Value, Becomes::Weft("healthz-ip")),
    flag("healthz-port", Kind::Value, Becomes::Weft("healthz-port")),
    flag("iptables-resync", Kind::Int, Becomes::Weft("iptables-resync")),
    flag("iptables-forward-rules", Kind::Bool, Becomes::WeftBool("iptables-forward-rules")),
    flag(
        "ip-blackhole-route",
        Kind::Bool,
        Becomes::RefusedIfTrue(
            "weft adds no blackhole route for its subnet; add one from --on-subnet-change \
             (ip route replace blackhole \"$2\"), or leave the flag out",
        ),
    ),
    flag("net-config-path", Kind::Value, Becomes::Weft("net-config-path")),
    flag(
        "set-node-network-unavailable",
        Kind::Bool,
        Becomes::Ignored(
            "weft sets the Node's NetworkUnavailable condition to False once it forwards, as \
             flanneld does by default",
        ),
    ),
    // klog's verbosity: weft's `--verbosity` (1 or more turns on weft's debug lines).
    flag("v", Kind::Value, Becomes::Weft("verbosity")),
    flag_default_empty(
        "vmodule",
        Kind::Value,
        Becomes::Ignored("it names Go source files; use WEFT_LOG (e.g. weft::lease=debug)"),
    ),
    flag_default_empty(
        "log_backtrace_at",
        Kind::Value,
        Becomes::Ignored("it names a Go source line; weft logs no backtraces"),
    ),
];

/// The flanneld flag named `name` (without dashes), if there is one.
pub fn flanneld_flag(name: &str) -> Option<&'static FlanneldFlag> {
    FLANNELD_FLAGS.iter().find(|f| f.name == name)
}

/// One of weft's own `run` flags, as clap defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeftFlag<'a> {
    /// Its long name, without dashes.
    pub long: &'a str,
    /// Whether it takes a value (else it is a switch).
    pub takes_value: bool,
}

/// How loud a [`Notice`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Said for the record.
    Info,
    /// Something flanneld would have done that weft does not.
    Warn,
}

/// Something the daemon logs at start about how its command line was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// How loud.
    pub level: Level,
    /// What to say.
    pub text: String,
}

/// A command line that flanneld would refuse, or that weft refuses where flanneld would
/// silently ignore part of it. The message names the argument and what to do instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FlagError(String);

/// A command line ready for clap, and what to say about it once logging is up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Normalized {
    /// argv for clap.
    pub args: Vec<OsString>,
    /// What was ignored, read from the environment or is done differently.
    pub notices: Vec<Notice>,
}

/// Rewrites `args` (argv, the program first) as described in the module docs. `weft` lists
/// `weft run`'s own flags; `env` looks an environment variable up.
pub fn normalize(
    args: Vec<OsString>,
    weft: &[WeftFlag<'_>],
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Normalized, FlagError> {
    let unchanged = |args| Ok(Normalized { args, notices: Vec::new() });
    let Some(first) = args.get(1).and_then(|a| a.to_str()) else { return unchanged(args) };
    let rest = match first {
        "run" => &args[2..],
        "-h" | "--help" | "-V" | "--version" | "--" => return unchanged(args),
        flag if flag.starts_with('-') => &args[1..],
        _ => return unchanged(args),
    };
    let mut out = vec![args[0].clone()];
    let run = read_run_flags(rest, weft, env)?;
    match run.special {
        Some(Special::Help) => out.extend(["run", "--help"].map(OsString::from)),
        Some(Special::Version) => out.push("--version".into()),
        None => {
            out.push("run".into());
            out.extend(run.args);
        }
    }
    Ok(Normalized { args: out, notices: run.notices })
}

/// `--help` or `--version`, which end the reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Special {
    Help,
    Version,
}

/// One flag as read, in command-line order.
#[derive(Clone, Debug)]
enum Item {
    /// A flanneld flag and its value (`"true"`/`"false"` for a bool, already checked).
    Flanneld(&'static FlanneldFlag, OsString),
    /// Arguments passed to clap as they are (weft's own flags, one dash made two).
    Weft(Vec<OsString>),
}

struct RunFlags {
    args: Vec<OsString>,
    notices: Vec<Notice>,
    special: Option<Special>,
}

/// The longest piece of an argument quoted in a message.
const QUOTE_MAX: usize = 64;

/// `arg` for a message: at most [`QUOTE_MAX`] characters, lossy, debug-quoted.
fn quote(arg: &OsStr) -> String {
    let text = arg.to_string_lossy();
    let cut: String = text.chars().take(QUOTE_MAX).collect();
    if cut.len() < text.len() { format!("{:?}…", cut) } else { format!("{cut:?}") }
}

/// Go's `strconv.ParseBool`.
fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Go's `strconv.ParseInt(v, 0, 64)`: a sign, then decimal, `0x`/`0o`/`0b` or a leading `0`
/// (octal); an underscore only between digits or right after a base prefix.
fn go_int(v: &str) -> Option<i64> {
    let (negative, digits) = match v.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, v.strip_prefix('+').unwrap_or(v)),
    };
    let lower = digits.to_ascii_lowercase();
    let (radix, body, prefixed) = if let Some(b) = lower.strip_prefix("0x") {
        (16, b, true)
    } else if let Some(b) = lower.strip_prefix("0o") {
        (8, b, true)
    } else if let Some(b) = lower.strip_prefix("0b") {
        (2, b, true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..], true)
    } else {
        (10, lower.as_str(), false)
    };
    if body.ends_with('_') || body.contains("__") || (!prefixed && body.starts_with('_')) {
        return None;
    }
    let body = body.replace('_', "");
    if body.is_empty() || !body.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = i128::from_str_radix(&body, radix).ok()?;
    let value = if negative { -magnitude } else { magnitude };
    i64::try_from(value).ok()
}

fn read_run_flags(
    rest: &[OsString],
    weft: &[WeftFlag<'_>],
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<RunFlags, FlagError> {
    let mut items: Vec<Item> = Vec::new();
    let mut i = 0;
    while i < rest.len() {
        let arg = &rest[i];
        i += 1;
        let Some(text) = arg.to_str() else {
            // Not UTF-8: no flag of weft's or flanneld's; clap names it.
            items.push(Item::Weft(vec![arg.clone()]));
            continue;
        };
        if text == "--" {
            if let Some(next) = rest.get(i) {
                return Err(FlagError(format!(
                    "{} after \"--\": flanneld reads no flags after \"--\" and ignores the \
                     rest; weft refuses it: remove \"--\" and what follows, or make it flags",
                    quote(next)
                )));
            }
            break;
        }
        if !text.starts_with('-') || text == "-" {
            return Err(FlagError(format!(
                "{} is not a flag: flanneld stops reading flags there and ignores it and every \
                 argument after it; weft refuses it (remove it, or join it to its flag as \
                 -flag=value; a bool flag takes its value after '=': -ip-masq=false)",
                quote(arg)
            )));
        }
        let dashes = if text.starts_with("--") { 2 } else { 1 };
        let body = &text[dashes..];
        if body.is_empty() || body.starts_with('-') || body.starts_with('=') {
            return Err(FlagError(format!("bad flag syntax: {}", quote(arg))));
        }
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(OsString::from(v))),
            None => (body, None),
        };
        if name == "h" || name == "help" {
            return Ok(RunFlags {
                args: Vec::new(),
                notices: Vec::new(),
                special: Some(Special::Help),
            });
        }
        if let Some(f) = flanneld_flag(name) {
            let value = match (f.kind, inline) {
                (Kind::Bool, None) => OsString::from("true"),
                (Kind::Bool, Some(v)) => match v.to_str().and_then(go_bool) {
                    Some(b) => OsString::from(b.to_string()),
                    None => {
                        return Err(FlagError(format!(
                            "invalid boolean value {} for -{name}: flanneld takes 1, t, T, TRUE, \
                             true, True, 0, f, F, FALSE, false or False",
                            quote(&v)
                        )));
                    }
                },
                (_, Some(v)) => v,
                (_, None) => match rest.get(i) {
                    Some(v) => {
                        i += 1;
                        v.clone()
                    }
                    None => return Err(FlagError(format!("flag needs an argument: -{name}"))),
                },
            };
            if f.kind == Kind::Int && value.to_str().and_then(go_int).is_none() {
                return Err(FlagError(format!(
                    "invalid value {} for -{name}: flanneld takes an integer",
                    quote(&value)
                )));
            }
            if f.kind != Kind::Repeated {
                items.retain(|it| !matches!(it, Item::Flanneld(g, _) if g.name == f.name));
            }
            items.push(Item::Flanneld(f, value));
            continue;
        }
        let Some(w) = weft.iter().find(|w| w.long == name) else {
            return Err(FlagError(format!(
                "unknown flag -{}: not a flag of flanneld's etcd mode nor of weft run (see \
                 weft run --help)",
                quote(OsStr::new(name)).trim_matches('"')
            )));
        };
        match (w.takes_value, inline) {
            (true, Some(v)) => {
                let mut a = OsString::from(format!("--{name}="));
                a.push(v);
                items.push(Item::Weft(vec![a]));
            }
            (true, None) => {
                let mut group = vec![OsString::from(format!("--{name}"))];
                if let Some(v) = rest.get(i) {
                    group.push(v.clone());
                    i += 1;
                }
                items.push(Item::Weft(group));
            }
            (false, None) => items.push(Item::Weft(vec![OsString::from(format!("--{name}"))])),
            (false, Some(v)) => match v.to_str().and_then(go_bool) {
                Some(true) => items.push(Item::Weft(vec![OsString::from(format!("--{name}"))])),
                Some(false) => {}
                // clap says what is wrong with it.
                None => {
                    let mut a = OsString::from(format!("--{name}="));
                    a.push(v);
                    items.push(Item::Weft(vec![a]));
                }
            },
        }
    }
    let mut notices = Vec::new();
    // flanneld's environment, for its flags not on the command line.
    for f in FLANNELD_FLAGS {
        if items.iter().any(|it| matches!(it, Item::Flanneld(g, _) if g.name == f.name)) {
            continue;
        }
        let var = format!("FLANNELD_{}", f.name.to_ascii_uppercase().replace('-', "_"));
        let Some(value) = env(&var).filter(|v| !v.is_empty()) else { continue };
        if let Becomes::Weft(w) = f.becomes {
            let own = format!("WEFT_{}", w.to_ascii_uppercase().replace('-', "_"));
            if env(&own).is_some() {
                notices.push(Notice {
                    level: Level::Info,
                    text: format!("{var} is not read: {own} is set"),
                });
                continue;
            }
        }
        let value = match f.kind {
            Kind::Bool => match value.to_str().and_then(go_bool) {
                Some(b) => OsString::from(b.to_string()),
                None => {
                    return Err(FlagError(format!(
                        "invalid boolean value in {var}: flanneld takes 1, t, true, 0, f, false \
                         and their capitals"
                    )));
                }
            },
            Kind::Int if value.to_str().and_then(go_int).is_none() => {
                return Err(FlagError(format!(
                    "invalid value in {var}: flanneld takes an integer"
                )));
            }
            _ => value,
        };
        notices.push(Notice {
            level: Level::Info,
            text: format!("read {var} as flanneld's -{}", f.name),
        });
        items.push(Item::Flanneld(f, value));
    }
    let mut args = Vec::new();
    let mut special = None;
    for item in items {
        let (f, value) = match item {
            Item::Weft(group) => {
                args.extend(group);
                continue;
            }
            Item::Flanneld(f, value) => (f, value),
        };
        let on = value == "true";
        match f.becomes {
            Becomes::Weft(w) if f.kind == Kind::Bool => {
                if on {
                    args.push(OsString::from(format!("--{w}")));
                }
            }
            Becomes::Weft(_) if value.is_empty() && f.empty_is_unset => {}
            Becomes::WeftBool(w) => args.push(OsString::from(format!("--{w}={on}"))),
            Becomes::WeftNot(w) => args.push(OsString::from(format!("--{w}={}", !on))),
            // Go's integer spellings (0x10, 0o20, 1_000) as the decimal weft's parser reads.
            Becomes::Weft(w) if f.kind == Kind::Int => {
                let n =
                    value.to_str().and_then(go_int).map_or(value.clone(), |n| n.to_string().into());
                let mut a = OsString::from(format!("--{w}="));
                a.push(&n);
                args.push(a);
            }
            Becomes::Weft(w) => {
                let mut a = OsString::from(format!("--{w}="));
                a.push(&value);
                args.push(a);
            }
            Becomes::Version if on => special = Some(Special::Version),
            Becomes::Version => {}
            Becomes::Ignored(why) => notices.push(Notice {
                level: Level::Warn,
                text: format!("flanneld's -{} is ignored: {why}", f.name),
            }),
            Becomes::IgnoredIfTrue(why) if on => notices.push(Notice {
                level: Level::Warn,
                text: format!("flanneld's -{} is ignored: {why}", f.name),
            }),
            Becomes::IgnoredIfTrue(_) => {}
            Becomes::RefusedIfTrue(why) if on => {
                return Err(FlagError(format!("-{}: {why}", f.name)));
            }
            Becomes::RefusedIfTrue(_) => {}
        }
    }
    Ok(RunFlags { args, notices, special })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEFT: &[WeftFlag<'static>] = &[
        WeftFlag { long: "tun-name", takes_value: true },
        WeftFlag { long: "relinquish-on-exit", takes_value: false },
        WeftFlag { long: "subnet-lease-ttl", takes_value: true },
    ];

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    fn norm(args: &[&str]) -> Result<Vec<String>, String> {
        norm_env(args, &no_env)
    }

    fn norm_env(
        args: &[&str],
        env: &dyn Fn(&str) -> Option<OsString>,
    ) -> Result<Vec<String>, String> {
        let args = args.iter().map(OsString::from).collect();
        normalize(args, WEFT, env)
            .map(|n| n.args.into_iter().map(|a| a.into_string().unwrap()).collect())
            .map_err(|e| e.to_string())
    }

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn go_spellings_become_weft_run_flags() {
        for line in [
            &["weft", "-etcd-endpoints=http://e:2379", "-iface", "eth0", "--ip-masq"][..],
            &["weft", "--etcd-endpoints", "http://e:2379", "--iface=eth0", "-ip-masq=true"],
            &["weft", "run", "-etcd-endpoints", "http://e:2379", "-iface=eth0", "-ip-masq=T"],
        ] {
            assert_eq!(
                norm(line).unwrap(),
                v(&["weft", "run", "--etcd-endpoints=http://e:2379", "--iface=eth0", "--ip-masq"]),
                "{line:?}"
            );
        }
    }

    #[test]
    fn other_commands_pass_unchanged() {
        for line in [
            &["weft"][..],
            &["weft", "lease", "list", "-etcd-endpoints=x"],
            &["weft", "--version"],
            &["weft", "-h"],
            &["weft", "network", "get"],
            &["weft", "frobnicate", "-x"],
        ] {
            assert_eq!(norm(line).unwrap(), v(line));
        }
    }

    #[test]
    fn a_bool_false_is_left_out_and_a_bad_bool_refused() {
        assert_eq!(norm(&["weft", "-ip-masq=false"]).unwrap(), v(&["weft", "run"]));
        assert_eq!(norm(&["weft", "-ip-masq", "-ip-masq=0"]).unwrap(), v(&["weft", "run"]));
        let e = norm(&["weft", "-ip-masq=yes"]).unwrap_err();
        assert!(e.contains("invalid boolean value \"yes\" for -ip-masq"), "{e}");
        // Go never takes a bool's value from the next argument: "true" is a stray word.
        let e = norm(&["weft", "-ip-masq", "true", "-iface=eth0"]).unwrap_err();
        assert!(e.contains("\"true\" is not a flag") && e.contains("-ip-masq=false"), "{e}");
    }

    #[test]
    fn iface_repeats_in_order_and_single_flags_keep_the_last() {
        assert_eq!(
            norm(&[
                "weft",
                "-iface=eth1",
                "-etcd-prefix=/a",
                "--iface",
                "10.0.0.1",
                "-etcd-prefix",
                "/b"
            ])
            .unwrap(),
            v(&["weft", "run", "--iface=eth1", "--iface=10.0.0.1", "--etcd-prefix=/b"])
        );
    }

    #[test]
    fn an_empty_value_of_an_empty_default_means_not_given() {
        // What `-public-ip=${PUBLIC_IP}` expands to with the variable unset.
        assert_eq!(
            norm(&["weft", "-public-ip=", "-iface=", "-etcd-prefix="]).unwrap(),
            v(&["weft", "run", "--etcd-prefix="])
        );
    }

    #[test]
    fn a_value_is_taken_from_the_next_argument_whatever_it_looks_like() {
        assert_eq!(
            norm(&["weft", "-etcd-password", "-secret-", "-v", "2"]).unwrap(),
            v(&["weft", "run", "--etcd-password=-secret-", "--verbosity=2"])
        );
        let e = norm(&["weft", "-iface"]).unwrap_err();
        assert_eq!(e, "flag needs an argument: -iface");
        let e = norm(&["weft", "-etcd-password"]).unwrap_err();
        assert_eq!(e, "flag needs an argument: -etcd-password");
    }

    #[test]
    fn help_and_version() {
        assert_eq!(norm(&["weft", "-help"]).unwrap(), v(&["weft", "run", "--help"]));
        assert_eq!(norm(&["weft", "-iface=x", "-h"]).unwrap(), v(&["weft", "run", "--help"]));
        assert_eq!(norm(&["weft", "-version"]).unwrap(), v(&["weft", "--version"]));
        assert_eq!(
            norm(&["weft", "-version=false", "-iface=x"]).unwrap(),
            v(&["weft", "run", "--iface=x"])
        );
    }

    #[test]
    fn weft_flags_take_one_dash_and_go_bools_too() {
        assert_eq!(
            norm(&["weft", "-tun-name", "w1", "-relinquish-on-exit=true", "-subnet-lease-ttl=10s"])
                .unwrap(),
            v(&[
                "weft",
                "run",
                "--tun-name",
                "w1",
                "--relinquish-on-exit",
                "--subnet-lease-ttl=10s"
            ])
        );
        assert_eq!(
            norm(&["weft", "run", "--relinquish-on-exit=false"]).unwrap(),
            v(&["weft", "run"])
        );
    }

    #[test]
    fn unknown_flags_stray_words_and_bad_syntax_are_refused_by_name() {
        let e = norm(&["weft", "-etcd-endpoint=x"]).unwrap_err();
        assert!(e.contains("unknown flag -etcd-endpoint:"), "{e}");
        let e = norm(&["weft", "-iface=eth0", "FLANNEL_OPTIONS"]).unwrap_err();
        assert!(e.contains("\"FLANNEL_OPTIONS\" is not a flag"), "{e}");
        let e = norm(&["weft", "-iface=eth0", "--", "-x"]).unwrap_err();
        assert!(e.contains("after \"--\""), "{e}");
        assert_eq!(
            norm(&["weft", "run", "-iface=eth0", "--"]).unwrap(),
            v(&["weft", "run", "--iface=eth0"])
        );
        for bad in ["---x", "-=x", "--=", "-"] {
            assert!(norm(&["weft", "run", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn kube_mode_and_the_iptables_flags_are_taken_and_the_blackhole_route_refused() {
        assert_eq!(
            norm(&["weft", "-kube-subnet-mgr", "-kube-annotation-prefix=example.com/x"]).unwrap(),
            v(&["weft", "run", "--kube-subnet-mgr", "--kube-annotation-prefix=example.com/x"])
        );
        assert_eq!(norm(&["weft", "-kube-subnet-mgr=false"]).unwrap(), v(&["weft", "run"]));
        let e = norm(&["weft", "-ip-blackhole-route"]).unwrap_err();
        assert!(e.contains("--on-subnet-change"), "{e}");
        // The iptables flags are weft's masquerading flags (--ip-masq).
        let args = ["weft", "-iptables-resync=0x10", "-iptables-forward-rules", "-vmodule=x=2"];
        let n = normalize(args.iter().map(OsString::from).collect(), WEFT, &no_env).unwrap();
        let want = v(&["weft", "run", "--iptables-resync=16", "--iptables-forward-rules=true"]);
        assert_eq!(n.args, want.into_iter().map(OsString::from).collect::<Vec<_>>());
        let texts: Vec<&str> = n.notices.iter().map(|n| n.text.as_str()).collect();
        assert_eq!(n.notices.len(), 1, "{texts:?}");
        let e = norm(&["weft", "-iptables-resync=often"]).unwrap_err();
        assert!(e.contains("takes an integer"), "{e}");
        assert_eq!(
            norm(&["weft", "-iptables-forward-rules=false", "-ip-masq-fully-random-disable"])
                .unwrap(),
            v(&["weft", "run", "--iptables-forward-rules=false", "--ip-masq-random-fully=false"])
        );
    }

    #[test]
    fn flanneld_variables_fill_in_unless_the_flag_or_weft_own_variable_is_given() {
        let env = |k: &str| -> Option<OsString> {
            match k {
                "FLANNELD_IFACE" => Some("eth9".into()),
                "FLANNELD_ETCD_PREFIX" => Some("/from-env".into()),
                "FLANNELD_PUBLIC_IP" => Some("192.0.2.9".into()),
                "WEFT_PUBLIC_IP" => Some("192.0.2.1".into()),
                "FLANNELD_IP_MASQ" => Some("1".into()),
                "FLANNELD_HEALTHZ_PORT" => Some("".into()),
                _ => None,
            }
        };
        assert_eq!(
            norm_env(&["weft", "-etcd-prefix=/flag"], &env).unwrap(),
            v(&["weft", "run", "--etcd-prefix=/flag", "--iface=eth9", "--ip-masq"])
        );
        let bad = |k: &str| (k == "FLANNELD_IP_MASQ").then(|| OsString::from("sure"));
        let e = norm_env(&["weft", "run"], &bad).unwrap_err();
        assert!(e.contains("FLANNELD_IP_MASQ") && !e.contains("sure"), "{e}");
    }

    #[test]
    fn messages_never_show_a_password() {
        let e = norm(&["weft", "-etcd-password", "hunter2", "stray"]).unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
        let e = norm(&["weft", "-etcd-password=hunter2", "-ip-blackhole-route"]).unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn go_integers() {
        for (s, want) in [
            ("60", 60),
            ("-5", -5),
            ("0x3c", 60),
            ("0o17", 15),
            ("017", 15),
            ("0b11", 3),
            ("0x_3c", 60),
            ("+7", 7),
            ("1_000", 1000),
        ] {
            assert_eq!(go_int(s), Some(want), "{s}");
        }
        for s in ["", "0x", "_1", "1_", "0x__1", "08", "abc", "99999999999999999999"] {
            assert_eq!(go_int(s), None, "{s}");
        }
    }

    #[test]
    fn every_weft_flag_named_here_exists_as_a_flanneld_name_once() {
        let mut names: Vec<&str> = FLANNELD_FLAGS.iter().map(|f| f.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "a flanneld flag listed twice");
    }
}
