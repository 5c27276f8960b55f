//! Secrets given in files (`--etcd-password-file`), and [`Secret`], a string whose `Debug`
//! never shows it.
//!
//! Why files: a flag's value is in `/proc/<pid>/cmdline`, which every local user can read
//! (`ps -ef`); an environment variable is in `/proc/<pid>/environ`, readable by the process's
//! own user and root only; a file is readable by whom its mode and directories say.
//!
//! Contract of [`read`]:
//! - The file is opened as named, symlinks followed (Kubernetes mounts a secret's keys as
//!   symlinks), with `O_NONBLOCK` so a FIFO does not block the start; anything but a regular
//!   file is refused, as is one larger than [`MAX_LEN`] bytes.
//! - The secret is the file's text with one trailing newline (`\n` or `\r\n`) dropped; any
//!   other byte is part of it. An empty secret and text that is not UTF-8 are refused.
//! - A file whose mode lets its group or others read it is used, and reported
//!   ([`SecretFile::readable_by_others`]) for the caller to warn about, as ssh warns about
//!   a private key: Kubernetes' default secret mode is 0644 in a directory only the pod
//!   reaches, so refusing would break the common deployment.
//! - Errors name the path and never the content. Never panics.

#![forbid(unsafe_code)]

use std::fmt;
use std::fs::OpenOptions;
use std::io::{self, Read as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The largest secret file read: a password is a few dozen bytes.
pub const MAX_LEN: u64 = 4096;

/// A secret string: its `Debug` and `Display` show `<redacted>`, so no log line, panic
/// message or error shows it by accident. [`Secret::expose`] gives the text.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret of `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The secret text, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

/// A secret read from a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretFile {
    /// The secret.
    pub secret: Secret,
    /// `Some(mode)` (the permission bits) when the file's group or others may read it.
    pub readable_by_others: Option<u32>,
}

/// Why a secret file was refused. Names the path, never the content.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// Opening or reading failed. (The error is in the message, not a `source`: the message
    /// is whole however it is shown.)
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// Not a regular file (a directory, a FIFO, a device).
    #[error("{}: not a regular file", path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
    },
    /// Larger than [`MAX_LEN`].
    #[error("{}: larger than {MAX_LEN} bytes; is this the right file?", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// Empty, or only a newline.
    #[error("{}: empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// Not UTF-8 text.
    #[error("{}: not UTF-8 text", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
}

/// Reads the secret in `path` (see the module docs).
///
/// # Errors
/// [`SecretFileError`], naming `path`.
pub fn read(path: &Path) -> Result<SecretFile, SecretFileError> {
    let io = |error| SecretFileError::Io { path: path.to_owned(), error };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io)?;
    // The opened file's own metadata: what is read is what was checked.
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(SecretFileError::NotRegular { path: path.to_owned() });
    }
    if meta.len() > MAX_LEN {
        return Err(SecretFileError::TooLarge { path: path.to_owned() });
    }
    let mut bytes = Vec::new();
    // One byte more than allowed: a file that grew since is still caught.
    file.take(MAX_LEN + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_LEN {
        return Err(SecretFileError::TooLarge { path: path.to_owned() });
    }
    let text = match bytes.strip_suffix(b"\n") {
        Some(line) => line.strip_suffix(b"\r").unwrap_or(line),
        None => &bytes[..],
    };
    if text.is_empty() {
        return Err(SecretFileError::Empty { path: path.to_owned() });
    }
    let text = std::str::from_utf8(text)
        .map_err(|_| SecretFileError::NotUtf8 { path: path.to_owned() })?;
    let mode = meta.mode() & 0o7777;
    Ok(SecretFile {
        secret: Secret::new(text),
        readable_by_others: (mode & 0o044 != 0).then_some(mode),
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn file_of(dir: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        let path = dir.join("secret");
        // A new file each time: the last one may be read-only (0o400), which only root could
        // write again, and the default `cargo test` runs unprivileged.
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => panic!("{e}"),
            _ => {}
        }
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn one_trailing_newline_is_dropped_and_every_other_byte_kept() {
        let dir = tempfile::tempdir().unwrap();
        for (bytes, want) in [
            (&b"hunter2\n"[..], "hunter2"),
            (b"hunter2", "hunter2"),
            (b"hunter2\r\n", "hunter2"),
            (b"hunter2\n\n", "hunter2\n"),
            (b" two words \n", " two words "),
            (b"p\xc3\xa4ss", "p\u{e4}ss"),
        ] {
            let got = read(&file_of(dir.path(), bytes, 0o600)).unwrap();
            assert_eq!(got.secret.expose(), want, "{bytes:?}");
            assert_eq!(got.readable_by_others, None);
        }
    }

    #[test]
    fn a_file_group_or_others_may_read_is_reported_with_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        for (mode, reported) in
            [(0o600, false), (0o400, false), (0o640, true), (0o604, true), (0o644, true)]
        {
            let got = read(&file_of(dir.path(), b"hunter2\n", mode)).unwrap();
            assert_eq!(got.readable_by_others, reported.then_some(mode), "{mode:o}");
            assert_eq!(got.secret.expose(), "hunter2");
        }
    }

    #[test]
    fn empty_large_binary_missing_and_odd_files_are_refused_naming_the_path_only() {
        let dir = tempfile::tempdir().unwrap();
        let secret = b"hunter2-".repeat(600);
        let cases: [(&[u8], &str); 5] = [
            (b"", "empty"),
            (b"\n", "empty"),
            (b"\r\n", "empty"),
            (&secret, "larger than 4096 bytes"),
            (b"hunter2\xff", "not UTF-8"),
        ];
        for (bytes, want) in cases {
            let path = file_of(dir.path(), bytes, 0o600);
            let err = read(&path).unwrap_err().to_string();
            assert!(err.starts_with(&path.display().to_string()) && err.contains(want), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
        // Exactly the limit is read.
        let path = file_of(dir.path(), &b"x".repeat(MAX_LEN as usize), 0o600);
        assert_eq!(read(&path).unwrap().secret.expose().len(), MAX_LEN as usize);
        let missing = dir.path().join("missing");
        let err = read(&missing).unwrap_err().to_string();
        assert!(err.contains("missing") && err.contains("No such file"), "{err}");
        let err = read(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        // A FIFO is refused without waiting for a writer.
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let err = read(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn a_symlink_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = file_of(dir.path(), b"hunter2\n", 0o600);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(read(&link).unwrap().secret.expose(), "hunter2");
    }

    #[test]
    fn a_secret_never_shows_in_debug_or_display() {
        let s: Secret = "hunter2".parse().unwrap();
        let file = SecretFile { secret: s.clone(), readable_by_others: None };
        for text in
            [format!("{s:?}"), format!("{s}"), format!("{file:?}"), format!("{:?}", Some(&s))]
        {
            assert!(!text.contains("hunter2") && text.contains("<redacted>"), "{text}");
        }
        assert_eq!(s.expose(), "hunter2");
    }
}
