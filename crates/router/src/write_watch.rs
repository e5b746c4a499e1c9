//! What the lanes' sends tell about the server's writes: whether a send cut short by
//! its result timeout went unanswered because of its destination, or because the server
//! answers no write at all (a node that lost its quorum, a server not caught up: it
//! still answers pings and reads, and the `iggy` client replays its "not ready" answers
//! inside itself, so the router only ever sees the timeout).
//!
//! Invariants:
//! - A write counts as answered only when a send was acknowledged. A ping, a sign-in, a
//!   topic read or a successful ensure (which may only have read) is not a write; nor is
//!   a refusal, which the client may make itself (a name it cannot encode) and a server
//!   that writes nothing may still give (it validates before it replicates).
//! - A send cut short while some write was answered in the last part of its wait (the
//!   last quarter, as the lane's `bounded` judges any answer) or since is its
//!   destination's (the server writes, only not there): its breaker counts it. A write
//!   answered earlier in its wait says nothing of a server that stopped writing since:
//!   judged by it, every send waiting when the stall began was counted, one breaker
//!   each.
//! - Once sends to two different destinations were cut short with no write answered
//!   in between (whatever the lane took each cut for: a timeout, or the server's when the
//!   sink was connecting or the server answered nothing; each is a write unanswered),
//!   the server is taken to stall its writes, until a write is answered:
//!   meanwhile a send cut short with no write answered in the last part of its wait (or
//!   since) is the server's, and no breaker counts it. So a server that stalls every write costs at most the
//!   first of those timeouts to one breaker, while a destination that stalls alone
//!   beside others being written opens its own. (With one destination sending, the two
//!   cannot be told apart, and the lane's older check decides: whether the server
//!   answers at all.)
//! - Two destinations silent alone on a server that writes, while no other destination
//!   has anything acknowledged in the last part of their waits, look exactly like a
//!   stall and are taken for one: their records are held and retried as in an outage and
//!   reported Degraded, only no breaker opens. The first acknowledged send of any
//!   destination ends it. Beside destinations that are written only now and then (less
//!   often than a quarter of the result timeout), two silent ones are taken for a stall
//!   more often than beside busy ones: the price of never counting a real stall against
//!   every destination waiting when it began.
//! - The watch holds two instants, a flag and one destination: nothing grows.

use std::sync::Mutex;
use std::time::Instant;

use crate::sink::DestinationKey;

#[derive(Debug, Default)]
pub(crate) struct WriteWatch {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last_answered: Option<Instant>,
    /// The last send cut short with no write answered since, and its destination.
    last_unanswered: Option<(Instant, DestinationKey)>,
    stalled: bool,
}

impl WriteWatch {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A send was acknowledged: the server writes.
    pub(crate) fn answered(&self) {
        let mut s = self.state();
        s.last_answered = Some(Instant::now());
        s.last_unanswered = None;
        s.stalled = false;
    }

    /// True if some send got the server's answer at or after `since`.
    #[cfg(test)]
    fn answered_since(&self, since: Instant) -> bool {
        self.state().last_answered.is_some_and(|t| t >= since)
    }

    /// A send to `dest` was cut short by its result timeout; a write answered at or
    /// after `recently` (the last part of its wait) shows the server writing at its end.
    /// Returns true if the server is taken to stall its writes (see the module doc): the
    /// timeout is then not the destination's.
    pub(crate) fn unanswered(&self, dest: &DestinationKey, recently: Instant) -> bool {
        let mut s = self.state();
        if s.last_answered.is_some_and(|t| t >= recently) {
            // The server wrote at the end of this send's wait: the silence is its
            // destination's.
            return false;
        }
        if s.last_unanswered.as_ref().is_some_and(|(_, other)| other != dest) {
            s.stalled = true;
        }
        s.last_unanswered = Some((Instant::now(), dest.clone()));
        s.stalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_destinations_unanswered_with_no_write_between_is_the_server_stalling_until_a_write() {
        let watch = WriteWatch::default();
        let (a, b) = (DestinationKey::new("s", "a"), DestinationKey::new("s", "b"));
        assert!(!watch.unanswered(&a, Instant::now()), "one destination alone is not told apart");
        assert!(!watch.unanswered(&a, Instant::now()), "nor the same one twice");
        assert!(watch.unanswered(&b, Instant::now()), "a second destination unanswered meanwhile");
        // Stalled, whichever destination, however long after, until a write is answered.
        assert!(watch.unanswered(&a, Instant::now()));
        assert!(watch.unanswered(&a, Instant::now()));
        watch.answered();
        assert!(!watch.unanswered(&b, Instant::now()));
    }

    #[test]
    fn a_write_answered_while_a_send_waited_makes_its_timeout_its_destinations() {
        let watch = WriteWatch::default();
        let (a, b) = (DestinationKey::new("s", "a"), DestinationKey::new("s", "b"));
        let started = Instant::now();
        assert!(!watch.unanswered(&a, started));
        watch.answered();
        assert!(watch.answered_since(started));
        assert!(!watch.unanswered(&b, started), "the server wrote meanwhile");
        // A write answered before the last part of a send's wait is not counted.
        let watch = WriteWatch::default();
        watch.answered();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let recently = Instant::now();
        assert!(!watch.unanswered(&a, recently), "one destination alone is not told apart");
        assert!(watch.unanswered(&b, recently), "an early write ended no stall");
        // An answer between two timeouts of different destinations: not a stall.
        let watch = WriteWatch::default();
        assert!(!watch.unanswered(&a, Instant::now()));
        watch.answered();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(!watch.unanswered(&b, Instant::now()));
    }
}
