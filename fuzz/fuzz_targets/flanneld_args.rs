//! A command line (argv as NUL-separated bytes; the first byte picks which environment
//! variables are set, their values taken from the arguments): `normalize` never panics; a
//! command line it rewrites starts with `run` (or is `--version`); read again, its own output
//! comes back unchanged; any other command line is returned as it came.
#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use libfuzzer_sys::fuzz_target;
use weft::cli::flanneld_args::{Becomes, FLANNELD_FLAGS, Kind, WeftFlag, normalize};

/// weft run's flags as far as the normalizer cares: every flag a flanneld one becomes, and a
/// few of weft's own.
fn weft_flags() -> Vec<WeftFlag<'static>> {
    let mut flags: Vec<WeftFlag<'static>> = FLANNELD_FLAGS
        .iter()
        .filter_map(|f| match f.becomes {
            Becomes::Weft(long) => Some(WeftFlag { long, takes_value: f.kind != Kind::Bool }),
            _ => None,
        })
        .collect();
    flags.extend([
        WeftFlag { long: "tun-name", takes_value: true },
        WeftFlag { long: "relinquish-on-exit", takes_value: false },
        WeftFlag { long: "subnet-lease-ttl", takes_value: true },
    ]);
    flags
}

const VARS: &[&str] =
    &["FLANNELD_IFACE", "FLANNELD_IP_MASQ", "FLANNELD_ETCD_PREFIX", "WEFT_IFACE", "FLANNELD_V"];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let mut args: Vec<OsString> = vec!["weft".into()];
    args.extend(rest.split(|b| *b == 0).map(|a| OsString::from_vec(a.to_vec())));
    let values = args.clone();
    let env = move |k: &str| -> Option<OsString> {
        let i = VARS.iter().position(|v| *v == k)?;
        (pick & (1 << i) != 0).then(|| values.get(i + 1).cloned().unwrap_or_default())
    };
    let weft = weft_flags();
    let Ok(n) = normalize(args.clone(), &weft, &env) else { return };
    assert_eq!(n.args[0], "weft");
    let rewritten = args.get(1).and_then(|a| a.to_str()).is_some_and(|a| {
        a == "run"
            || (a.starts_with('-') && !["-h", "--help", "-V", "--version", "--"].contains(&a))
    });
    if rewritten {
        assert!(n.args[1] == "run" || n.args[1..] == ["--version"], "{:?}", n.args);
        // Its own output, read again without the environment, is what it is.
        let again = normalize(n.args.clone(), &weft, &|_| None).expect("output read again");
        assert_eq!(again.args, n.args);
    } else {
        assert_eq!(n.args, args);
    }
});
