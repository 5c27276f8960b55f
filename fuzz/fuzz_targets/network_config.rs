//! NetworkConfig::parse: a config that parses writes (to_json) a config that parses to itself;
//! its subnet ranges, IPv4 and (with `"EnableIPv6": true`) IPv6, are consistent.
#![no_main]

use std::net::Ipv6Addr;

use ipnet::Ipv6Net;
use libfuzzer_sys::fuzz_target;
use weft::config::NetworkConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(cfg) = NetworkConfig::parse(data) else { return };
    let json = cfg.to_json();
    let again = NetworkConfig::parse(json.as_bytes()).expect("to_json parses back");
    assert_eq!(again, cfg, "config round trip through {json}");
    let count = cfg.subnet_count();
    let first: Vec<_> = cfg.subnets().take(3).collect();
    assert_eq!(first.len() as u128, count.min(3));
    for s in first {
        assert!(cfg.fits(s), "{s} listed but does not fit");
        assert!(cfg.check_lease(s).is_ok());
        // The family that leases: IPv4 whenever there is an IPv4 part.
        assert_eq!(s.v4().is_some(), cfg.leases_ipv4(), "{s}");
    }
    let _ = cfg.backend.encap_overhead();

    let Some(v6) = cfg.ipv6 else { return };
    let (prefix, len) = (v6.network.prefix_len(), v6.subnet_len);
    assert_eq!(v6.network, v6.network.trunc(), "IPv6Network has host bits");
    assert!((1..=124).contains(&prefix), "IPv6Network {}", v6.network);
    assert!((prefix + 2..=126).contains(&len), "IPv6SubnetLen {len} for {}", v6.network);
    let (lo, hi) = (u128::from(v6.subnet_min()), u128::from(v6.subnet_max()));
    assert!(lo <= hi, "IPv6SubnetMin above IPv6SubnetMax in {json}");
    let size = 1u128 << (128 - u32::from(len));
    assert_eq!(v6.subnet_count(), (hi - lo) / size + 1, "{json}");
    let at = |a: u128| Ipv6Net::new(Ipv6Addr::from(a), len).expect("len <= 126");
    assert!(v6.fits(at(lo)) && v6.fits(at(hi)), "the range's ends do not fit in {json}");
    assert!(!v6.fits(at(lo + 1)), "a subnet with host bits fits in {json}");
    if let Some(below) = lo.checked_sub(size) {
        assert!(!v6.fits(at(below)), "{} below the range fits in {json}", at(below));
    }
    if let Some(above) = hi.checked_add(size) {
        assert!(!v6.fits(at(above)), "{} above the range fits in {json}", at(above));
    }
});
