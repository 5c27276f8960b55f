//! subnet.env: SubnetEnv::parse; a file that parses renders to text that parses to the same
//! value, and is valid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::lease::subnet_env::SubnetEnv;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(env) = SubnetEnv::parse(text) else { return };
    assert!(env.validate().is_ok(), "parse returned an invalid value: {env:?}");
    let rendered = env.render();
    assert_eq!(
        SubnetEnv::parse(&rendered).as_ref().ok(),
        Some(&env),
        "render round trip: {rendered}"
    );
});
