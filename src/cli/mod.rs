//! What the `weft` command line does before the daemon starts: read a flanneld command line
//! as flanneld reads it ([`flanneld_args`]), and choose the underlay interface among the
//! candidates flanneld's `--iface`, `--iface-regex` and `--iface-can-reach` give ([`iface`]).
//! The command's flags themselves are defined in `src/main.rs`.

pub mod flanneld_args;
pub mod iface;
