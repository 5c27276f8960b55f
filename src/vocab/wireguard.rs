//! WireGuard keys as flannel and `wg` write them: 32 bytes in standard base64 with padding
//! (44 characters, e.g. `"xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="`).
//!
//! - [`WgPublicKey`]: a peer's or our own public key. It is public (leases carry it), so it
//!   prints as its base64 text.
//! - [`WgSecret`]: a private key or a preshared key. It never prints: `Debug` shows
//!   `WgSecret(..)` and there is no `Display`, so a config or a key logged by mistake shows no
//!   secret. The bytes are read only through [`WgSecret::expose`], whose callers are the key file
//!   and the WireGuard sessions.
//!
//! Parsing never panics: anything but 44 characters of base64 decoding to 32 bytes is a
//! [`WgKeyError`].

#![forbid(unsafe_code)]

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// The length of a WireGuard key (Curve25519 keys and the preshared key alike).
pub const WG_KEY_LEN: usize = 32;

/// Why a key's text is not a WireGuard key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WgKeyError {
    /// Not standard base64 of exactly 32 bytes.
    #[error("not a WireGuard key (32 bytes in standard base64, 44 characters ending in '=')")]
    NotAKey,
}

fn decode(text: &str) -> Result<[u8; WG_KEY_LEN], WgKeyError> {
    // 32 bytes are 44 base64 characters; checking first bounds the decoder's work on hostile
    // input (a lease or a config anyone with store access writes).
    if text.len() != 44 {
        return Err(WgKeyError::NotAKey);
    }
    let bytes = STANDARD.decode(text).map_err(|_| WgKeyError::NotAKey)?;
    bytes.try_into().map_err(|_| WgKeyError::NotAKey)
}

/// A WireGuard public key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WgPublicKey(pub [u8; WG_KEY_LEN]);

impl WgPublicKey {
    /// Parses the base64 text flannel writes in a lease's `BackendData.PublicKey`.
    ///
    /// # Errors
    /// [`WgKeyError::NotAKey`].
    pub fn parse(text: &str) -> Result<Self, WgKeyError> {
        decode(text).map(Self)
    }
}

impl fmt::Display for WgPublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&STANDARD.encode(self.0))
    }
}

impl fmt::Debug for WgPublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgPublicKey({self})")
    }
}

/// A WireGuard secret: a private key or a preshared key (`Backend.PSK`). Never printed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgSecret([u8; WG_KEY_LEN]);

impl WgSecret {
    /// Parses base64 key text (the key file, `Backend.PSK`).
    ///
    /// # Errors
    /// [`WgKeyError::NotAKey`]; the error never contains the text.
    pub fn parse(text: &str) -> Result<Self, WgKeyError> {
        decode(text).map(Self)
    }

    /// A secret from its bytes.
    pub fn from_bytes(bytes: [u8; WG_KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// The bytes, for the key file and the sessions alone.
    pub fn expose(&self) -> &[u8; WG_KEY_LEN] {
        &self.0
    }

    /// The base64 text, for the key file alone (as `wg genkey` writes it).
    pub fn expose_text(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl fmt::Debug for WgSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WgSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";

    #[test]
    fn a_key_round_trips_through_its_base64_text() {
        let k = WgPublicKey::parse(KEY).unwrap();
        assert_eq!(k.to_string(), KEY);
        assert_eq!(format!("{k:?}"), format!("WgPublicKey({KEY})"));
        assert_eq!(WgSecret::parse(KEY).unwrap().expose_text(), KEY);
    }

    #[test]
    fn anything_but_32_bytes_of_standard_base64_is_refused() {
        for bad in [
            "",
            "AAAA",
            &KEY[..43],
            &format!("{KEY}="),
            // URL-safe alphabet, and 33 bytes' worth of text.
            "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg_",
            "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg",
            "ééééééééééééééééééééééé",
            "!TIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=",
        ] {
            assert_eq!(WgPublicKey::parse(bad), Err(WgKeyError::NotAKey), "{bad:?}");
            assert!(WgSecret::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_secret_never_prints() {
        let s = WgSecret::parse(KEY).unwrap();
        let shown = format!("{s:?} {:?}", Some(s));
        assert!(!shown.contains(&KEY[..8]), "{shown}");
        assert_eq!(format!("{s:?}"), "WgSecret(..)");
    }
}
