//! Memory the log keeps after an append: the writer's group buffer must not stay at the
//! size of the largest batch it ever wrote. Counted with this test binary's own
//! allocator, on the real file system (the simulated disk keeps its files in memory).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use wal::{Wal, WalOptions};

/// The system allocator, counting the bytes live now.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: usize = 1024 * 1024;

/// One batch of 96 MiB (six records at most of the default record size, past the
/// default 16 MiB group): once it is durable and the caller dropped it, the log holds
/// about a group's buffer, not the batch's.
#[test]
fn the_writer_does_not_keep_a_buffer_the_size_of_its_largest_batch() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions::default();
    let keep = options.group_max_bytes + options.preallocate_bytes as usize;
    let wal = Wal::open(dir.path().join("wal"), options).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // A small append first, so that what the writer always keeps is in the baseline.
    rt.block_on(wal.append(vec![Bytes::from_static(b"warm")])).unwrap();
    let before = LIVE.load(Ordering::Relaxed);
    {
        let batch: Vec<Bytes> = (0..6).map(|i| Bytes::from(vec![i as u8; 16 * MIB])).collect();
        rt.block_on(wal.append(batch)).unwrap();
    }
    // The writer thread shrinks its buffer right after the write, before it answers.
    let after = LIVE.load(Ordering::Relaxed);
    let kept = after.saturating_sub(before);
    assert!(kept <= keep * 2, "the log keeps {} MiB after a 96 MiB batch (a group is {} MiB)", kept / MIB, keep / MIB);
    rt.block_on(wal.close()).unwrap();
}
