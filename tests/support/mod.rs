//! Shared test support. Each integration test binary compiles this module on its own and uses
//! a different part of it, so unused items are expected.
#![allow(dead_code)]

pub mod etcd;
pub mod netns;
pub mod weft;
