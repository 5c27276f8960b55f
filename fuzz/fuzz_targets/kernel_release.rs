//! A kernel release (`/proc/sys/kernel/osrelease`): KernelVersion::parse never panics; a
//! version it reads is what the text starts with, and every offload decision on it is one the
//! table explains (off on a known bug's kernel, or on with its workaround).
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::offload::kernel_bugs::{KernelVersion, Offload, OffloadMode, decide};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some(v) = KernelVersion::parse(text) else { return };
    let rest = text.strip_prefix(&format!("{}.{}", v.0, v.1)).or_else(|| {
        // Leading zeros ("07.1") read as the number they spell.
        let (major, minor) = text.split_once('.')?;
        let minor_digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
        (major.parse::<u32>().ok()? == v.0 && minor_digits.parse::<u32>().ok()? == v.1)
            .then_some("")
    });
    assert!(rest.is_some(), "{text:?} read as {v}");
    for offload in Offload::ALL {
        let d = decide(Some(v), offload, OffloadMode::Auto);
        // Off on a known bug's kernel, unless weft has a workaround for it; on otherwise.
        let avoidable = d.bug.is_some_and(|b| b.workaround.is_some());
        assert_eq!(d.enabled, d.bug.is_none() || avoidable, "{text:?}: {d:?}");
        assert_eq!(d.workaround, avoidable, "{text:?}: {d:?}");
        assert!(d.bug.is_none_or(|b| b.from <= v && v < b.fixed && b.offload == offload));
    }
});
