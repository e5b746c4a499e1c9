//! Wall-clock helpers. Receive times are Unix milliseconds; a clock before 1970 reads 0.

use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now.
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The time by which what expires by the wall clock is deleted (delivery ids past their
/// window, swept by the idempotency checkpoints): the wall clock, except that it moves
/// forward no faster than the monotonic clock runs. A forward step of the wall clock (a
/// bad time source, later stepped back) would otherwise delete at once, for good, every
/// id the step made look old; with this clock the sweep waits for the time to pass.
/// A step back is followed at once (nothing is deleted early by it). After a correction
/// of a clock that ran behind, the sweep lags the wall clock by the correction for the
/// rest of the run: ids stamped by the slow clock still get their whole window, later
/// ones a little more. A new process starts from the wall clock.
///
/// The time is counted from one anchor (a wall-clock reading and the instant it was
/// taken), moved only when the wall clock reads less than the count: counted from the
/// last reading instead, each reading's fraction of a millisecond was dropped for good,
/// and the sweep fell behind the wall clock by some 40 s a day at one checkpoint a second.
#[derive(Debug, Default)]
pub struct SweepClock {
    anchor: Mutex<Option<(u64, Instant)>>,
}

impl SweepClock {
    pub fn new() -> SweepClock {
        SweepClock::default()
    }

    /// The sweep's time now, in Unix milliseconds.
    pub fn now_unix_ms(&self) -> u64 {
        self.at(now_unix_ms(), Instant::now())
    }

    /// The sweep's time when the wall clock read `wall_unix_ms` at `at`.
    pub fn at(&self, wall_unix_ms: u64, at: Instant) -> u64 {
        let mut anchor = self.anchor.lock().unwrap_or_else(|p| p.into_inner());
        let counted = anchor.map(|(anchor_ms, anchor_at)| {
            let passed_ms = u64::try_from(at.saturating_duration_since(anchor_at).as_millis()).unwrap_or(u64::MAX);
            anchor_ms.saturating_add(passed_ms)
        });
        match counted {
            Some(counted) if counted <= wall_unix_ms => counted,
            // The first reading, or the wall clock below the count (a step back): followed.
            _ => {
                *anchor = Some((wall_unix_ms, at));
                wall_unix_ms
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_sweep_clock_follows_a_step_back_at_once_and_a_step_forward_only_as_time_passes() {
        let clock = SweepClock::new();
        let t0 = Instant::now();
        let day_ms = 86_400_000;
        assert_eq!(clock.at(1_000_000, t0), 1_000_000, "it starts at the wall clock");
        assert_eq!(clock.at(1_001_000, t0 + Duration::from_secs(1)), 1_001_000, "in step while the wall is");
        // The wall clock steps a day ahead: the sweep moves on by the second that passed.
        assert_eq!(clock.at(1_002_000 + day_ms, t0 + Duration::from_secs(2)), 1_002_000);
        assert_eq!(clock.at(1_003_000 + day_ms, t0 + Duration::from_secs(3)), 1_003_000);
        // Stepped back to the right time: in step again.
        assert_eq!(clock.at(1_004_000, t0 + Duration::from_secs(4)), 1_004_000);
        // A step back is followed at once.
        assert_eq!(clock.at(900_000, t0 + Duration::from_secs(5)), 900_000);
        assert_eq!(clock.at(901_000, t0 + Duration::from_secs(6)), 901_000);
    }

    /// Read at instants that are not whole milliseconds apart (a checkpoint every second
    /// or so), the sweep keeps to the wall clock: it lost each reading's fraction of a
    /// millisecond, 6 s over these 10,000 readings, some 40 s a day.
    #[test]
    fn the_sweep_clock_does_not_fall_behind_a_wall_clock_in_step() {
        let clock = SweepClock::new();
        let t0 = Instant::now();
        let start_ms = 1_700_000_000_000u64;
        let mut swept = 0;
        let mut wall = start_ms;
        for i in 0..10_000u64 {
            let passed = Duration::from_micros(i * 1_000_600);
            wall = start_ms + u64::try_from(passed.as_millis()).unwrap();
            swept = clock.at(wall, t0 + passed);
        }
        assert!(wall - swept <= 1, "the sweep is {} ms behind the wall clock", wall - swept);
    }
}
