//! This node's WireGuard private key: made once, kept in a file, never shown.
//!
//! - Where: `$WIREGUARD_KEY_FILE` when set (flannel's variable, so a node moved from flanneld
//!   keeps its key and its peers' configuration stays right), else `<state-dir>/wireguard-key`.
//!   flannel's default, `/run/flannel/wgkey`, is on a tmpfs and so a new key on every boot;
//!   weft's state dir survives a reboot, as a node's identity should.
//! - Made when the file is missing: 32 bytes from the operating system's generator, written as
//!   `wg genkey` writes a key (base64 and a newline), mode 0600 in a 0700 directory, atomically.
//! - Read with [`crate::secret_file::read`] (symlinks followed for a Kubernetes secret; a file
//!   its group or others may read is used and warned about). A file that is there but holds no
//!   key is an error naming the path: replacing it would change the node's key behind its
//!   operator's back (flannel refuses it too).
//! - The key never reaches a log, an error, the store, an annotation or a hook's environment:
//!   [`WgSecret`] does not print, and only the public key ([`public_key`]) is told.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use rand::TryRngCore as _;
use tracing::{info, warn};

use crate::atomic_file;
use crate::secret_file;
use crate::vocab::{WG_KEY_LEN, WgSecret};

/// The key file's name in the state dir.
const KEY_FILE: &str = "wireguard-key";

/// The key file: `override_path` (`--wireguard-key-file`, `$WIREGUARD_KEY_FILE`) or the
/// state dir's.
pub(crate) fn key_path(state_dir: &Path, override_path: Option<&Path>) -> PathBuf {
    override_path.map_or_else(|| state_dir.join(KEY_FILE), Path::to_owned)
}

pub(crate) use crate::dataplane::transport::wireguard::public_key;

/// Reads this node's private key from `path`, or makes one there if the file is missing.
///
/// # Errors
/// The file cannot be read or written, or holds no key; the error names the path, never the
/// content.
pub(crate) fn load_or_create(path: &Path) -> anyhow::Result<WgSecret> {
    match secret_file::read(path) {
        Ok(file) => {
            if let Some(mode) = file.readable_by_others {
                warn!(path = %path.display(), mode = format!("{mode:o}"), "the WireGuard private key file may be read by its group or others");
            }
            let key = WgSecret::parse(file.secret.expose().trim()).map_err(|_| {
                anyhow::anyhow!(
                    "{}: not a WireGuard private key (base64, as `wg genkey` writes); weft will \
                     not replace it: fix or delete the file",
                    path.display()
                )
            })?;
            info!(path = %path.display(), public_key = %public_key(&key), "WireGuard key");
            Ok(key)
        }
        Err(secret_file::SecretFileError::Io { error, .. })
            if error.kind() == std::io::ErrorKind::NotFound =>
        {
            let key = generate()?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                atomic_file::create_dir(dir, atomic_file::PRIVATE_DIR_MODE)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let text = format!("{}\n", key.expose_text());
            atomic_file::write(path, text.as_bytes(), atomic_file::PRIVATE_MODE)
                .with_context(|| format!("writing the WireGuard key to {}", path.display()))?;
            info!(path = %path.display(), public_key = %public_key(&key), "generated a WireGuard key");
            Ok(key)
        }
        Err(e) => bail!("reading the WireGuard private key: {e}"),
    }
}

/// A new private key from the operating system's generator (`getrandom`, as `wg genkey`).
fn generate() -> anyhow::Result<WgSecret> {
    let mut bytes = [0u8; WG_KEY_LEN];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .context("asking the operating system for random bytes for a WireGuard key")?;
    // Clamped as Curve25519 wants it, which is what `wg genkey` writes (the public key is the
    // same either way: x25519 clamps again).
    bytes[0] &= 248;
    bytes[31] = (bytes[31] & 127) | 64;
    Ok(WgSecret::from_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// `wg pubkey` of this private key (RFC 7748's Alice).
    const PRIVATE: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
    const PUBLIC: &str = "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=";

    #[test]
    fn a_missing_key_is_made_once_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = key_path(&dir.path().join("state"), None);
        let key = load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode =
            std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, format!("{}\n", key.expose_text()));
        // The next start reads it back, the same key.
        assert_eq!(load_or_create(&path).unwrap(), key);
        // And a second node gets another.
        let other = load_or_create(&dir.path().join("other")).unwrap();
        assert_ne!(other, key);
    }

    #[test]
    fn a_key_file_given_by_flannels_variable_is_read_as_wg_writes_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wgkey");
        std::fs::write(&path, format!("{PRIVATE}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        let chosen = key_path(Path::new("/nonexistent"), Some(&path));
        let key = load_or_create(&chosen).unwrap();
        assert_eq!(public_key(&key).to_string(), PUBLIC);
    }

    #[test]
    fn a_file_without_a_key_is_refused_naming_the_path_and_never_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wgkey");
        let content = "c2VjcmV0LXRoYXQtaXMtbm90LWEta2V5";
        std::fs::write(&path, content).unwrap();
        let e = format!("{:#}", load_or_create(&path).unwrap_err());
        assert!(e.contains(&path.display().to_string()) && !e.contains(content), "{e}");
        // Left as it was.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), content);
    }
}
