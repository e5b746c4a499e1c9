//! Bounding the log lines that outside input can repeat at will: a failed
//! authentication, a refusal while the log is full, a record dropped for the destination
//! cap. Each such line is written at most once per interval per call site; the next one
//! written says how many were left out since (`suppressed`). The counters those events
//! also increment count every one of them.
//!
//! Invariants:
//! - The first event is always written; after that at most one line per interval.
//! - No event is lost from the count: each line carries the number left out before it,
//!   and, where events are numbered ([`LogLimit::admit_numbered`], a record's offset),
//!   the first and the last of them.

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
    /// The numbers of the first and the last event left out since the last line.
    suppressed_span: Option<(u64, u64)>,
}

/// What was left out since the last line written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suppressed {
    pub count: u64,
    /// The first and the last number of those left out ([`LogLimit::admit_numbered`]).
    pub span: Option<(u64, u64)>,
}

impl Suppressed {
    /// The first and the last number left out, each `None` when none was numbered: the
    /// two fields a log line carries.
    pub fn first_last(&self) -> (Option<u64>, Option<u64>) {
        self.span.map_or((None, None), |(f, l)| (Some(f), Some(l)))
    }
}

impl LogLimit {
    /// At most one line per `interval`.
    pub const fn every(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            state: Mutex::new(LimitState { last_written: None, suppressed: 0, suppressed_span: None }),
        }
    }

    /// `Some(n)` if this event's line is to be written, `n` being the events left out
    /// since the last line written; `None` if it is to be left out (and counted).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        self.admit_numbered_at(now, None).map(|s| s.count)
    }

    /// [`LogLimit::admit`] for an event numbered `n` (a record's offset): the line
    /// written also names the first and the last number left out since the last line.
    pub fn admit_numbered(&self, n: u64) -> Option<Suppressed> {
        self.admit_numbered_at(Instant::now(), Some(n))
    }

    /// The events left out since the last line, once the interval has passed since it:
    /// for a caller that writes them on a line of their own when no further event came
    /// to carry them (the end of a burst). `None` when there are none, or it is too soon.
    pub fn flush_due(&self) -> Option<Suppressed> {
        self.flush_due_at(Instant::now())
    }

    fn flush_due_at(&self, now: Instant) -> Option<Suppressed> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = s.last_written.is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if s.suppressed == 0 || !due {
            return None;
        }
        s.last_written = Some(now);
        Some(Suppressed { count: std::mem::take(&mut s.suppressed), span: s.suppressed_span.take() })
    }

    fn admit_numbered_at(&self, now: Instant, n: Option<u64>) -> Option<Suppressed> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = s.last_written.is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            s.last_written = Some(now);
            Some(Suppressed { count: std::mem::take(&mut s.suppressed), span: s.suppressed_span.take() })
        } else {
            s.suppressed = s.suppressed.saturating_add(1);
            if let Some(n) = n {
                s.suppressed_span = Some(s.suppressed_span.map_or((n, n), |(first, _)| (first, n)));
            }
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

    #[test]
    fn a_numbered_line_names_the_first_and_last_number_left_out() {
        let limit = LogLimit::every(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(limit.admit_numbered_at(t0, Some(7)), Some(Suppressed { count: 0, span: None }));
        for offset in 8..=20 {
            assert_eq!(limit.admit_numbered_at(t0 + Duration::from_millis(offset), Some(offset)), None);
        }
        let line = limit.admit_numbered_at(t0 + Duration::from_secs(1), Some(21));
        assert_eq!(line, Some(Suppressed { count: 13, span: Some((8, 20)) }));
        assert_eq!(
            limit.admit_numbered_at(t0 + Duration::from_secs(2), Some(22)),
            Some(Suppressed { count: 0, span: None })
        );
    }

    /// The end of a burst: what was left out is given to a flush once the interval has
    /// passed, and only once; a flush with nothing left out gives nothing.
    #[test]
    fn a_flush_gives_what_no_later_line_carried() {
        let limit = LogLimit::every(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(limit.flush_due_at(t0), None);
        assert!(limit.admit_numbered_at(t0, Some(1)).is_some());
        assert_eq!(limit.admit_numbered_at(t0 + Duration::from_millis(10), Some(2)), None);
        assert_eq!(limit.admit_numbered_at(t0 + Duration::from_millis(20), Some(5)), None);
        assert_eq!(limit.flush_due_at(t0 + Duration::from_millis(500)), None, "too soon");
        let flushed = limit.flush_due_at(t0 + Duration::from_secs(1));
        assert_eq!(flushed, Some(Suppressed { count: 2, span: Some((2, 5)) }));
        assert_eq!(limit.flush_due_at(t0 + Duration::from_secs(5)), None, "given once");
    }
}
