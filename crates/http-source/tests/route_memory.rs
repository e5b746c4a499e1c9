//! Memory a routed request costs at the door: reading the fields routing needs must not
//! build the whole event in memory. Counted with this test binary's own allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_source::body::{Accept, decode_with};
use http_source::field_path::FieldPath;

/// The system allocator, counting the bytes live now and the most live since a reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
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

/// The most bytes allocated at once above what was live before `f` ran.
fn peak_above_start(f: impl FnOnce()) -> usize {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - start
}

/// A 1 MiB JSON event whose routing field sits beside half a million numbers (as a
/// fully parsed value, 16 MiB and more of nodes), single and as an NDJSON batch.
#[test]
fn reading_a_routed_events_fields_costs_memory_by_the_fields_not_by_the_event() {
    let numbers = "0,".repeat(512 * 1024);
    let event = format!(r#"{{"event": {{"type": "order.created"}}, "pad": [{numbers}0]}}"#);
    let body_len = event.len();
    let path = FieldPath::parse("event.type").unwrap();
    for content_type in ["application/json", "application/x-ndjson"] {
        let body = Bytes::from(event.clone());
        let mut decoded = None;
        let peak = peak_above_start(|| {
            decoded = Some(decode_with(Some(content_type), body, Accept::Json, &[&path], 10).unwrap());
        });
        let values = decoded.and_then(|d| d.values).expect("the fields were kept");
        assert_eq!(path.lookup(&values[0]).as_deref(), Some("order.created"), "{content_type}");
        // The body itself is already in memory (and shared, not copied); what decoding
        // adds is a few small allocations.
        assert!(peak < body_len / 16, "{content_type}: decoding a {body_len}-byte event took {peak} bytes at its peak");
    }
}
