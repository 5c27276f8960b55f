//! virtio_net::Header: parse then emit gives back the same 10 bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::dataplane::wire::{Error, virtio_net};

fuzz_target!(|data: &[u8]| {
    let h = match virtio_net::Header::parse(data) {
        Ok(h) => h,
        Err(e) => {
            assert!(data.len() < virtio_net::LEN && e == Error::Truncated);
            return;
        }
    };
    let _ = (h.gso_kind(), h.needs_csum());
    assert_eq!(h.gso_kind() & virtio_net::GSO_ECN, 0);
    let mut out = [0u8; virtio_net::LEN];
    assert_eq!(h.emit(&mut out), Ok(virtio_net::LEN));
    assert_eq!(&out[..], &data[..virtio_net::LEN]);
    assert_eq!(virtio_net::Header::parse(&out), Ok(h));
    let mut small = [0u8; virtio_net::LEN - 1];
    assert_eq!(h.emit(&mut small), Err(Error::BufferTooSmall));
});
