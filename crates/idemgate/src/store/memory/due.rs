//! [`Due`]: the filings of a [`super::table::Table`], earliest first.
//!
//! Filings mostly come in a few streams, each nearly in time order. With one record lifetime,
//! a claim files its row at now + ttl, and when that filing comes due the sweep files the row
//! again under its expiry, the completion's time + ttl: both streams' due times grow (the
//! second out of order only where an upstream answered a later request sooner). Each stream
//! goes into a run of its own (a queue, in time order) and comes out from the front: adding
//! and taking a filing touch the ends of a queue, where a heap of a few hundred thousand
//! filings would walk a path through memory that is no longer in the cache. A filing that
//! fits no run (it is earlier than the end of every run, and every run is in use: several
//! lifetimes, or refilings out of order) goes into a heap, so any order of filings is still
//! served earliest first; the gain is in how many fit a run.

use std::collections::{BinaryHeap, VecDeque};

use super::Tick;

/// Most runs kept: enough for the two streams of one or two record lifetimes.
const RUNS: usize = 4;

/// A row's place in the expiry order: slot `slot` comes due at `at`. Ordered so that the
/// earliest is the greatest, for `BinaryHeap`'s max-heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Filing {
    pub(super) at: Tick,
    pub(super) slot: u32,
}

impl Ord for Filing {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .at
            .cmp(&self.at)
            .then_with(|| other.slot.cmp(&self.slot))
    }
}

impl PartialOrd for Filing {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Filings, taken out earliest first.
#[derive(Default)]
pub(super) struct Due {
    /// Queues, each in time order (never a later filing before an earlier one).
    runs: Vec<VecDeque<Filing>>,
    /// Filings that fit no run.
    rest: BinaryHeap<Filing>,
    len: usize,
}

/// Where the earliest filing is.
#[derive(Clone, Copy)]
enum Place {
    Run(usize),
    Rest,
}

impl Due {
    /// Filings held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Adds `filing`: to the end of the run whose last filing is the latest not after it,
    /// else to an empty or a new run, else to the heap.
    pub(super) fn push(&mut self, filing: Filing) {
        let mut fit: Option<(usize, Tick)> = None;
        let mut empty = None;
        for (i, run) in self.runs.iter().enumerate() {
            match run.back() {
                Some(last) if last.at <= filing.at => {
                    if fit.is_none_or(|(_, at)| at < last.at) {
                        fit = Some((i, last.at));
                    }
                }
                Some(_) => {}
                None => empty = empty.or(Some(i)),
            }
        }
        self.len += 1;
        match (fit, empty) {
            (Some((i, _)), _) | (None, Some(i)) => self.runs[i].push_back(filing),
            (None, None) if self.runs.len() < RUNS => self.runs.push(VecDeque::from([filing])),
            (None, None) => self.rest.push(filing),
        }
    }

    /// The earliest filing, if any.
    pub(super) fn peek(&self) -> Option<Filing> {
        self.earliest().map(|(filing, _)| filing)
    }

    /// Takes out the earliest filing if it is due by `now`: one look for the sweep's peek and
    /// take.
    pub(super) fn pop_due(&mut self, now: Tick) -> Option<Filing> {
        let (filing, place) = self.earliest().filter(|(filing, _)| filing.at <= now)?;
        match place {
            Place::Run(i) => self.runs[i].pop_front(),
            Place::Rest => self.rest.pop(),
        };
        self.len -= 1;
        Some(filing)
    }

    /// Replaces every filing with `filings`, in any order.
    pub(super) fn replace(&mut self, mut filings: Vec<Filing>) {
        filings.sort_unstable_by_key(|filing| (filing.at, filing.slot));
        self.len = filings.len();
        self.runs = vec![VecDeque::from(filings)];
        self.rest = BinaryHeap::new();
    }

    /// Takes out the earliest filing.
    #[cfg(test)]
    pub(super) fn pop(&mut self) -> Option<Filing> {
        self.pop_due(Tick(u64::MAX))
    }

    /// Every filing, in no order.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = &Filing> {
        self.runs.iter().flatten().chain(self.rest.iter())
    }

    fn earliest(&self) -> Option<(Filing, Place)> {
        let mut best = self.rest.peek().map(|&filing| (filing, Place::Rest));
        for (i, run) in self.runs.iter().enumerate() {
            if let Some(&front) = run.front()
                && best.is_none_or(|(filing, _)| front > filing)
            {
                best = Some((front, Place::Run(i)));
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filing(at: u64, slot: u32) -> Filing {
        Filing { at: Tick(at), slot }
    }

    fn drain(due: &mut Due) -> Vec<u64> {
        std::iter::from_fn(|| due.pop()).map(|f| f.at.0).collect()
    }

    #[test]
    fn streams_in_order_take_a_run_each_and_come_out_merged() {
        let mut due = Due::default();
        // A claim stream 30 ahead and a completion stream 5 ahead, interleaved.
        for now in 0..100u64 {
            due.push(filing(now + 30, now as u32));
            due.push(filing(now + 5, now as u32));
        }
        assert_eq!(due.runs.len(), 2);
        assert!(due.rest.is_empty());
        let out = drain(&mut due);
        assert_eq!(out.len(), 200);
        assert!(out.is_sorted());
        assert_eq!(due.len(), 0);
    }

    #[test]
    fn any_order_comes_out_earliest_first() {
        // A fixed pseudo-random order, more streams than runs.
        let mut due = Due::default();
        let mut x = 12_345u64;
        let mut expected = Vec::new();
        for slot in 0..2_000u32 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let at = (x >> 33) % 500;
            expected.push(at);
            due.push(filing(at, slot));
            // Some taken out as they go, as a sweep would.
            if slot % 7 == 0 {
                let taken = due.pop().unwrap().at.0;
                let i = expected.iter().position(|&e| e == taken).unwrap();
                assert_eq!(expected.iter().min(), Some(&taken));
                expected.swap_remove(i);
            }
        }
        assert!(!due.rest.is_empty(), "the heap took what fit no run");
        assert_eq!(due.len(), expected.len());
        expected.sort_unstable();
        assert_eq!(drain(&mut due), expected);
    }

    #[test]
    fn replacing_leaves_one_run_in_order() {
        let mut due = Due::default();
        for at in [9, 1, 5] {
            due.push(filing(at, 0));
        }
        due.replace(vec![filing(7, 1), filing(3, 2), filing(3, 0)]);
        assert_eq!(due.len(), 3);
        assert_eq!(due.runs.len(), 1);
        let slots: Vec<u32> = std::iter::from_fn(|| due.pop()).map(|f| f.slot).collect();
        assert_eq!(slots, [0, 2, 1]);
    }
}
