//! A storage with some of its calls changed, for tests: [`HookedStorage`] passes every
//! call to the storage it wraps (the simulated disk, in practice) except those its
//! [`Hooks`] take over, so a test that needs a slow write, a held sync, a counted read or
//! a file gone at the wrong moment states only that.
//!
//! Invariants:
//! - A hook that does not act passes the call through unchanged: with the default
//!   [`Hooks`], a `HookedStorage` behaves exactly as the storage it wraps.
//! - Every file opened through it is wrapped too, so the file hooks see every read,
//!   write and sync the log makes, whichever file they are on.

use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{OpenMode, Storage, StorageFile};

/// What a [`HookedStorage`] does instead of a plain call. Each method is given what the
/// call would be made on and does it, or something else; the defaults just do it.
pub trait Hooks: Debug + Send + Sync + 'static {
    /// `open` of `path` on `inner`.
    fn open(&self, inner: &dyn Storage, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn StorageFile>> {
        inner.open(path, mode)
    }
    /// `remove_file` of `path` on `inner`.
    fn remove_file(&self, inner: &dyn Storage, path: &Path) -> io::Result<()> {
        inner.remove_file(path)
    }
    /// `read_at` on `file`.
    fn read_at(&self, file: &dyn StorageFile, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        file.read_at(buf, pos)
    }
    /// `write_all_at` on `file`.
    fn write_all_at(&self, file: &dyn StorageFile, buf: &[u8], pos: u64) -> io::Result<()> {
        file.write_all_at(buf, pos)
    }
    /// `sync_data` on `file`.
    fn sync_data(&self, file: &dyn StorageFile) -> io::Result<()> {
        file.sync_data()
    }
}

/// `inner` with the calls `hooks` takes over changed (see the module comment).
#[derive(Debug)]
pub struct HookedStorage<H: Hooks> {
    inner: Arc<dyn Storage>,
    hooks: Arc<H>,
}

impl<H: Hooks> Clone for HookedStorage<H> {
    fn clone(&self) -> Self {
        HookedStorage { inner: self.inner.clone(), hooks: self.hooks.clone() }
    }
}

impl<H: Hooks> HookedStorage<H> {
    pub fn new(inner: Arc<dyn Storage>, hooks: H) -> HookedStorage<H> {
        HookedStorage { inner, hooks: Arc::new(hooks) }
    }

    /// The hooks, for a test to steer or read them.
    pub fn hooks(&self) -> &H {
        &self.hooks
    }
}

/// Hooks under which every sync waits while syncs are held
/// ([`HookedStorage::hold_syncs`]), so a test can keep an append in flight, its batch
/// written and not yet durable, for as long as it needs.
#[derive(Debug, Default)]
pub struct HoldSyncs {
    held: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
    waiting: std::sync::atomic::AtomicUsize,
}

impl HoldSyncs {
    /// Holds every sync from now on (`true`), or lets them all go (`false`).
    fn hold(&self, on: bool) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = on;
        self.released.notify_all();
    }

    /// How many syncs wait now: one waits once the writer took a group to disk.
    pub fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Hooks for HoldSyncs {
    fn sync_data(&self, file: &dyn StorageFile) -> io::Result<()> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if *held {
            self.waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            while *held {
                held = self.released.wait(held).unwrap_or_else(|p| p.into_inner());
            }
            self.waiting.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
        drop(held);
        file.sync_data()
    }
}

impl HookedStorage<HoldSyncs> {
    /// Holds every sync until the guard returned is dropped, however the test ends: a
    /// writer left waiting in a held sync would keep a failing test from dropping its
    /// log.
    pub fn hold_syncs(&self) -> SyncsHeld {
        self.hooks.hold(true);
        SyncsHeld(self.hooks.clone())
    }
}

/// Syncs held by [`HookedStorage::hold_syncs`], let go when dropped.
#[must_use = "syncs are let go as soon as this is dropped"]
pub struct SyncsHeld(Arc<HoldSyncs>);

impl Drop for SyncsHeld {
    fn drop(&mut self) {
        self.0.hold(false);
    }
}

#[derive(Debug)]
struct HookedFile<H: Hooks> {
    file: Arc<dyn StorageFile>,
    hooks: Arc<H>,
}

impl<H: Hooks> Storage for HookedStorage<H> {
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        self.inner.create_dir_all(dir)
    }
    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.inner.list_dir(dir)
    }
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn StorageFile>> {
        let file = self.hooks.open(self.inner.as_ref(), path, mode)?;
        Ok(Arc::new(HookedFile { file, hooks: self.hooks.clone() }))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.hooks.remove_file(self.inner.as_ref(), path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.sync_dir(dir)
    }
    fn try_lock(&self, path: &Path) -> io::Result<Box<dyn Send + Sync>> {
        self.inner.try_lock(path)
    }
    fn is_locked(&self, path: &Path) -> io::Result<bool> {
        self.inner.is_locked(path)
    }
}

impl<H: Hooks> StorageFile for HookedFile<H> {
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        self.hooks.read_at(self.file.as_ref(), buf, pos)
    }
    fn write_all_at(&self, buf: &[u8], pos: u64) -> io::Result<()> {
        self.hooks.write_all_at(self.file.as_ref(), buf, pos)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.hooks.sync_data(self.file.as_ref())
    }
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn drop_cached(&self) -> io::Result<()> {
        self.file.drop_cached()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::storage::SimStorage;

    #[derive(Debug, Default)]
    struct CountSyncs(AtomicU64);

    impl Hooks for CountSyncs {
        fn sync_data(&self, file: &dyn StorageFile) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            file.sync_data()
        }
    }

    #[derive(Debug)]
    struct Passes;
    impl Hooks for Passes {}

    #[test]
    fn a_hook_sees_the_calls_it_takes_over_and_the_rest_pass_through() {
        let sim = SimStorage::new();
        let hooked = HookedStorage::new(Arc::new(sim.clone()), CountSyncs::default());
        crate::storage::create_dir_all_durably(&hooked, Path::new("/d")).unwrap();
        let f = hooked.open(Path::new("/d/f"), OpenMode::CreateNew).unwrap();
        f.write_all_at(b"abc", 0).unwrap();
        f.sync_data().unwrap();
        f.sync_data().unwrap();
        hooked.sync_dir(Path::new("/d")).unwrap();
        assert_eq!(hooked.hooks().0.load(Ordering::SeqCst), 2);
        // What went through the hooks reached the wrapped disk, and its syncs too.
        sim.crash(crate::storage::CrashMode::LoseUnsynced);
        assert_eq!(sim.read_file(Path::new("/d/f")).unwrap(), b"abc");
    }

    #[test]
    fn the_default_hooks_change_nothing() {
        let sim = SimStorage::new();
        let hooked = HookedStorage::new(Arc::new(sim.clone()), Passes);
        hooked.create_dir_all(Path::new("/d")).unwrap();
        let f = hooked.open(Path::new("/d/f"), OpenMode::CreateNew).unwrap();
        f.write_all_at(b"hello", 0).unwrap();
        let mut buf = [0u8; 5];
        assert_eq!(f.read_at(&mut buf, 0).unwrap(), 5);
        assert_eq!(&buf, b"hello");
        f.set_len(2).unwrap();
        assert_eq!(f.len().unwrap(), 2);
        hooked.rename(Path::new("/d/f"), Path::new("/d/g")).unwrap();
        assert_eq!(hooked.list_dir(Path::new("/d")).unwrap(), vec!["g".to_string()]);
        let _lock = hooked.try_lock(Path::new("/d/lock")).unwrap();
        assert!(hooked.is_locked(Path::new("/d/lock")).unwrap());
    }
}
