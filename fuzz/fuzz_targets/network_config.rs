//! NetworkConfig::parse: a config that parses writes (to_json) a config that parses to itself;
//! its subnet range is consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::config::NetworkConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(cfg) = NetworkConfig::parse(data) else { return };
    let json = cfg.to_json();
    let again = NetworkConfig::parse(json.as_bytes()).expect("to_json parses back");
    assert_eq!(again, cfg, "config round trip through {json}");
    let count = cfg.subnet_count();
    let first: Vec<_> = cfg.subnets().take(3).collect();
    assert_eq!(first.len() as u64, count.min(3));
    for s in first {
        assert!(cfg.fits(s), "{s} listed but does not fit");
        assert!(cfg.check_lease(s).is_ok());
    }
    let _ = cfg.backend.encap_overhead();
});
