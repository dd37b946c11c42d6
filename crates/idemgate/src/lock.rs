//! Locking a mutex whose holders cannot leave its data half-changed.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, taking a poisoned lock as it is. Only for locks whose every critical section
/// either completes its change or makes none (a few infallible collection operations), so a
/// panic elsewhere in the holder's thread cannot have left the data half-changed; each caller
/// says why its lock is one.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
