//! WireGuard keys as flannel and `wg` spell them: 32 bytes, written as standard base64 with
//! padding (44 characters, `wg genkey`/`wg pubkey`; flannel's lease attribute `PublicKey`).
//!
//! Pure: parsing never panics; a private or preshared key never appears in `Debug` output.

use std::fmt;
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use gotatun::x25519;

/// The length of every WireGuard key.
pub const KEY_LEN: usize = 32;

/// The length of a key in base64 (`wg`'s spelling): 44 characters, one `=` of padding.
const BASE64_LEN: usize = 44;

/// Why a key did not parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not 44 characters of standard base64 (with its `=`) decoding to 32 bytes.
    #[error("not a WireGuard key (expected 44 characters of base64 decoding to 32 bytes)")]
    Malformed,
    /// The operating system's random source failed.
    #[error("the system's random source failed")]
    Random,
}

/// Decodes `wg`'s spelling of a key: standard base64, padded, canonical (no stray bits in the
/// last character), surrounding whitespace trimmed (a key file ends in a newline).
fn decode(text: &str) -> Result<[u8; KEY_LEN], KeyError> {
    let text = text.trim();
    if text.len() != BASE64_LEN {
        return Err(KeyError::Malformed);
    }
    let mut key = [0u8; KEY_LEN];
    // 44 characters decode to at most 33 bytes; base64 wants room for them.
    let mut buf = [0u8; KEY_LEN + 1];
    match STANDARD.decode_slice(text, &mut buf) {
        Ok(KEY_LEN) => {
            key.copy_from_slice(&buf[..KEY_LEN]);
            Ok(key)
        }
        _ => Err(KeyError::Malformed),
    }
}

fn encode(key: &[u8; KEY_LEN]) -> String {
    STANDARD.encode(key)
}

/// A peer's (or our) static public key: what a lease publishes and sessions are keyed by.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; KEY_LEN]);

impl PublicKey {
    /// The key as gotatun takes it.
    pub(super) fn x25519(self) -> x25519::PublicKey {
        x25519::PublicKey::from(self.0)
    }
}

impl FromStr for PublicKey {
    type Err = KeyError;

    /// `wg pubkey`'s output (flannel's `PublicKey` lease attribute).
    fn from_str(text: &str) -> Result<Self, KeyError> {
        decode(text).map(Self)
    }
}

impl fmt::Display for PublicKey {
    /// Standard base64, as `wg pubkey` writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&encode(&self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

/// Our static private key. Its bytes leave only through [`PrivateKey::to_base64`] (to be
/// saved, as `wg genkey` writes one); `Debug` shows the public key only.
#[derive(Clone)]
pub struct PrivateKey(x25519::StaticSecret);

impl PrivateKey {
    /// A new random key from the operating system's random source, clamped as `wg genkey`
    /// clamps it (so its base64 is what `wg` would write for it).
    ///
    /// # Errors
    /// [`KeyError::Random`] if the random source fails.
    pub fn generate() -> Result<Self, KeyError> {
        use rand::TryRngCore;
        let mut bytes = [0u8; KEY_LEN];
        rand::rngs::OsRng.try_fill_bytes(&mut bytes).map_err(|_| KeyError::Random)?;
        Ok(Self::from_bytes(clamp(bytes)))
    }

    /// The key of these bytes (as they are: X25519 clamps them when it uses them).
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(x25519::StaticSecret::from(bytes))
    }

    /// The public key that goes with it.
    pub fn public_key(&self) -> PublicKey {
        PublicKey(x25519::PublicKey::from(&self.0).to_bytes())
    }

    /// Standard base64, as `wg genkey` writes it: for saving the key, never for logs.
    pub fn to_base64(&self) -> String {
        encode(self.0.as_bytes())
    }

    /// The key as gotatun takes it.
    pub(super) fn x25519(&self) -> x25519::StaticSecret {
        self.0.clone()
    }
}

/// `wg genkey`'s clamping (curve25519's): clear the low three bits and the top bit, set bit 254.
fn clamp(mut bytes: [u8; KEY_LEN]) -> [u8; KEY_LEN] {
    bytes[0] &= 248;
    bytes[31] &= 127;
    bytes[31] |= 64;
    bytes
}

impl FromStr for PrivateKey {
    type Err = KeyError;

    /// `wg genkey`'s output.
    fn from_str(text: &str) -> Result<Self, KeyError> {
        decode(text).map(Self::from_bytes)
    }
}

impl fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrivateKey(public {})", self.public_key())
    }
}

/// An optional symmetric key mixed into every handshake (`wg genpsk`; flannel's `PSK`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PresharedKey(pub [u8; KEY_LEN]);

impl FromStr for PresharedKey {
    type Err = KeyError;

    /// `wg genpsk`'s output.
    fn from_str(text: &str) -> Result<Self, KeyError> {
        decode(text).map(Self)
    }
}

impl fmt::Debug for PresharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PresharedKey(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7748 section 6.1's Alice key pair in `wg`'s spelling (base64 of the RFC's hex).
    const PRIVATE: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
    const PUBLIC: &str = "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=";

    #[test]
    fn public_key_derives_as_rfc_7748_says_and_round_trips_through_base64() {
        let private: PrivateKey = PRIVATE.parse().unwrap();
        // RFC 7748 6.1: Alice's public key.
        let rfc = "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a";
        let hex: String = private.public_key().0.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, rfc);
        assert_eq!(private.public_key().to_string(), PUBLIC);
        assert_eq!(PUBLIC.parse::<PublicKey>().unwrap(), private.public_key());
        assert_eq!(private.to_base64(), PRIVATE);
        // A key file's newline is fine.
        assert_eq!(format!("{PUBLIC}\n").parse::<PublicKey>().unwrap(), private.public_key());
    }

    #[test]
    fn generated_keys_are_clamped_distinct_and_never_printed() {
        let a = PrivateKey::generate().unwrap();
        let b = PrivateKey::generate().unwrap();
        assert_ne!(a.public_key(), b.public_key());
        let bytes = a.0.to_bytes();
        assert_eq!((bytes[0] & 7, bytes[31] & 0xc0), (0, 0x40));
        let again: PrivateKey = a.to_base64().parse().unwrap();
        assert_eq!(again.public_key(), a.public_key());
        assert!(!format!("{a:?}").contains(&a.to_base64()));
        let psk = PresharedKey([7; 32]);
        assert_eq!(format!("{psk:?}"), "PresharedKey(..)");
    }

    #[test]
    fn anything_but_a_canonical_44_character_key_is_refused() {
        let bad = [
            "",
            "=",
            &PUBLIC[..43],
            &format!("{PUBLIC}A"),
            // 33 bytes' worth, no padding.
            "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmoA",
            // URL-safe alphabet.
            "hSDwCYkwp1R0i33ctD73Wg2_Og0mOBr066SpjqqbTmo=",
            // Stray bits in the last character (o -> p).
            "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmp=",
            "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTm==",
            "ÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿÿ",
            "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066Spjqqb Tmo=",
        ];
        for text in bad {
            assert_eq!(text.parse::<PublicKey>(), Err(KeyError::Malformed), "{text:?}");
            assert!(text.parse::<PrivateKey>().is_err());
            assert!(text.parse::<PresharedKey>().is_err());
        }
    }
}
