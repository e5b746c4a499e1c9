//! Fail points: named places in the daemon where a test can make the process die, to
//! prove what survives a crash exactly there, or make one task panic, to prove the
//! daemon notices.
//!
//! `fail_point!("name")` expands to nothing unless this crate's `enabled` feature is on,
//! so a build without it (every release build) carries no code and no check. With the
//! feature, the call compares `name` with the point named by the environment and, on the
//! chosen hit, kills the process with `SIGKILL`, exactly as `kill -9` would: no
//! destructor, no flush, no clean-shutdown marker. With the `panic` action it panics
//! instead, on the thread that hit the point: only that task unwinds. With the `hang`
//! action that thread never returns from the point (it sleeps for ever), as a thread
//! whose `fdatasync` a failing disk never answers: the rest of the process goes on.
//!
//! The environment, read once per process:
//!
//! | variable | meaning |
//! |---|---|
//! | `IGGY_INGEST_FAIL_POINT` | the point to arm (one of [`POINTS`]); unset: nothing is armed |
//! | `IGGY_INGEST_FAIL_POINT_HIT` | die on this hit of the point (1 = the first, the default) |
//! | `IGGY_INGEST_FAIL_POINT_ACTION` | `kill` (the default), `panic` or `hang` |
//!
//! Before acting the process writes `fail point NAME: hit N, killing the process` (or
//! `panicking`, or `hanging`) to stderr, so a test can tell the death it caused from any other.

/// Every fail point, with the moment it stands for.
pub const POINTS: &[(&str, &str)] = &[
    ("wal.append.written", "the log wrote a group of appends and has not synced them"),
    ("door.append.synced", "an append was synced and its 200 not yet answered"),
    ("ingest.appended", "a keyed request's events were appended and its delivery id not yet recorded"),
    (
        "idempotency.record",
        "the recorder is about to commit delivery ids whose requests may already have been answered",
    ),
    ("router.send", "a batch is about to be handed to the destination's client"),
    ("router.acked", "a destination acknowledged records and their cursor is not yet stored"),
    ("wal.release.removed", "a released segment file was removed and the directory not yet synced"),
    ("listener.accept", "a listener accepted a connection and has not yet served it"),
    ("listener.drain", "a listener stopped taking connections and has not yet drained its open ones"),
    ("wal.close", "the log's writer is about to make its last sync and write the clean-shutdown marker"),
];

/// Dies here when the environment armed this point and this is the chosen hit.
#[cfg(feature = "enabled")]
#[macro_export]
macro_rules! fail_point {
    ($name:literal) => {
        $crate::hit($name)
    };
}

/// Nothing: the `enabled` feature is off.
#[cfg(not(feature = "enabled"))]
#[macro_export]
macro_rules! fail_point {
    ($name:literal) => {};
}

#[cfg(feature = "enabled")]
mod armed {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct Armed {
        name: String,
        nth: u64,
        action: Action,
        hits: AtomicU64,
    }

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Action {
        Kill,
        Panic,
        Hang,
    }

    fn armed() -> Option<&'static Armed> {
        static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
        ARMED
            .get_or_init(|| {
                let name = std::env::var("IGGY_INGEST_FAIL_POINT").ok().filter(|n| !n.is_empty())?;
                if !super::POINTS.iter().any(|(p, _)| *p == name) {
                    eprintln!("fail point {name}: no such point; nothing is armed");
                    return None;
                }
                let nth = std::env::var("IGGY_INGEST_FAIL_POINT_HIT").ok().and_then(|v| v.parse::<u64>().ok());
                let action = match std::env::var("IGGY_INGEST_FAIL_POINT_ACTION").ok().as_deref() {
                    None | Some("" | "kill") => Action::Kill,
                    Some("panic") => Action::Panic,
                    Some("hang") => Action::Hang,
                    Some(other) => {
                        eprintln!("fail point {name}: no such action {other:?} (kill, panic, hang); nothing is armed");
                        return None;
                    }
                };
                Some(Armed { name, nth: nth.unwrap_or(1).max(1), action, hits: AtomicU64::new(0) })
            })
            .as_ref()
    }

    /// Called by `fail_point!`.
    pub fn hit(name: &'static str) {
        let Some(a) = armed() else { return };
        if a.name != name {
            return;
        }
        let n = a.hits.fetch_add(1, Ordering::AcqRel) + 1;
        if n != a.nth {
            return;
        }
        match a.action {
            Action::Kill => {}
            Action::Panic => {
                eprintln!("fail point {name}: hit {n}, panicking");
                panic!("fail point {name}: hit {n}");
            }
            Action::Hang => {
                eprintln!("fail point {name}: hit {n}, hanging");
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
        }
        eprintln!("fail point {name}: hit {n}, killing the process");
        // SAFETY: kill(2) on this process's own pid; SIGKILL cannot be caught.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // SIGKILL is delivered before kill(2) returns to this process; should it not be,
        // never go on past the point.
        std::process::abort();
    }
}

#[cfg(feature = "enabled")]
pub use armed::hit;
