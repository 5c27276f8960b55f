//! /proc/net/route as drift repair reads it: link::device_routes never panics, and every route
//! it returns was on a line naming the device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::link::device_routes;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let routes = device_routes(text, "weft0");
    let lines = text.lines().filter(|l| l.split_whitespace().next() == Some("weft0")).count();
    assert!(routes.len() <= lines, "{} routes from {lines} lines naming weft0", routes.len());
});
