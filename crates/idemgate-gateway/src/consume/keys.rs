//! Ordering per key: entries with the same key are delivered one after the other, in the
//! order they were read, never two at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// The keys being delivered, each with the entries waiting behind it. Holds only entries that
/// hold one of the source's `max_in_flight` permits, so it is bounded.
#[derive(Debug)]
pub(super) struct KeyQueues<J> {
    queues: Mutex<HashMap<String, VecDeque<J>>>,
}

impl<J> Default for KeyQueues<J> {
    fn default() -> Self {
        Self {
            queues: Mutex::default(),
        }
    }
}

impl<J> KeyQueues<J> {
    /// `job` for `key`: handed back when no entry with the key is being delivered (the caller
    /// delivers it now), else queued behind the one that is (`None`).
    pub(super) fn start_or_queue(&self, key: &str, job: J) -> Option<J> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        match queues.get_mut(key) {
            Some(waiting) => {
                waiting.push_back(job);
                None
            }
            None => {
                queues.insert(key.to_owned(), VecDeque::new());
                Some(job)
            }
        }
    }

    /// The next job for `key` once the one being delivered is done; `None` frees the key.
    pub(super) fn next(&self, key: &str) -> Option<J> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = queues.get_mut(key)?;
        let next = waiting.pop_front();
        if next.is_none() {
            queues.remove(key);
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_runs_one_job_at_a_time_in_order() {
        let queues = KeyQueues::default();
        assert_eq!(queues.start_or_queue("a", 1), Some(1));
        assert_eq!(queues.start_or_queue("b", 2), Some(2));
        assert_eq!(queues.start_or_queue("a", 3), None);
        assert_eq!(queues.start_or_queue("a", 4), None);
        assert_eq!(queues.next("a"), Some(3));
        assert_eq!(queues.next("a"), Some(4));
        assert_eq!(queues.next("a"), None);
        // Freed: the next job for the key starts at once.
        assert_eq!(queues.start_or_queue("a", 5), Some(5));
        assert_eq!(queues.next("b"), None);
    }
}
