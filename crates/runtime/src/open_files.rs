//! The daemon's open files against the process's limit (`RLIMIT_NOFILE`).
//!
//! Every connection is an open file, and so is every segment of the log (it keeps each
//! one open) and every connection to Iggy. A process that runs out of descriptors can
//! neither accept a connection nor rotate the log (every append refused with 503), and
//! many systems start a service with a soft limit of 1024, the default
//! `http.max_connections` alone.
//!
//! Invariants:
//! - At start the soft limit is raised to what the configuration may open
//!   ([`files_needed`]), up to the hard limit; it is never lowered. (Go's runtime raises
//!   it to the hard limit for the same reason.)
//! - When even the hard limit is short, the daemon still starts (its bounds are maxima
//!   it may never reach) and says so once, naming `http.max_connections`, at warn level.

use crate::config::Settings;

/// Descriptors besides connections, segments and Iggy connections: the listeners, the
/// admin listener's connections (at most 64), the state database, the log's directory
/// and lock, the runtime's own (epoll, eventfd), standard streams, and room to spare.
const FILES_BESIDES: u64 = 256;

/// What the configuration may hold open at once: every webhook connection, two files
/// per log segment (a segment can be as little as half full, so a full log holds up to
/// twice `wal.max_bytes / wal.segment_max_bytes` of them), a connection to Iggy per
/// concurrent destination of every configured source (each has its own send slots, its
/// own policy's or the default's) and of the sources found only in the log (counted once,
/// at the default), and [`FILES_BESIDES`].
pub fn files_needed(settings: &Settings) -> u64 {
    let segments = settings.wal.max_bytes / settings.wal.segment_max_bytes.max(1);
    let policies = &settings.delivery.policies;
    let iggy_connections: u64 = settings
        .sources
        .iter()
        .map(|source| policies.for_source(&source.key).max_concurrent_destinations as u64)
        .chain(std::iter::once(policies.default.max_concurrent_destinations as u64))
        .fold(0u64, u64::saturating_add);
    (settings.max_connections as u64)
        .saturating_add(segments.saturating_mul(2))
        .saturating_add(iggy_connections)
        .saturating_add(FILES_BESIDES)
}

/// The process's open-file limits before and after [`raise_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFilesLimit {
    pub needed: u64,
    pub soft_before: u64,
    pub soft: u64,
    pub hard: u64,
}

/// The soft limit to set: `needed` if the hard limit allows, else the hard limit; never
/// below `soft` as it is.
pub fn soft_limit_for(needed: u64, soft: u64, hard: u64) -> u64 {
    soft.max(needed.min(hard))
}

/// Raises the soft open-file limit for `settings` (see the module doc) and logs what it
/// did. An error reading or setting the limit is logged and changes nothing.
pub fn raise_for(settings: &Settings) -> Option<OpenFilesLimit> {
    let needed = files_needed(settings);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit with a valid pointer to a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open-file limit");
        return None;
    }
    let (soft_before, hard) = (lim.rlim_cur, lim.rlim_max);
    let wanted = soft_limit_for(needed, soft_before, hard);
    let mut soft = soft_before;
    if wanted > soft_before {
        let raised = libc::rlimit { rlim_cur: wanted, rlim_max: hard };
        // SAFETY: setrlimit with a valid pointer to a local struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            soft = wanted;
        } else {
            tracing::warn!(error = %std::io::Error::last_os_error(), wanted, "cannot raise the open-file limit");
        }
    }
    let limit = OpenFilesLimit { needed, soft_before, soft, hard };
    if soft < needed {
        tracing::warn!(
            open_files_limit = soft,
            needed,
            max_connections = settings.max_connections,
            "the open-file limit is below what http.max_connections, the log's segments and the router's \
             connections may open: past it connections are refused and the log cannot rotate (raise LimitNOFILE, \
             or lower http.max_connections)"
        );
    } else {
        tracing::info!(?limit, "open-file limit");
    }
    Some(limit)
}

/// Raises the soft open-file limit to the hard limit: for the log tools, which hold
/// every segment of the log open (and `verify` each one twice while it checks it), so
/// that a log of more segments than a shell's usual soft limit of 1024 is read, not
/// refused with "Too many open files" (a failure `verify` would report as exit 1). A
/// refusal changes nothing: the tool runs on the limit it has.
pub fn raise_to_hard() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit with a valid pointer to a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= lim.rlim_max {
        return;
    }
    let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
    // SAFETY: setrlimit with a valid pointer to a local struct.
    let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_need_within_the_hard_limit_and_never_lowered() {
        assert_eq!(soft_limit_for(2_000, 1_024, 1_048_576), 2_000);
        assert_eq!(soft_limit_for(2_000, 1_024, 1_500), 1_500);
        assert_eq!(soft_limit_for(2_000, 4_096, 1_048_576), 4_096);
    }

    #[test]
    fn the_builtin_default_needs_more_than_a_common_soft_limit_of_1024() {
        let settings = crate::config::validate(&crate::config::Config::builtin(), None, None).unwrap();
        let needed = files_needed(&settings);
        assert!(needed > 1_024, "{needed}");
        assert!(needed >= settings.max_connections as u64 + FILES_BESIDES, "{needed}");
    }

    #[test]
    fn every_source_counts_its_own_iggy_connections_with_or_without_a_policy_of_its_own() {
        let mut settings = crate::config::validate(&crate::config::Config::builtin(), None, None).unwrap();
        let one_source = files_needed(&settings);
        let mut second = settings.sources[0].clone();
        second.key = "second".into();
        settings.sources.push(second);
        let per_source = settings.delivery.policies.default.max_concurrent_destinations as u64;
        assert_eq!(files_needed(&settings), one_source + per_source, "a source without a policy of its own");
        let mut own = (*settings.delivery.policies.default).clone();
        own.max_concurrent_destinations = per_source as usize + 100;
        settings.delivery.policies.sources.insert("second".into(), std::sync::Arc::new(own));
        assert_eq!(files_needed(&settings), one_source + per_source + 100, "a source with a policy of its own");
    }
}
