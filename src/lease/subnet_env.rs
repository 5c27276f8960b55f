//! shim
#![allow(missing_docs)]
use std::path::Path;
use crate::lease::record::Subnet;
pub struct SubnetEnv { pub network: ipnet::Ipv4Net, pub subnet: Subnet, pub mtu: u32, pub ipmasq: bool }
#[derive(Debug, thiserror::Error)] #[error("x")] pub struct SubnetEnvError;
pub fn write_atomic(_path: &Path, _env: &SubnetEnv) -> Result<(), SubnetEnvError> { Ok(()) }
pub fn read(_path: &Path) -> ReadOutcome { ReadOutcome::Missing }
pub enum ReadOutcome { Missing, Valid(SubnetEnv), Corrupt(SubnetEnvError) }
