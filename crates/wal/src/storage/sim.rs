//! A simulated disk for crash and fault testing.
//!
//! Per file it keeps two images: the bytes a reader sees now (`data`) and the bytes known
//! durable (`durable`), which only `sync_data` updates. Per directory it keeps the
//! entries visible now and the entries known durable, which only `sync_dir` updates.
//! [`SimStorage::crash`] is a power loss: every open handle dies (its operations fail with
//! `EIO` from then on), locks vanish, and each file and directory falls back to its
//! durable image plus, in [`CrashMode::Adversarial`], any mix of what was pending:
//! - each directory entry changed since the last `sync_dir` independently keeps its old
//!   or its new state (a create may vanish, a remove or rename may be undone);
//! - each directory created since the last `sync_dir` of its parent independently stays
//!   or vanishes, with everything in it (always vanishes in [`CrashMode::LoseUnsynced`]);
//! - a file's length lands anywhere between its durable and its current length (in whole
//!   512-byte sectors), and each unsynced sector independently holds the new bytes, the
//!   old durable bytes, zeros or garbage: out of order, as a real disk's write-back is.
//!
//! [`CrashMode::Reordered`] does the same except that a file's length is its durable or
//! its current one (a size change is atomic) and an unsynced sector holds only its new or
//! its old bytes, never zeros or garbage: a file system that changes sizes atomically on
//! a disk that writes whole sectors atomically, in any order. That is what redb's design assumes of a disk (single-byte
//! writes are atomic, a write changes no byte outside its range), so the state database
//! is tested under it; the log assumes less and is tested under both.
//!
//! Assumptions the simulation makes (and that `FORMAT.md` states for real disks): a
//! successful `sync_data` makes everything written before it durable; a directory made by
//! `create_dir_all` is durable once its parent was synced (`sync_dir`), its entries once
//! it was. The root directory always exists, and so do the directories a test builds
//! with [`SimStorage::write_file_durably`].
//!
//! A failed `sync_data` behaves like Linux after an `EIO` writeback error: the dirty
//! pages are marked clean, so a later successful sync does not cover them (tracked per
//! sector: a sync that persists writes made elsewhere in the file, before them or after,
//! still leaves them as they are on the disk, until they are written again). Some may have
//! reached the disk before the error, sector by sector (the others read back as what the
//! disk held before, zeros past its old end, after a crash or once `drop_cached` evicted
//! them), and a shorter length the sync was to persist may not be durable (a crash can
//! bring the old length back). Which, is drawn from the operation count.
//!
//! Faults are injected by operation count ([`SimStorage::fail_nth`],
//! [`SimStorage::crash_at_nth`]) or by a space limit ([`SimStorage::set_space_limit`]),
//! so a test can reproduce any fault exactly.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{OpenMode, Storage, StorageFile};

/// Sector size used when tearing unsynced writes.
pub const SECTOR_BYTES: usize = 512;

/// Which operations a fault counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    Write,
    Sync,
    SyncDir,
    /// Creating a file, renaming, removing, truncating: namespace and length changes.
    Metadata,
    /// Every mutating operation above.
    AnyMutation,
    /// Reading a file's bytes. Not a mutation: `AnyMutation` does not count it, nor does
    /// [`SimStorage::ops`]. A failed read may leave garbage in the caller's buffer.
    Read,
    /// Looking a file up: listing a directory, opening a file that exists, reading a
    /// file's length. Not a mutation, as `Read`: a disk that fails these (`EIO` on a
    /// directory block, a lost mount) must not be taken for one holding no log.
    Lookup,
}

impl FaultOp {
    /// Whether the operation changes the disk (counted by `AnyMutation` and
    /// [`SimStorage::ops`]).
    fn mutates(self) -> bool {
        !matches!(self, FaultOp::Read | FaultOp::Lookup)
    }
}

/// What a power loss keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Exactly the durable images.
    LoseUnsynced,
    /// The durable images plus an arbitrary, seeded mix of the pending changes.
    Adversarial { seed: u64 },
    /// As `Adversarial`, but a file's length is its durable or its current one, and each
    /// unsynced sector keeps its new or its old bytes, never zeros or garbage: size
    /// changes and sector writes are atomic, and reordered.
    Reordered { seed: u64 },
}

#[derive(Debug)]
enum Armed {
    Fail { op: FaultOp, remaining: u64, kind: io::ErrorKind },
    Crash { op: FaultOp, remaining: u64, mode: CrashMode },
}

#[derive(Debug, Default, Clone)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
    /// Lowest position changed since the last successful sync (`usize::MAX`: none).
    dirty_from: usize,
    /// Sectors a failed sync marked clean without writing them: reads serve `data`'s
    /// bytes (the page cache), but no later sync writes them (a write into the sector
    /// dirties it again), and a crash or `drop_cached` brings back `durable`'s.
    stale: BTreeSet<usize>,
}

#[derive(Debug, Default, Clone)]
struct Dir {
    names: BTreeMap<String, u64>,
    durable: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct State {
    epoch: u64,
    inodes: HashMap<u64, Inode>,
    dirs: HashMap<PathBuf, Dir>,
    /// Directories created since the last `sync_dir` of their parent: a power loss may
    /// take each away, with everything in it. Ordered, so a seed replays exactly.
    dirs_unsynced: BTreeSet<PathBuf>,
    next_ino: u64,
    locks: HashSet<PathBuf>,
    armed: Vec<Armed>,
    space_limit_bytes: Option<u64>,
    /// Whether a failed sync may have written some of its sectors (the default) or none.
    failed_syncs_write_nothing: bool,
    crashes: u64,
    ops: u64,
}

/// A simulated disk; clones share it.
///
/// A clone is one process's view of the disk: it is bound to the power cycle it was made
/// in (a clone of a bound view keeps its cycle), and after a power loss every `Storage`
/// call through it fails with `EIO`, as every file handle opened before the loss does. A
/// process that lost power can then neither help nor harm what the next one finds: a
/// clean-up the dead writer would run after the loss (removing a temporary file, say)
/// does not happen. The view [`SimStorage::new`] returns is the test's own, never bound:
/// it builds and inspects the disk across power losses. A process started after a power
/// loss takes a new clone.
#[derive(Debug)]
pub struct SimStorage {
    state: Arc<Mutex<State>>,
    /// The power cycle this view belongs to; `None` for the test's own view.
    epoch: Option<u64>,
}

impl Clone for SimStorage {
    fn clone(&self) -> SimStorage {
        let epoch = self.epoch.unwrap_or_else(|| lock(&self.state).epoch);
        SimStorage { state: self.state.clone(), epoch: Some(epoch) }
    }
}

impl Default for SimStorage {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug)]
struct SimFile {
    state: Arc<Mutex<State>>,
    ino: u64,
    epoch: u64,
    writable: bool,
}

#[derive(Debug)]
struct SimLock {
    state: Arc<Mutex<State>>,
    path: PathBuf,
    epoch: u64,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        if st.epoch == self.epoch {
            st.locks.remove(&self.path);
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic in a test thread must not hide the simulated disk from the others.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn eio(what: &str) -> io::Error {
    io::Error::other(format!("simulated I/O error: {what}"))
}

fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    Ok((parent, name.to_string()))
}

/// xorshift64*: deterministic garbage and choices from a seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

impl State {
    /// Counts one operation of kind `op` against the armed faults. `Err` means it fails
    /// (and, for a crash, that the power was lost just before it).
    fn check(&mut self, op: FaultOp) -> io::Result<()> {
        if op.mutates() {
            self.ops += 1;
        }
        // A fault due now fires; if several are due on the same operation, the first
        // fires and the others stay due (at 1) for the next operation they count.
        let mut fire = None;
        for (i, a) in self.armed.iter_mut().enumerate() {
            let (aop, remaining) = match a {
                Armed::Fail { op, remaining, .. } | Armed::Crash { op, remaining, .. } => (*op, remaining),
            };
            if aop != op && !(aop == FaultOp::AnyMutation && op.mutates()) {
                continue;
            }
            if *remaining > 1 {
                *remaining -= 1;
            } else if fire.is_none() {
                fire = Some(i);
            }
        }
        if let Some(i) = fire {
            match self.armed.remove(i) {
                Armed::Fail { kind, .. } => return Err(io::Error::new(kind, "simulated fault")),
                Armed::Crash { mode, .. } => {
                    self.crash(mode);
                    return Err(eio("power lost"));
                }
            }
        }
        Ok(())
    }

    fn used_bytes(&self) -> u64 {
        self.inodes.values().map(|i| i.data.len() as u64).sum()
    }

    fn crash(&mut self, mode: CrashMode) {
        self.epoch += 1;
        self.crashes += 1;
        self.locks.clear();
        self.armed.clear();
        let (mut rng, atomic) = match mode {
            CrashMode::LoseUnsynced => (None, true),
            CrashMode::Adversarial { seed } => (Some(Rng::new(seed ^ self.crashes)), false),
            CrashMode::Reordered { seed } => (Some(Rng::new(seed ^ self.crashes)), true),
        };
        let lost: Vec<PathBuf> = std::mem::take(&mut self.dirs_unsynced)
            .into_iter()
            .filter(|_| rng.as_mut().is_none_or(|r| r.below(2) == 0))
            .collect();
        self.dirs.retain(|d, _| !lost.iter().any(|l| d.starts_with(l)));
        for dir in self.dirs.values_mut() {
            let mut keys: Vec<String> = dir.names.keys().chain(dir.durable.keys()).cloned().collect();
            keys.sort();
            keys.dedup();
            let mut after = BTreeMap::new();
            for k in keys {
                let now = dir.names.get(&k).copied();
                let old = dir.durable.get(&k).copied();
                let take_new = now != old && rng.as_mut().is_some_and(|r| r.below(2) == 0);
                let pick = if take_new { now } else { old };
                if let Some(ino) = pick {
                    after.insert(k, ino);
                }
            }
            dir.names = after.clone();
            dir.durable = after;
        }
        let live: HashSet<u64> = self.dirs.values().flat_map(|d| d.names.values().copied()).collect();
        self.inodes.retain(|ino, _| live.contains(ino));
        for inode in self.inodes.values_mut() {
            let mut image = inode.durable.clone();
            if let Some(r) = &mut rng {
                tear(&mut image, inode, r, atomic);
            }
            inode.data = image.clone();
            inode.durable = image;
            inode.dirty_from = usize::MAX;
            inode.stale.clear();
        }
    }
}

/// Applies an arbitrary part of `inode`'s pending changes to `image` (its durable bytes).
/// With `atomic`, the length is the old or the new one and each unsynced sector holds
/// its new or its old bytes; without, the length lands in between too and a sector may
/// also hold zeros or garbage.
fn tear(image: &mut Vec<u8>, inode: &Inode, r: &mut Rng, atomic: bool) {
    let pending_from = inode.dirty_from.min(inode.durable.len()).min(inode.data.len());
    if inode.dirty_from == usize::MAX && inode.data.len() == inode.durable.len() {
        return;
    }
    let lo = inode.durable.len().min(inode.data.len());
    let hi = inode.durable.len().max(inode.data.len());
    // The new length: anywhere from the shorter to the longer image, in whole sectors,
    // or (sizes changed atomically) one of the two.
    let len = if !atomic {
        let choices = (hi - lo).div_ceil(SECTOR_BYTES) as u64 + 1;
        (lo + r.below(choices) as usize * SECTOR_BYTES).min(hi)
    } else if r.below(2) == 0 {
        inode.durable.len()
    } else {
        inode.data.len()
    };
    image.resize(len, 0);
    let first_sector = pending_from / SECTOR_BYTES;
    let mut s = first_sector;
    while s * SECTOR_BYTES < len {
        let a = (s * SECTOR_BYTES).max(pending_from);
        let b = ((s + 1) * SECTOR_BYTES).min(len);
        // Clean pages are never written back: a stale sector keeps what the disk holds.
        let choice = if inode.stale.contains(&s) { 1 } else { r.below(if atomic { 2 } else { 4 }) };
        match choice {
            0 => {
                for (i, byte) in image[a..b].iter_mut().enumerate() {
                    // Past a shrink the new image has no bytes: with sizes atomic, the
                    // kept (old) length holds the old bytes there, never zeros.
                    let old = if atomic { inode.durable.get(a + i).copied() } else { None };
                    *byte = inode.data.get(a + i).copied().or(old).unwrap_or(0);
                }
            }
            1 => {
                for (i, byte) in image[a..b].iter_mut().enumerate() {
                    *byte = inode.durable.get(a + i).copied().unwrap_or(0);
                }
            }
            2 => image[a..b].fill(0),
            _ => {
                for byte in &mut image[a..b] {
                    *byte = r.next() as u8;
                }
            }
        }
        s += 1;
    }
}

impl SimStorage {
    pub fn new() -> SimStorage {
        SimStorage {
            state: Arc::new(Mutex::new(State {
                epoch: 0,
                inodes: HashMap::new(),
                dirs: HashMap::new(),
                dirs_unsynced: BTreeSet::new(),
                next_ino: 1,
                locks: HashSet::new(),
                armed: Vec::new(),
                space_limit_bytes: None,
                failed_syncs_write_nothing: false,
                crashes: 0,
                ops: 0,
            })),
            epoch: None,
        }
    }

    /// The disk, locked, for one `Storage` call: refused with `EIO` if this view belongs
    /// to a process from before a power loss.
    fn live_state(&self) -> io::Result<MutexGuard<'_, State>> {
        let st = lock(&self.state);
        match self.epoch {
            Some(e) if e != st.epoch => Err(eio("process from before a power loss")),
            _ => Ok(st),
        }
    }

    /// Another disk with this one's content, synced and unsynced alike, and nothing
    /// else: no lock held, no fault armed, no power loss or operation counted yet. A test
    /// that must lose power at every step of what a start does to one disk state forks
    /// that state once per step, instead of running again what made it (which under a
    /// timer-driven sync does not make the same writes twice).
    pub fn fork(&self) -> SimStorage {
        let st = lock(&self.state);
        SimStorage {
            state: Arc::new(Mutex::new(State {
                epoch: st.epoch,
                inodes: st.inodes.clone(),
                dirs: st.dirs.clone(),
                dirs_unsynced: st.dirs_unsynced.clone(),
                next_ino: st.next_ino,
                locks: HashSet::new(),
                armed: Vec::new(),
                space_limit_bytes: st.space_limit_bytes,
                failed_syncs_write_nothing: st.failed_syncs_write_nothing,
                crashes: 0,
                ops: 0,
            })),
            epoch: None,
        }
    }

    /// Loses power now.
    pub fn crash(&self, mode: CrashMode) {
        lock(&self.state).crash(mode);
    }

    /// Makes the `n`th (1 = next) operation of kind `op` fail with `kind`. A failed write
    /// leaves its first half written (a short write, as a real disk error can).
    pub fn fail_nth(&self, op: FaultOp, n: u64, kind: io::ErrorKind) {
        assert!(n >= 1, "n counts from 1");
        lock(&self.state).armed.push(Armed::Fail { op, remaining: n, kind });
    }

    /// Loses power just before the `n`th (1 = next) operation of kind `op`.
    pub fn crash_at_nth(&self, op: FaultOp, n: u64, mode: CrashMode) {
        assert!(n >= 1, "n counts from 1");
        lock(&self.state).armed.push(Armed::Crash { op, remaining: n, mode });
    }

    /// Faults armed and not yet fired.
    pub fn armed_faults(&self) -> usize {
        lock(&self.state).armed.len()
    }

    /// Disarms every pending fault.
    pub fn disarm(&self) {
        lock(&self.state).armed.clear();
    }

    /// Writes that would grow the disk's total past `limit` fail with `StorageFull`,
    /// having written the part that fits.
    pub fn set_space_limit(&self, limit_bytes: Option<u64>) {
        lock(&self.state).space_limit_bytes = limit_bytes;
    }

    /// From now on a failed sync writes none of its sectors and its length is durable
    /// (as if the disk had persisted the size, then failed every page). By default some
    /// sectors may have reached the disk and a shrink may not be durable. A test that
    /// must tell whether the log read a failed write back from the page cache or from
    /// the disk needs this: a sector the disk did get reads the same either way.
    pub fn set_failed_syncs_write_nothing(&self, on: bool) {
        lock(&self.state).failed_syncs_write_nothing = on;
    }

    /// Bytes held by all files.
    pub fn used_bytes(&self) -> u64 {
        lock(&self.state).used_bytes()
    }

    /// Power losses so far (including those armed faults caused).
    pub fn crashes(&self) -> u64 {
        lock(&self.state).crashes
    }

    /// Mutating operations so far.
    pub fn ops(&self) -> u64 {
        lock(&self.state).ops
    }

    /// The current content of a file, for tests that damage or inspect bytes directly.
    pub fn read_file(&self, path: &Path) -> io::Result<Vec<u8>> {
        let st = lock(&self.state);
        let (dir, name) = split(path)?;
        let ino = st
            .dirs
            .get(&dir)
            .and_then(|d| d.names.get(&name))
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(st.inodes[ino].data.clone())
    }

    /// Replaces a file's content, durably (a test's way to build or damage a disk image):
    /// the file, its name and its directory (with the directory's parents) survive a
    /// power loss.
    pub fn write_file_durably(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut st = lock(&self.state);
        let (dir, name) = split(path)?;
        for d in dir.ancestors() {
            st.dirs.entry(d.to_path_buf()).or_default();
            st.dirs_unsynced.remove(d);
        }
        let existing = st.dirs.get(&dir).and_then(|d| d.names.get(&name)).copied();
        let ino = match existing {
            Some(ino) => ino,
            None => {
                let ino = st.next_ino;
                st.next_ino += 1;
                st.inodes.insert(ino, Inode { dirty_from: usize::MAX, ..Inode::default() });
                let d = st.dirs.entry(dir).or_default();
                d.names.insert(name.clone(), ino);
                d.durable.insert(name, ino);
                ino
            }
        };
        let inode = st.inodes.get_mut(&ino).ok_or_else(|| eio("inode"))?;
        inode.data = bytes.to_vec();
        inode.durable = bytes.to_vec();
        inode.dirty_from = usize::MAX;
        inode.stale.clear();
        Ok(())
    }
}

impl Storage for SimStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut st = self.live_state()?;
        let mut missing: Vec<&Path> =
            dir.ancestors().filter(|d| !d.as_os_str().is_empty() && !st.dirs.contains_key(*d)).collect();
        missing.reverse();
        let mut created = Vec::new();
        for d in missing {
            if d.parent().is_none_or(|p| p.as_os_str().is_empty()) {
                // The root exists on any disk.
                st.dirs.insert(d.to_path_buf(), Dir::default());
                continue;
            }
            st.check(FaultOp::Metadata)?;
            st.dirs.insert(d.to_path_buf(), Dir::default());
            st.dirs_unsynced.insert(d.to_path_buf());
            created.push(d.to_path_buf());
        }
        Ok(created)
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut st = self.live_state()?;
        st.check(FaultOp::Lookup)?;
        let d = st.dirs.get(dir).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(d.names.keys().cloned().collect())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn StorageFile>> {
        let mut st = self.live_state()?;
        let (dir, name) = split(path)?;
        if !st.dirs.contains_key(&dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let existing = st.dirs[&dir].names.get(&name).copied();
        let ino = match (mode, existing) {
            (OpenMode::CreateNew, Some(_)) => {
                return Err(io::Error::from(io::ErrorKind::AlreadyExists));
            }
            (OpenMode::CreateNew, None) => {
                st.check(FaultOp::Metadata)?;
                let ino = st.next_ino;
                st.next_ino += 1;
                st.inodes.insert(ino, Inode { dirty_from: usize::MAX, ..Inode::default() });
                if let Some(d) = st.dirs.get_mut(&dir) {
                    d.names.insert(name, ino);
                }
                ino
            }
            (_, Some(ino)) => {
                st.check(FaultOp::Lookup)?;
                ino
            }
            (_, None) => return Err(io::Error::from(io::ErrorKind::NotFound)),
        };
        Ok(Arc::new(SimFile { state: self.state.clone(), ino, epoch: st.epoch, writable: mode != OpenMode::Read }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.live_state()?;
        st.check(FaultOp::Metadata)?;
        let (fd, fname) = split(from)?;
        let (td, tname) = split(to)?;
        if !st.dirs.contains_key(&td) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let ino = st
            .dirs
            .get_mut(&fd)
            .and_then(|d| d.names.remove(&fname))
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        if let Some(d) = st.dirs.get_mut(&td) {
            d.names.insert(tname, ino);
        }
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut st = self.live_state()?;
        st.check(FaultOp::Metadata)?;
        let (dir, name) = split(path)?;
        st.dirs
            .get_mut(&dir)
            .and_then(|d| d.names.remove(&name))
            .map(|_| ())
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut st = self.live_state()?;
        st.check(FaultOp::SyncDir)?;
        let d = st.dirs.get_mut(dir).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        d.durable = d.names.clone();
        st.dirs_unsynced.retain(|child| child.parent() != Some(dir));
        Ok(())
    }

    fn try_lock(&self, path: &Path) -> io::Result<Box<dyn Send + Sync>> {
        let mut st = self.live_state()?;
        if !st.locks.insert(path.to_path_buf()) {
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        }
        Ok(Box::new(SimLock { state: self.state.clone(), path: path.to_path_buf(), epoch: st.epoch }))
    }

    fn is_locked(&self, path: &Path) -> io::Result<bool> {
        Ok(self.live_state()?.locks.contains(path))
    }
}

impl SimFile {
    fn live<'a>(&self, st: &'a mut State) -> io::Result<&'a mut Inode> {
        if st.epoch != self.epoch {
            return Err(eio("handle from before a power loss"));
        }
        st.inodes.get_mut(&self.ino).ok_or_else(|| eio("inode gone"))
    }
}

impl StorageFile for SimFile {
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        let mut st = lock(&self.state);
        self.live(&mut st)?;
        if let Err(e) = st.check(FaultOp::Read) {
            // What a failed transfer may leave behind: bytes that are not the file's.
            let half = buf.len() / 2;
            buf[..half].fill(0xA5);
            return Err(e);
        }
        let inode = self.live(&mut st)?;
        let pos = usize::try_from(pos).map_err(|_| eio("position"))?;
        if pos >= inode.data.len() {
            return Ok(0);
        }
        let n = buf.len().min(inode.data.len() - pos);
        buf[..n].copy_from_slice(&inode.data[pos..pos + n]);
        Ok(n)
    }

    fn write_all_at(&self, buf: &[u8], pos: u64) -> io::Result<()> {
        let mut st = lock(&self.state);
        self.live(&mut st)?;
        if !self.writable {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        let pos = usize::try_from(pos).map_err(|_| eio("position"))?;
        let end = pos + buf.len();
        let used = st.used_bytes();
        let len_now = self.live(&mut st)?.data.len();
        let grows_by = end.saturating_sub(len_now) as u64;
        let (n, result) = match st.space_limit_bytes {
            // A disk that runs out part of the way writes what fits, as `pwrite` does.
            Some(limit) if used + grows_by > limit => {
                let room = usize::try_from(limit.saturating_sub(used)).unwrap_or(usize::MAX);
                let n = (len_now.saturating_add(room)).saturating_sub(pos).min(buf.len());
                (n, Err(io::Error::new(io::ErrorKind::StorageFull, "simulated disk full")))
            }
            _ => match st.check(FaultOp::Write) {
                Ok(()) => (buf.len(), Ok(())),
                Err(e) if e.kind() == io::ErrorKind::Other && st.epoch != self.epoch => return Err(e),
                Err(e) => (buf.len() / 2, Err(e)),
            },
        };
        if n == 0 {
            return result;
        }
        let inode = st.inodes.get_mut(&self.ino).ok_or_else(|| eio("inode gone"))?;
        if inode.data.len() < pos + n {
            inode.data.resize(pos + n, 0);
        }
        inode.data[pos..pos + n].copy_from_slice(&buf[..n]);
        inode.dirty_from = inode.dirty_from.min(pos);
        let sectors = pos / SECTOR_BYTES..(pos + n).div_ceil(SECTOR_BYTES);
        inode.stale.retain(|s| !sectors.contains(s));
        result
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut st = lock(&self.state);
        self.live(&mut st)?;
        if let Err(e) = st.check(FaultOp::Sync) {
            if st.epoch == self.epoch {
                // Linux after a writeback error: the pages are clean and nothing will
                // write them again; which of them reached the disk before the error is
                // anyone's guess, sector by sector, and a cut the sync was to persist
                // may not be durable. Decided here, from the operation count, so a test
                // replays it exactly.
                let mut r = Rng::new(st.ops ^ 0xFA11_ED5C);
                let nothing = st.failed_syncs_write_nothing;
                let inode = st.inodes.get_mut(&self.ino).ok_or_else(|| eio("inode gone"))?;
                let from = inode.dirty_from.min(inode.data.len());
                let old_len = inode.durable.len();
                let len =
                    if inode.data.len() < old_len && !nothing && r.below(2) == 0 { old_len } else { inode.data.len() };
                let mut image = std::mem::take(&mut inode.durable);
                image.resize(len, 0);
                let mut s = from / SECTOR_BYTES;
                while s * SECTOR_BYTES < len.min(inode.data.len()) {
                    let a = (s * SECTOR_BYTES).max(from);
                    let b = ((s + 1) * SECTOR_BYTES).min(len).min(inode.data.len());
                    if !nothing && r.below(2) == 0 {
                        image[a..b].copy_from_slice(&inode.data[a..b]);
                    } else {
                        if a >= old_len {
                            image[a..b].fill(0);
                        }
                        inode.stale.insert(s);
                    }
                    s += 1;
                }
                inode.durable = image;
                inode.dirty_from = usize::MAX;
            }
            return Err(e);
        }
        let inode = self.live(&mut st)?;
        if inode.dirty_from != usize::MAX || inode.durable.len() != inode.data.len() {
            let from = inode.dirty_from.min(inode.data.len());
            let before = std::mem::take(&mut inode.durable);
            let mut image = before[..from.min(before.len())].to_vec();
            image.resize(from, 0);
            image.extend_from_slice(&inode.data[from..]);
            // Clean pages are not written back, however many syncs follow.
            for &s in &inode.stale {
                let (a, b) = ((s * SECTOR_BYTES).max(from), ((s + 1) * SECTOR_BYTES).min(image.len()));
                for (i, byte) in image.iter_mut().enumerate().take(b).skip(a) {
                    *byte = before.get(i).copied().unwrap_or(0);
                }
            }
            inode.durable = image;
            inode.dirty_from = usize::MAX;
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let mut st = lock(&self.state);
        self.live(&mut st)?;
        st.check(FaultOp::Lookup)?;
        Ok(self.live(&mut st)?.data.len() as u64)
    }

    /// Clean bytes (below the first position written since the last sync) read back
    /// from the durable image from now on: where a sync failed, the zeros the disk
    /// holds instead of what the failed sync carried.
    fn drop_cached(&self) -> io::Result<()> {
        let mut st = lock(&self.state);
        let inode = self.live(&mut st)?;
        let clean = inode.dirty_from.min(inode.data.len()).min(inode.durable.len());
        inode.data[..clean].copy_from_slice(&inode.durable[..clean]);
        // A stale sector holds no change of its own since (a write would have dirtied
        // it): evicted, it reads what the disk holds.
        for s in std::mem::take(&mut inode.stale) {
            let (a, b) = (s * SECTOR_BYTES, ((s + 1) * SECTOR_BYTES).min(inode.data.len()));
            for i in a..b {
                inode.data[i] = inode.durable.get(i).copied().unwrap_or(0);
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = lock(&self.state);
        self.live(&mut st)?;
        if !self.writable {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        st.check(FaultOp::Metadata)?;
        let len = usize::try_from(len).map_err(|_| eio("length"))?;
        let inode = self.live(&mut st)?;
        let old = inode.data.len();
        inode.data.resize(len, 0);
        inode.dirty_from = inode.dirty_from.min(len.min(old));
        inode.stale.retain(|&s| s * SECTOR_BYTES < len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::read_exact_at;

    /// A new file in the directory `/d`, which survives a power loss.
    fn file(s: &SimStorage, p: &str) -> Arc<dyn StorageFile> {
        crate::storage::create_dir_all_durably(s, Path::new("/d")).unwrap();
        s.open(Path::new(p), OpenMode::CreateNew).unwrap()
    }

    /// `/d/a` on a fresh disk, its name and `bytes` durable.
    fn durable_file(bytes: &[u8]) -> (SimStorage, Arc<dyn StorageFile>) {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        s.sync_dir(Path::new("/d")).unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f.sync_data().unwrap();
        (s, f)
    }

    #[test]
    fn a_process_view_from_before_a_power_loss_can_do_nothing_after_it() {
        let (s, _f) = durable_file(b"x");
        let process = s.clone();
        let inner = process.clone();
        s.write_file_durably(Path::new("/d/t.tmp"), b"t").unwrap();
        s.crash(CrashMode::LoseUnsynced);
        for view in [&process, &inner] {
            assert!(view.remove_file(Path::new("/d/t.tmp")).is_err(), "a dead process removed a file");
            assert!(view.rename(Path::new("/d/t.tmp"), Path::new("/d/b")).is_err());
            assert!(view.open(Path::new("/d/c"), OpenMode::CreateNew).is_err());
            assert!(view.sync_dir(Path::new("/d")).is_err());
            assert!(view.list_dir(Path::new("/d")).is_err());
            assert!(view.try_lock(Path::new("/d/lock")).is_err());
        }
        assert_eq!(s.list_dir(Path::new("/d")).unwrap(), vec!["a".to_string(), "t.tmp".to_string()]);
        // The next process, and the test's own view, act as before.
        let next = s.clone();
        next.remove_file(Path::new("/d/t.tmp")).unwrap();
        assert_eq!(s.list_dir(Path::new("/d")).unwrap(), vec!["a".to_string()]);
        assert_eq!(read_exact_vec(&*next.open(Path::new("/d/a"), OpenMode::Read).unwrap(), 1), b"x");
    }

    #[test]
    fn a_fork_has_the_content_synced_and_unsynced_and_nothing_else_in_common() {
        let (s, f) = durable_file(b"old");
        f.write_all_at(b"new", 0).unwrap();
        let _held = s.try_lock(Path::new("/d/lock")).unwrap();
        s.crash_at_nth(FaultOp::AnyMutation, 1, CrashMode::LoseUnsynced);
        let fork = s.fork();
        assert_eq!((fork.ops(), fork.crashes(), fork.armed_faults()), (0, 0, 0));
        assert!(fork.try_lock(Path::new("/d/lock")).is_ok(), "a fork is another machine: no lock is held there");
        assert_eq!(fork.read_file(Path::new("/d/a")).unwrap(), b"new");
        // Its unsynced bytes are its own to lose, and what it does stays on it.
        fork.crash(CrashMode::LoseUnsynced);
        assert_eq!(fork.read_file(Path::new("/d/a")).unwrap(), b"old");
        fork.write_file_durably(Path::new("/d/b"), b"b").unwrap();
        s.disarm();
        assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), b"new");
        assert_eq!(s.list_dir(Path::new("/d")).unwrap(), vec!["a".to_string()]);
        s.crash(CrashMode::LoseUnsynced);
        assert_eq!(fork.read_file(Path::new("/d/a")).unwrap(), b"old");
        assert_eq!(fork.read_file(Path::new("/d/b")).unwrap(), b"b");
    }

    fn read_exact_vec(f: &dyn StorageFile, n: usize) -> Vec<u8> {
        let mut b = vec![0; n];
        read_exact_at(f, &mut b, 0).unwrap();
        b
    }

    #[test]
    fn a_created_directory_survives_a_power_loss_only_once_its_parent_was_synced() {
        let s = SimStorage::new();
        assert_eq!(s.create_dir_all(Path::new("/a/b")).unwrap(), vec![PathBuf::from("/a"), PathBuf::from("/a/b")]);
        s.write_file_durably(Path::new("/x/f"), b"f").unwrap();
        s.sync_dir(Path::new("/a/b")).unwrap();
        s.sync_dir(Path::new("/a")).unwrap();
        s.crash(CrashMode::LoseUnsynced);
        assert!(s.list_dir(Path::new("/a")).is_err(), "/a was never synced into /");
        assert!(s.list_dir(Path::new("/a/b")).is_err(), "what is in a lost directory is lost with it");
        assert_eq!(s.read_file(Path::new("/x/f")).unwrap(), b"f", "a test's durable image stays");
        s.create_dir_all(Path::new("/a/b")).unwrap();
        s.sync_dir(Path::new("/")).unwrap();
        s.crash(CrashMode::LoseUnsynced);
        assert!(s.list_dir(Path::new("/a")).is_ok());
        assert!(s.list_dir(Path::new("/a/b")).is_err(), "/a/b was never synced into /a");
        for seed in 0..32 {
            let s = SimStorage::new();
            s.create_dir_all(Path::new("/a/b")).unwrap();
            s.crash(CrashMode::Adversarial { seed });
            let (a, b) = (s.list_dir(Path::new("/a")).is_ok(), s.list_dir(Path::new("/a/b")).is_ok());
            assert!(a || !b, "seed {seed}: /a/b outlived its parent");
        }
    }

    #[test]
    fn only_synced_bytes_and_synced_names_survive_a_clean_power_loss() {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        f.write_all_at(b"durable", 0).unwrap();
        f.sync_data().unwrap();
        s.sync_dir(Path::new("/d")).unwrap();
        f.write_all_at(b"-lost", 7).unwrap();
        let g = s.open(Path::new("/d/b"), OpenMode::CreateNew).unwrap();
        g.write_all_at(b"x", 0).unwrap();
        g.sync_data().unwrap();
        s.crash(CrashMode::LoseUnsynced);
        assert!(f.read_at(&mut [0u8; 4], 0).is_err(), "old handles die with the power");
        assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), b"durable");
        assert!(s.read_file(Path::new("/d/b")).is_err(), "an unsynced directory entry survived");
    }

    /// The pages a failed sync left clean are never written by a later sync, even one
    /// that persists writes made below them (redb writes its header at the start of the
    /// file on every commit): the cache serves them until they are evicted or the power
    /// goes, and then the disk's bytes are back. A sector written again is dirty again,
    /// and synced.
    #[test]
    fn a_later_sync_never_writes_what_a_failed_sync_left_clean() {
        let s = SimStorage::new();
        s.set_failed_syncs_write_nothing(true);
        let f = file(&s, "/d/a");
        s.sync_dir(Path::new("/d")).unwrap();
        let old = vec![1u8; 4 * SECTOR_BYTES];
        f.write_all_at(&old, 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(&[2u8; 2 * SECTOR_BYTES], 2 * SECTOR_BYTES as u64).unwrap();
        s.fail_nth(FaultOp::Sync, 1, io::ErrorKind::Other);
        assert!(f.sync_data().is_err());
        // A commit's header at the start, and one of the failed sectors written again.
        f.write_all_at(&[3u8; 8], 0).unwrap();
        f.write_all_at(&[4u8; 8], 3 * SECTOR_BYTES as u64).unwrap();
        f.sync_data().unwrap();
        let mut cached = vec![0u8; 4 * SECTOR_BYTES];
        read_exact_at(&*f, &mut cached, 0).unwrap();
        assert_eq!(cached[2 * SECTOR_BYTES], 2, "the cache serves the failed write");

        let mut want = old.clone();
        want[..8].fill(3);
        want[3 * SECTOR_BYTES..4 * SECTOR_BYTES].fill(2);
        want[3 * SECTOR_BYTES..3 * SECTOR_BYTES + 8].fill(4);
        f.drop_cached().unwrap();
        let mut evicted = vec![0u8; 4 * SECTOR_BYTES];
        read_exact_at(&*f, &mut evicted, 0).unwrap();
        assert_eq!(evicted, want, "evicted, the failed sector reads the disk; the rewritten one was synced");
        s.crash(CrashMode::LoseUnsynced);
        assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), want, "after a power loss, the same");
    }

    /// A failed sync's pages are clean but may or may not be on the disk: once evicted
    /// from the cache they read back as what reached it (both outcomes occur as the
    /// operation count varies), while bytes written after it, still dirty, are kept.
    #[test]
    fn dropping_the_cache_shows_what_a_failed_sync_wrote_or_not_and_keeps_dirty_bytes() {
        let (mut saw_written, mut saw_lost) = (false, false);
        for ops_before in 0..32 {
            let s = SimStorage::new();
            let f = file(&s, "/d/a");
            s.sync_dir(Path::new("/d")).unwrap();
            for _ in 0..ops_before {
                f.write_all_at(b"x", 0).unwrap(); // counted operations, overwritten below
            }
            f.write_all_at(b"synced", 0).unwrap();
            f.sync_data().unwrap();
            f.write_all_at(b"-failed", 6).unwrap();
            s.fail_nth(FaultOp::Sync, 1, io::ErrorKind::Other);
            assert!(f.sync_data().is_err());
            f.write_all_at(b"-dirty", 13).unwrap();
            let read = |f: &Arc<dyn StorageFile>| {
                let mut b = vec![0u8; f.len().unwrap() as usize];
                read_exact_at(&**f, &mut b, 0).unwrap();
                b
            };
            assert_eq!(read(&f), b"synced-failed-dirty", "the page cache holds all of it");
            f.drop_cached().unwrap();
            let b = read(&f);
            if b == b"synced-failed-dirty" {
                saw_written = true;
            } else {
                assert_eq!(b, b"synced\0\0\0\0\0\0\0-dirty", "from the disk, but for the dirty bytes");
                saw_lost = true;
            }
            // Nothing writes the failed pages again: a later successful sync does not
            // change what the disk holds of them.
            f.sync_data().unwrap();
            s.crash(CrashMode::LoseUnsynced);
            assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), b, "ops before: {ops_before}");
        }
        assert!(saw_written && saw_lost, "written {saw_written}, lost {saw_lost}");
    }

    /// A shrink whose sync failed is not durable for sure: a crash may bring back the
    /// old length and bytes (over the operation counts, both occur).
    #[test]
    fn a_shrink_whose_sync_failed_may_come_back_at_its_old_length() {
        let (mut saw_old, mut saw_new) = (false, false);
        for ops_before in 0..32 {
            let s = SimStorage::new();
            let f = file(&s, "/d/a");
            s.sync_dir(Path::new("/d")).unwrap();
            for _ in 0..ops_before {
                f.write_all_at(b"x", 0).unwrap(); // counted operations, overwritten below
            }
            f.write_all_at(&[0x11; 4 * SECTOR_BYTES], 0).unwrap();
            f.sync_data().unwrap();
            f.set_len(SECTOR_BYTES as u64).unwrap();
            s.fail_nth(FaultOp::Sync, 1, io::ErrorKind::Other);
            assert!(f.sync_data().is_err());
            s.crash(CrashMode::LoseUnsynced);
            let after = s.read_file(Path::new("/d/a")).unwrap();
            assert!(after.iter().all(|&b| b == 0x11), "ops before {ops_before}: bytes that were never there");
            match after.len() {
                n if n == SECTOR_BYTES => saw_new = true,
                n if n == 4 * SECTOR_BYTES => saw_old = true,
                n => panic!("ops before {ops_before}: length {n}"),
            }
        }
        assert!(saw_old && saw_new, "old length {saw_old}, new {saw_new}");
    }

    /// After an unsynced shrink, a reordered crash that keeps the old length keeps the
    /// old bytes past the new one, never zeros.
    #[test]
    fn a_reordered_crash_after_a_shrink_keeps_the_old_bytes() {
        for seed in 0..64 {
            let (s, f) = durable_file(&[0x11; 4 * SECTOR_BYTES]);
            f.set_len(SECTOR_BYTES as u64).unwrap();
            s.crash(CrashMode::Reordered { seed });
            let after = s.read_file(Path::new("/d/a")).unwrap();
            assert!(after.len() == SECTOR_BYTES || after.len() == 4 * SECTOR_BYTES, "seed {seed}: {}", after.len());
            assert!(after.iter().all(|&b| b == 0x11), "seed {seed}: zeros where the old bytes were");
        }
    }

    /// A reordered crash keeps, sector by sector, the new or the old bytes of an
    /// overwrite (and both occur over the seeds), never zeros or garbage; what lies past
    /// the durable length reads as the new bytes or zeros, where the file grew.
    #[test]
    fn reordered_crashes_keep_old_or_new_sectors_only() {
        let (mut saw_old, mut saw_new) = (false, false);
        for seed in 0..64 {
            let (s, f) = durable_file(&[0x11; 4 * SECTOR_BYTES]);
            f.write_all_at(&[0x22; 6 * SECTOR_BYTES], 0).unwrap();
            s.crash(CrashMode::Reordered { seed });
            let after = s.read_file(Path::new("/d/a")).unwrap();
            assert!(after.len() >= 4 * SECTOR_BYTES, "seed {seed}: shorter than durable: {}", after.len());
            for (i, sector) in after.chunks(SECTOR_BYTES).enumerate() {
                let old = if i < 4 { 0x11 } else { 0x00 };
                let kept = sector[0];
                assert!(kept == 0x22 || kept == old, "seed {seed}: sector {i} holds {kept:#x}");
                assert!(sector.iter().all(|&b| b == kept), "seed {seed}: sector {i} was torn inside");
                saw_old |= i < 4 && kept == old;
                saw_new |= kept == 0x22;
            }
        }
        assert!(saw_old && saw_new, "the seeds never mixed old and new sectors");
    }

    #[test]
    fn adversarial_crashes_never_touch_durable_bytes() {
        for seed in 0..200 {
            let durable: Vec<u8> = (0..1500u32).map(|i| i as u8).collect();
            let (s, f) = durable_file(&durable);
            f.write_all_at(&[0xEE; 3000], 1500).unwrap();
            s.crash(CrashMode::Adversarial { seed });
            let after = s.read_file(Path::new("/d/a")).unwrap();
            assert!(after.len() >= 1500 && after.len() <= 4500, "seed {seed}: len {}", after.len());
            assert_eq!(&after[..1500], &durable[..], "seed {seed}");
        }
    }

    #[test]
    fn a_failed_sync_is_not_covered_by_a_later_successful_one() {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        s.sync_dir(Path::new("/d")).unwrap();
        f.write_all_at(b"aaaa", 0).unwrap();
        s.fail_nth(FaultOp::Sync, 1, io::ErrorKind::Other);
        assert!(f.sync_data().is_err());
        f.write_all_at(b"bbbb", 4).unwrap();
        f.sync_data().unwrap();
        assert_eq!(f.len().unwrap(), 8);
        s.crash(CrashMode::LoseUnsynced);
        assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), b"\0\0\0\0bbbb");
    }

    #[test]
    fn space_limit_refuses_growth_but_not_overwrites() {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        s.set_space_limit(Some(10));
        f.write_all_at(&[1; 10], 0).unwrap();
        let e = f.write_all_at(&[1; 1], 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        f.write_all_at(&[2; 5], 0).unwrap();
        f.set_len(4).unwrap();
        f.write_all_at(&[3; 6], 4).unwrap();
    }

    #[test]
    fn crash_at_nth_loses_power_before_that_operation() {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        s.sync_dir(Path::new("/d")).unwrap();
        f.write_all_at(b"one", 0).unwrap();
        s.crash_at_nth(FaultOp::Sync, 1, CrashMode::LoseUnsynced);
        assert!(f.sync_data().is_err());
        assert_eq!(s.crashes(), 1);
        assert_eq!(s.read_file(Path::new("/d/a")).unwrap(), b"");
    }

    #[test]
    fn two_faults_due_on_the_same_operation_fire_one_after_the_other() {
        let s = SimStorage::new();
        let f = file(&s, "/d/a");
        s.fail_nth(FaultOp::Write, 1, io::ErrorKind::Other);
        s.fail_nth(FaultOp::AnyMutation, 1, io::ErrorKind::StorageFull);
        assert_eq!(f.write_all_at(b"x", 0).unwrap_err().kind(), io::ErrorKind::Other);
        assert_eq!(f.write_all_at(b"x", 0).unwrap_err().kind(), io::ErrorKind::StorageFull);
        f.write_all_at(b"x", 0).unwrap();
    }

    #[test]
    fn locks_are_exclusive_and_released_on_drop() {
        let s = SimStorage::new();
        let g = s.try_lock(Path::new("/d/LOCK")).unwrap();
        let again = s.try_lock(Path::new("/d/LOCK")).err().map(|e| e.kind());
        assert_eq!(again, Some(io::ErrorKind::WouldBlock));
        drop(g);
        assert!(s.try_lock(Path::new("/d/LOCK")).is_ok());
    }
}
