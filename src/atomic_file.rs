//! The one way weft writes and reads the files it owns: `subnet.env`, and `node-id`, `vtep-mac`
//! and `hook-pending` in the state dir.
//!
//! Contract:
//! - [`write`] never writes through a name another user could have prepared. The temp file is
//!   created next to the target under a fresh random name (`.<name>.<16 hex>.tmp`) with
//!   `O_CREAT|O_EXCL|O_NOFOLLOW`: a file or a symlink already at that name makes the attempt
//!   fail (and another name is tried), so a planted symlink never redirects the write. It is
//!   given its mode with `fchmod` (whatever the umask), written, fsynced, renamed over the
//!   target, and the directory is fsynced so the rename survives a crash. `rename` replaces a
//!   symlink at the target itself, it does not follow it. A reader sees the old file or the new
//!   one, never a mix; on failure the old file is untouched and the temp file removed.
//! - Modes: [`PUBLIC_MODE`] (0644) for `subnet.env`, as flannel; [`PRIVATE_MODE`] (0600) for
//!   state files; the state dir is created [`PRIVATE_DIR_MODE`] (0700) by [`create_dir`]. A
//!   directory that already exists keeps its mode: it is the operator's.
//! - [`read`] opens with `O_NOFOLLOW|O_NONBLOCK`: a symlink is refused ([`ReadError::Symlink`]),
//!   a FIFO does not block the open and, like any other non-regular file, is refused. Reads are
//!   bounded. It never panics.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// `subnet.env`'s mode (flannel's).
pub(crate) const PUBLIC_MODE: u32 = 0o644;
/// The mode of the files in the state dir.
pub(crate) const PRIVATE_MODE: u32 = 0o600;
/// The mode of a state dir weft creates.
pub(crate) const PRIVATE_DIR_MODE: u32 = 0o700;

/// How many temp names [`write`] tries before giving up.
const TEMP_ATTEMPTS: usize = 8;

/// A file operation failed; the message names the path.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct FileError {
    /// The file or directory the operation was on.
    pub(crate) path: PathBuf,
    /// The error.
    #[source]
    pub(crate) source: io::Error,
}

/// Why [`read`] could not read a file that exists.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Opening or reading failed.
    #[error(transparent)]
    Io(#[from] FileError),
    /// The path is a symlink, which is not followed.
    #[error("{}: is a symbolic link; not following it", path.display())]
    Symlink {
        /// The path.
        path: PathBuf,
    },
    /// The path is not a regular file (a directory, a FIFO, a device).
    #[error("{}: not a regular file", path.display())]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// The file is longer than the caller's limit.
    #[error("{}: larger than {limit} bytes", path.display())]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// The limit.
        limit: u64,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError { path: path.to_owned(), source }
}

/// Creates `dir` and its missing parents with `mode` (an existing directory is left as it is).
///
/// # Errors
/// [`FileError`] naming `dir`.
pub(crate) fn create_dir(dir: &Path, mode: u32) -> Result<(), FileError> {
    fs::DirBuilder::new().recursive(true).mode(mode).create(dir).map_err(io_error(dir))
}

/// Replaces `path` with `contents`, atomically and durably, as a file of `mode` (see the module
/// docs). The directory must exist.
///
/// # Errors
/// [`FileError`] naming the path that failed.
pub(crate) fn write(path: &Path, contents: &[u8], mode: u32) -> Result<(), FileError> {
    write_with(path, contents, mode, rand::random)
}

fn write_with(
    path: &Path,
    contents: &[u8],
    mode: u32,
    mut next_random: impl FnMut() -> u64,
) -> Result<(), FileError> {
    let name = path.file_name().ok_or_else(|| FileError {
        path: path.to_owned(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "not a file path"),
    })?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let (tmp, mut file) = create_temp(dir, name, mode, &mut next_random)?;
    let written = file
        .write_all(contents)
        .and_then(|()| file.set_permissions(fs::Permissions::from_mode(mode)))
        .and_then(|()| file.sync_all())
        .map_err(io_error(&tmp))
        .and_then(|()| fs::rename(&tmp, path).map_err(io_error(path)));
    drop(file);
    if let Err(e) = written {
        // Best effort: the error that matters is the one being returned.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir))
}

/// The temp name for `name` and a random value: starts with `.` so that tools globbing the
/// directory skip it.
fn temp_name(name: &std::ffi::OsStr, random: u64) -> OsString {
    let mut tmp = OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".{random:016x}.tmp"));
    tmp
}

fn create_temp(
    dir: &Path,
    name: &std::ffi::OsStr,
    mode: u32,
    next_random: &mut impl FnMut() -> u64,
) -> Result<(PathBuf, File), FileError> {
    let mut attempts = 1;
    loop {
        let tmp = dir.join(temp_name(name, next_random()));
        // create_new is O_CREAT|O_EXCL, which already fails on a symlink; O_NOFOLLOW says so.
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < TEMP_ATTEMPTS => {
                attempts += 1;
            }
            Err(e) => return Err(io_error(&tmp)(e)),
        }
    }
}

/// Reads `path`, at most `limit` bytes, without following a symlink. `Ok(None)` when there is
/// no such file (or no directory holding it).
///
/// # Errors
/// [`ReadError`].
pub(crate) fn read(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, ReadError> {
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
    let file = match opened {
        Ok(f) => f,
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {
            return Ok(None);
        }
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(ReadError::Symlink { path: path.to_owned() });
        }
        Err(e) => return Err(io_error(path)(e).into()),
    };
    if !file.metadata().map_err(io_error(path))?.is_file() {
        return Err(ReadError::NotRegular { path: path.to_owned() });
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io_error(path))?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge { path: path.to_owned(), limit });
    }
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn writes_with_the_given_mode_whatever_was_there() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("a/state");
        create_dir(&state, PRIVATE_DIR_MODE).unwrap();
        assert_eq!(mode(&state), 0o700);
        let path = state.join("node-id");
        write(&path, b"one\n", PRIVATE_MODE).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"one\n");
        assert_eq!(mode(&path), 0o600);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        write(&path, b"two\n", PRIVATE_MODE).unwrap();
        assert_eq!(mode(&path), 0o600);
        let public = tmp.path().join("subnet.env");
        write(&public, b"x", PUBLIC_MODE).unwrap();
        assert_eq!(mode(&public), 0o644);
        assert_eq!(names(&state), ["node-id"], "no temp files left behind");
    }

    #[test]
    fn a_symlink_at_the_target_is_replaced_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, outside) = (tmp.path().join("state"), tmp.path().join("outside"));
        create_dir(&dir, PRIVATE_DIR_MODE).unwrap();
        fs::write(&outside, b"precious").unwrap();
        let path = dir.join("node-id");
        symlink(&outside, &path).unwrap();
        assert!(matches!(read(&path, 64), Err(ReadError::Symlink { .. })));
        write(&path, b"mine", PRIVATE_MODE).unwrap();
        assert_eq!(fs::read(&outside).unwrap(), b"precious");
        assert!(fs::symlink_metadata(&path).unwrap().is_file());
        assert_eq!(read(&path, 64).unwrap().unwrap(), b"mine");
    }

    #[test]
    fn a_symlink_planted_at_the_temp_name_is_skipped_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, outside) = (tmp.path().join("state"), tmp.path().join("outside"));
        create_dir(&dir, PRIVATE_DIR_MODE).unwrap();
        fs::write(&outside, b"precious").unwrap();
        let path = dir.join("vtep-mac");
        // The old fixed name, and the name the first random value gives.
        symlink(&outside, dir.join(".vtep-mac.tmp")).unwrap();
        let planted = dir.join(temp_name("vtep-mac".as_ref(), 1));
        symlink(&outside, &planted).unwrap();
        // A dangling one too: O_CREAT alone would create its target outside the dir.
        let dangling = tmp.path().join("created-outside");
        symlink(&dangling, dir.join(temp_name("vtep-mac".as_ref(), 2))).unwrap();
        let mut values = [1, 2, 3].into_iter();
        write_with(&path, b"02:00:00:00:00:01", PRIVATE_MODE, || values.next().unwrap_or(4))
            .unwrap();
        assert_eq!(fs::read(&outside).unwrap(), b"precious");
        assert!(!dangling.exists());
        assert_eq!(fs::read(&path).unwrap(), b"02:00:00:00:00:01");
        assert_eq!(mode(&path), 0o600);

        // Every name taken: the write fails, naming the temp file, and changes nothing.
        let e = write_with(&path, b"x", PRIVATE_MODE, || 1).unwrap_err();
        assert_eq!(e.path, planted);
        assert_eq!(fs::read(&path).unwrap(), b"02:00:00:00:00:01");
        assert_eq!(fs::read(&outside).unwrap(), b"precious");
    }

    #[test]
    fn read_refuses_what_is_not_a_small_regular_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        assert!(read(&dir.join("none"), 8).unwrap().is_none());
        fs::write(dir.join("plain"), b"").unwrap();
        assert!(read(&dir.join("plain/below"), 8).unwrap().is_none());
        assert!(matches!(read(dir, 8), Err(ReadError::NotRegular { .. })));
        nix::unistd::mkfifo(&dir.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        assert!(matches!(read(&dir.join("fifo"), 8), Err(ReadError::NotRegular { .. })));
        fs::write(dir.join("big"), [b'x'; 9]).unwrap();
        let e = read(&dir.join("big"), 8).unwrap_err();
        assert!(e.to_string().contains("big: larger than 8 bytes"), "{e}");
        assert_eq!(read(&dir.join("plain"), 8).unwrap().unwrap(), b"");
    }

    #[test]
    fn write_failures_name_the_path_and_leave_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("subnet.env");
        fs::create_dir(&target).unwrap();
        let e = write(&target, b"x", PUBLIC_MODE).unwrap_err();
        assert_eq!(e.path, target);
        assert_eq!(names(tmp.path()), ["subnet.env"]);
        let e = write(&tmp.path().join("no/such/dir/f"), b"x", PUBLIC_MODE).unwrap_err();
        assert!(e.to_string().contains("no/such/dir"), "{e}");
    }
}
