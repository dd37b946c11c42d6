//! The clock the store judges deadlines on.

use std::time::{Duration, Instant, SystemTime};

use crate::record::unix_millis;

pub(super) fn now_ms() -> u64 {
    unix_millis(SystemTime::now())
}

/// The clock the writer judges every deadline on: wall-clock milliseconds read once, when the
/// store opened, advanced from then on by the monotonic clock. A step of the wall clock
/// while the store is open (NTP, a virtual machine resumed) moves no lease or expiry; a
/// record's deadlines outlive the process in the file as wall-clock times, and in-flight
/// records found at open are given a whole lease from then on (see `attach`).
#[derive(Clone, Copy)]
pub(super) struct Clock {
    pub(super) wall_at_open: u64,
    pub(super) opened: Instant,
}

impl Clock {
    pub(super) fn start() -> Self {
        Self {
            wall_at_open: now_ms(),
            opened: Instant::now(),
        }
    }

    pub(super) fn now(&self) -> u64 {
        after(self.wall_at_open, self.opened.elapsed())
    }
}

/// Whole milliseconds of `d`, truncated (deadlines are kept in milliseconds).
pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

pub(super) fn after(now: u64, d: Duration) -> u64 {
    now.saturating_add(millis(d))
}
