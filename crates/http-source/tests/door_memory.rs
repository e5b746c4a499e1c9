//! Memory a request costs at the door: reading its body must never hold a buffer past
//! `max_body_bytes`, and reading the fields routing needs must not build the whole event
//! in memory. Counted with this test binary's own allocator; the tests take turns, as
//! each counts every thread's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_source::body::{Accept, decode_with};
use http_source::field_path::FieldPath;

/// The system allocator, counting the bytes live now and the most live since a reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The largest single allocation since a reset.
static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// Held by each test for its whole run.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
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
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
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

/// What reading the routed fields keeps per event is within
/// `json_fields::kept_bytes_max` (which the door's room counts) and the body's length
/// for the strings at the paths' ends, at the deepest paths a route allows: an NDJSON
/// batch of events nested 32 objects deep on two paths that part at the top. Each kept
/// object is a `serde_json::Map`'s B-tree node: counted at less, as the room counted it
/// before, a batch of such events held many times the room it took.
#[test]
fn what_routing_keeps_per_event_is_within_the_bound_the_room_counts() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    use http_source::field_path::FIELD_PATH_MAX_SEGMENTS;
    use http_source::json_fields::kept_bytes_max;
    let depth = FIELD_PATH_MAX_SEGMENTS;
    let nested = |key: &str, leaf: &str| {
        let open: String = (0..depth - 1).map(|_| format!(r#"{{"{key}":"#)).collect();
        format!(r#"{open}"{leaf}"{}"#, "}".repeat(depth - 1))
    };
    let event = format!(r#"{{"a":{},"b":{}}}"#, nested("a", "orders"), nested("b", "k1"));
    let topic = FieldPath::parse(&vec!["a"; depth].join(".")).unwrap();
    let key = FieldPath::parse(&vec!["b"; depth].join(".")).unwrap();
    let events = 1000;
    let body = Bytes::from(format!("{event}\n").repeat(events));
    let body_len = body.len();
    let decoded = decode_with(Some("application/x-ndjson"), body, Accept::Json, &[&topic, &key], events).unwrap();
    let values = decoded.values.expect("the fields were kept");
    assert_eq!(topic.lookup(&values[events - 1]).as_deref(), Some("orders"));
    assert_eq!(key.lookup(&values[0]).as_deref(), Some("k1"));
    let before = LIVE.load(Ordering::Relaxed);
    drop(values);
    let held = before - LIVE.load(Ordering::Relaxed);
    let bound = events * kept_bytes_max(&[&topic, &key]) + body_len;
    assert!(held <= bound, "{events} events kept {held} bytes; the room counts {bound}");
    // The bound is not slack enough to hide a miscount: half an object per key is not.
    let objects = events * 2 * depth;
    assert!(held > objects * http_source::json_fields::KEPT_OBJECT_MAX_BYTES / 2, "{held} bytes for {objects} objects");
}

/// A chunked body (no length announced) of exactly `max` bytes, in pieces as a client
/// may send it: a few bytes, then 4 KiB at a time.
struct ChunkedPieces {
    left: usize,
    next_len: usize,
}

impl hyper::body::Body for ChunkedPieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        let len = self.next_len.min(self.left);
        self.left -= len;
        self.next_len = 4096;
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(vec![b'x'; len])))))
    }
}

/// A chunked body read in pieces is joined into one buffer that never grows past
/// `max_body_bytes`. Grown by `Vec`'s own doubling, it could end past the limit, up to
/// twice it (this test's 1 MiB body, in pieces of 3, 3 and 4,096 bytes: 1,049,344), for
/// each of the connections the door admits, before any authentication.
#[test]
fn a_chunked_body_read_in_pieces_is_joined_in_a_buffer_no_larger_than_the_limit() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for max in [1 << 20, 1_000_003, 64 * 1024 + 1] {
        let body = axum::body::Body::new(ChunkedPieces { left: max, next_len: 3 });
        LARGEST.store(0, Ordering::Relaxed);
        let read = runtime.block_on(http_source::door::read_body(body, max, std::time::Duration::from_secs(5)));
        let read = read.unwrap();
        let largest = LARGEST.load(Ordering::Relaxed);
        assert_eq!(read.len(), max);
        assert!(read.iter().all(|&b| b == b'x'));
        assert!(largest <= max, "a body of {max} bytes was joined in a buffer of {largest} bytes");
        assert!(largest >= max, "the body is held in one buffer: largest allocation {largest} of {max}");
    }
}
