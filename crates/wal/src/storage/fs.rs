//! The real file system: positional reads and writes, `fdatasync`, directory `fsync`, and
//! an `flock`-style lock file.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{OpenMode, Storage, StorageFile};

/// The operating system's file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct FsStorage;

/// The mode of every file created here, before the process's umask: the owner reads and
/// writes, its group reads (an operator's group running the log tools, as the systemd
/// unit's `UMask=0027` means it), others nothing. The log holds every event's payload
/// and forwarded headers, the state database the endpoints' secrets: a daemon started
/// by hand under the common umask of 022 must not leave them readable by every user.
pub const FILE_MODE: u32 = 0o640;

/// [`FILE_MODE`] for the directories created here (the group may list them).
pub const DIR_MODE: u32 = 0o750;

#[derive(Debug)]
struct FsFile(File);

impl Storage for FsStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut created = Vec::new();
        create_missing(dir, &mut created)?;
        Ok(created)
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else { continue };
            if entry.file_type()?.is_file() {
                names.push(name);
            } else if crate::format::parse_segment_file_name(&name).is_some() {
                // Left out, a segment moved elsewhere behind a symbolic link would be
                // taken for missing: a log that starts later, or (the tail) a log whose
                // newest records are passed over and their offsets given again.
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} is named as a segment of the log but is not a regular file (a symbolic link, or a directory): a log's segments must be files of its own directory",
                        dir.join(&name).display()
                    ),
                ));
            }
        }
        Ok(names)
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn StorageFile>> {
        let mut o = OpenOptions::new();
        match mode {
            OpenMode::Read => o.read(true),
            OpenMode::ReadWrite => o.read(true).write(true),
            OpenMode::CreateNew => o.read(true).write(true).create_new(true).mode(FILE_MODE),
        };
        Ok(Arc::new(FsFile(o.open(path)?)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn try_lock(&self, path: &Path) -> io::Result<Box<dyn Send + Sync>> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(FILE_MODE).open(path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(io::Error::from(io::ErrorKind::WouldBlock)),
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
        // The `flock` excludes other writers (as every earlier build did); an
        // open-file-description lock on the same file beside it is what `is_locked` can
        // test without taking anything.
        ofd::set_write_lock(&file)?;
        Ok(Box::new(file))
    }

    fn is_locked(&self, path: &Path) -> io::Result<bool> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        ofd::is_write_locked(&file)
    }
}

/// Creates `dir` after its missing parents, as `std::fs::create_dir_all` does, and notes
/// each directory it created, outermost first.
fn create_missing(dir: &Path, created: &mut Vec<PathBuf>) -> io::Result<()> {
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        create_missing(parent, created)?;
    }
    match std::fs::DirBuilder::new().mode(DIR_MODE).create(dir) {
        Ok(()) => {
            created.push(dir.to_path_buf());
            Ok(())
        }
        // Another process created it meanwhile.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Open-file-description locks (`F_OFD_SETLK`, `F_OFD_GETLK`): owned by the open file,
/// released when it closes, and testable without being taken (`F_OFD_GETLK`).
#[cfg(target_os = "linux")]
mod ofd {
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;

    fn whole_file(kind: libc::c_short) -> libc::flock {
        // SAFETY: `flock` is a plain C struct; all-zero is a valid value of it.
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = kind;
        l.l_whence = libc::SEEK_SET as libc::c_short;
        l.l_start = 0;
        l.l_len = 0;
        l.l_pid = 0;
        l
    }

    pub(super) fn set_write_lock(file: &File) -> io::Result<()> {
        let mut l = whole_file(libc::F_WRLCK as libc::c_short);
        // SAFETY: a valid open descriptor and a pointer to an initialised `flock`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut l) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Err(io::Error::from(io::ErrorKind::WouldBlock)),
            _ => Err(e),
        }
    }

    pub(super) fn is_write_locked(file: &File) -> io::Result<bool> {
        // "Could a read lock be taken?" conflicts exactly with a held write lock, and is
        // allowed on a descriptor opened read-only.
        let mut l = whole_file(libc::F_RDLCK as libc::c_short);
        // SAFETY: as above; F_OFD_GETLK only fills in `l`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(l.l_type != libc::F_UNLCK as libc::c_short)
    }
}

/// Elsewhere the `flock` alone excludes writers, and no lock can be tested without
/// taking it: readers cannot tell a live writer and read as after a stop.
#[cfg(not(target_os = "linux"))]
mod ofd {
    use std::fs::File;
    use std::io;

    pub(super) fn set_write_lock(_: &File) -> io::Result<()> {
        Ok(())
    }

    pub(super) fn is_write_locked(_: &File) -> io::Result<bool> {
        Ok(false)
    }
}

impl StorageFile for FsFile {
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        self.0.read_at(buf, pos)
    }

    fn write_all_at(&self, buf: &[u8], pos: u64) -> io::Result<()> {
        self.0.write_all_at(buf, pos)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    /// `posix_fadvise(POSIX_FADV_DONTNEED)` over the whole file: Linux starts writeback
    /// of dirty pages (and keeps them) and evicts the clean, unmapped ones, including
    /// pages whose writeback failed.
    #[cfg(target_os = "linux")]
    fn drop_cached(&self) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise on a descriptor this struct owns; it reads no memory of ours.
        let rc = unsafe { libc::posix_fadvise(self.0.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn drop_cached(&self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::read_exact_at;

    #[test]
    fn what_is_created_here_is_not_readable_by_other_users() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let made = dir.path().join("made");
        FsStorage.create_dir_all(&made).unwrap();
        let file = made.join("segment");
        FsStorage.open(&file, OpenMode::CreateNew).unwrap();
        let lock = made.join("lock");
        drop(FsStorage.try_lock(&lock).unwrap());
        // At most these (the process's umask may take more away), whatever the umask
        // leaves of the 0o666 and 0o777 a plain create asks for.
        assert_eq!(mode(&made) & !DIR_MODE, 0, "directory {:o}", mode(&made));
        assert_eq!(mode(&file) & !FILE_MODE, 0, "file {:o}", mode(&file));
        assert_eq!(mode(&lock) & !FILE_MODE, 0, "lock file {:o}", mode(&lock));
    }

    #[test]
    fn create_dir_all_names_the_directories_it_created_outermost_first() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        let created = FsStorage.create_dir_all(&deep).unwrap();
        assert_eq!(created, vec![dir.path().join("a"), dir.path().join("a/b"), deep.clone()]);
        assert!(deep.is_dir());
        assert_eq!(FsStorage.create_dir_all(&deep).unwrap(), Vec::<PathBuf>::new(), "nothing new to create");
        crate::storage::create_dir_all_durably(&FsStorage, &dir.path().join("a/x/y")).unwrap();
        assert!(dir.path().join("a/x/y").is_dir());
        let file = dir.path().join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(FsStorage.create_dir_all(&file.join("g")).is_err(), "a file is in the way");
    }

    #[test]
    fn dropping_the_cache_changes_no_byte_synced_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let f = FsStorage.open(&dir.path().join("a"), OpenMode::CreateNew).unwrap();
        f.write_all_at(&[7u8; 10_000], 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(&[9u8; 5_000], 10_000).unwrap(); // dirty: written, not synced
        f.drop_cached().unwrap();
        let mut back = vec![0u8; 15_000];
        read_exact_at(&*f, &mut back, 0).unwrap();
        assert!(back[..10_000].iter().all(|&b| b == 7));
        assert!(back[10_000..].iter().all(|&b| b == 9), "a dirty page was dropped");
    }
}
