//! Bounding the log lines that outside input can repeat at will: a failed
//! authentication, a refusal while the log is full, a record dropped for the destination
//! cap. Each such line is written at most once per interval per call site; the next one
//! written says how many were left out since (`suppressed`). The counters those events
//! also increment count every one of them.
//!
//! Invariants:
//! - The first event is always written; after that at most one line per interval.
//! - No event is lost from the count: each line carries the number left out before it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One call site's limit. Const-constructible, for a `static` beside the line it limits.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    state: Mutex<LimitState>,
}

#[derive(Debug)]
struct LimitState {
    last_written: Option<Instant>,
    suppressed: u64,
}

impl LogLimit {
    /// At most one line per `interval`.
    pub const fn every(interval: Duration) -> LogLimit {
        LogLimit { interval, state: Mutex::new(LimitState { last_written: None, suppressed: 0 }) }
    }

    /// `Some(n)` if this event's line is to be written, `n` being the events left out
    /// since the last line written; `None` if it is to be left out (and counted).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = s.last_written.is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            s.last_written = Some(now);
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed = s.suppressed.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_next_says_how_many_were_left_out() {
        let limit = LogLimit::every(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(limit.admit_at(t0), Some(0), "the first is written");
        for i in 1..1000u64 {
            assert_eq!(limit.admit_at(t0 + Duration::from_micros(i)), None);
        }
        assert_eq!(limit.admit_at(t0 + Duration::from_millis(999)), None);
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(1)), Some(1000), "999 and the one at 999 ms");
        assert_eq!(limit.admit_at(t0 + Duration::from_millis(1500)), None);
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(3)), Some(1));
        // A clock read out of order (another thread's earlier reading) is not due.
        assert_eq!(limit.admit_at(t0), None);
    }
}
