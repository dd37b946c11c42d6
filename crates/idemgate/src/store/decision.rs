//! What a claim does about the record it finds: the one decision table the memory and redb
//! stores share (the Redis store's Lua script makes the same decisions inside Redis).
//!
//! The decision is pure: the store reads its record, describes it as a [`Found`], and acts on
//! the [`ClaimStep`] it gets back. What a store keeps (its clock, its handle on a record, its
//! completed responses) passes through untouched, so deciding costs no allocation and no
//! copy.

use std::time::Duration;

use super::{Claim, UnknownOutcome};

/// A point on a store's clock.
pub(crate) trait Moment: Ord + Copy {
    /// The time from `self` to a `later` point (zero if it is not later).
    fn until(self, later: Self) -> Duration;
}

/// Milliseconds, the unit the stores keep times in (see [`crate::record::unix_millis`]).
impl Moment for u64 {
    fn until(self, later: Self) -> Duration {
        Duration::from_millis(later.saturating_sub(self))
    }
}

/// A record a claim found under its key, as the decision sees it.
///
/// `T` is the store's time, `R` the store's handle on the record (handed back by every step
/// that acts on it), `C` what the store keeps of a completed response (handed back by a
/// replay).
pub(crate) struct Found<T, R, C> {
    /// The store's handle on the record.
    pub(crate) record: R,
    /// When the record expires; it is live until then.
    pub(crate) expires: T,
    /// Whether the record's fingerprint is the claim's.
    pub(crate) same_fingerprint: bool,
    /// The record's state.
    pub(crate) state: Held<T, C>,
}

/// The state of a found record.
pub(crate) enum Held<T, C> {
    /// A request is running under a lease that ends at `lease_deadline`.
    InFlight { lease_deadline: T },
    /// The request ran; its kept response.
    Completed(C),
    /// The request's outcome is unknown.
    Ambiguous,
}

/// What a claim does.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ClaimStep<R, C> {
    /// Answer without a change.
    Answer(Claim),
    /// Answer with the found record's completed response.
    Replay { record: R, completion: C },
    /// Write a fresh in-flight record under the claim's token, in place of the expired or
    /// lapsed record it `replaces` (if one was found).
    Acquire { replaces: Option<R> },
    /// Turn the found in-flight record, whose lease lapsed, ambiguous (keeping its
    /// fingerprint, living the claim's ttl from now), then answer.
    MakeAmbiguous { record: R, answer: Claim },
}

/// What a claim that finds `found` at `now` does, when a lapsed lease turns into `on_lapse`.
///
/// | found                                 | same fingerprint          | other fingerprint        |
/// |---------------------------------------|---------------------------|--------------------------|
/// | nothing, or an expired record         | acquire                   | acquire                  |
/// | in flight, lease live                 | in flight (time left)     | mismatch                 |
/// | in flight, lease lapsed, `Retry`      | acquire                   | acquire                  |
/// | in flight, lease lapsed, `Ambiguous`  | make ambiguous, ambiguous | make ambiguous, mismatch |
/// | completed                             | replay                    | mismatch                 |
/// | ambiguous                             | ambiguous                 | mismatch                 |
///
/// A record is live while `now < expires`, a lease while `now < lease_deadline`.
#[inline]
pub(crate) fn decide<T: Moment, R, C>(
    found: Option<Found<T, R, C>>,
    on_lapse: UnknownOutcome,
    now: T,
) -> ClaimStep<R, C> {
    let Some(found) = found else {
        return ClaimStep::Acquire { replaces: None };
    };
    if found.expires <= now {
        return ClaimStep::Acquire {
            replaces: Some(found.record),
        };
    }
    let same = found.same_fingerprint;
    match found.state {
        Held::InFlight { lease_deadline } if lease_deadline > now => ClaimStep::Answer(if same {
            Claim::InFlight {
                lease_remaining: now.until(lease_deadline),
            }
        } else {
            Claim::Mismatch
        }),
        Held::InFlight { .. } => match on_lapse {
            UnknownOutcome::Retry => ClaimStep::Acquire {
                replaces: Some(found.record),
            },
            UnknownOutcome::Ambiguous => ClaimStep::MakeAmbiguous {
                record: found.record,
                answer: if same {
                    Claim::Ambiguous
                } else {
                    Claim::Mismatch
                },
            },
        },
        _ if !same => ClaimStep::Answer(Claim::Mismatch),
        Held::Completed(completion) => ClaimStep::Replay {
            record: found.record,
            completion,
        },
        Held::Ambiguous => ClaimStep::Answer(Claim::Ambiguous),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use UnknownOutcome::{Ambiguous, Retry};

    /// The record's handle and kept response, so a test sees which record a step acts on.
    const RECORD: &str = "the record";
    const KEPT: &str = "its response";
    const NOW: u64 = 1_000;
    /// Every found record here is live until then, unless a row says otherwise.
    const LIVE: u64 = NOW + 60_000;

    type Step = ClaimStep<&'static str, &'static str>;

    fn found(
        expires: u64,
        same_fingerprint: bool,
        state: Held<u64, &'static str>,
    ) -> Option<Found<u64, &'static str, &'static str>> {
        Some(Found {
            record: RECORD,
            expires,
            same_fingerprint,
            state,
        })
    }

    fn in_flight(lease_deadline: u64) -> Held<u64, &'static str> {
        Held::InFlight { lease_deadline }
    }

    fn acquire_over_record() -> Step {
        ClaimStep::Acquire {
            replaces: Some(RECORD),
        }
    }

    #[test]
    fn nothing_found_is_acquired() {
        for on_lapse in [Ambiguous, Retry] {
            assert_eq!(
                decide::<u64, &str, &str>(None, on_lapse, NOW),
                ClaimStep::Acquire { replaces: None }
            );
        }
    }

    #[test]
    fn an_expired_record_is_replaced_whatever_it_holds() {
        // Expired exactly now, or earlier; in any state, for any fingerprint.
        for expires in [NOW, NOW - 1] {
            for same in [true, false] {
                for on_lapse in [Ambiguous, Retry] {
                    let states = [
                        in_flight(LIVE),
                        in_flight(NOW - 1),
                        Held::Completed(KEPT),
                        Held::Ambiguous,
                    ];
                    for state in states {
                        assert_eq!(
                            decide(found(expires, same, state), on_lapse, NOW),
                            acquire_over_record()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_live_lease_answers_in_flight_with_its_time_left_or_mismatch() {
        for on_lapse in [Ambiguous, Retry] {
            assert_eq!(
                decide(found(LIVE, true, in_flight(NOW + 1_500)), on_lapse, NOW),
                ClaimStep::Answer(Claim::InFlight {
                    lease_remaining: Duration::from_millis(1_500)
                })
            );
            assert_eq!(
                decide(found(LIVE, false, in_flight(NOW + 1_500)), on_lapse, NOW),
                ClaimStep::Answer(Claim::Mismatch)
            );
        }
    }

    #[test]
    fn a_lapsed_lease_under_retry_is_replaced_whatever_its_fingerprint() {
        // Lapsed exactly now, or earlier.
        for lease_deadline in [NOW, NOW - 1] {
            for same in [true, false] {
                assert_eq!(
                    decide(found(LIVE, same, in_flight(lease_deadline)), Retry, NOW),
                    acquire_over_record()
                );
            }
        }
    }

    #[test]
    fn a_lapsed_lease_under_ambiguous_turns_ambiguous() {
        for lease_deadline in [NOW, NOW - 1] {
            assert_eq!(
                decide(found(LIVE, true, in_flight(lease_deadline)), Ambiguous, NOW),
                ClaimStep::MakeAmbiguous {
                    record: RECORD,
                    answer: Claim::Ambiguous
                }
            );
            assert_eq!(
                decide(
                    found(LIVE, false, in_flight(lease_deadline)),
                    Ambiguous,
                    NOW
                ),
                ClaimStep::MakeAmbiguous {
                    record: RECORD,
                    answer: Claim::Mismatch
                }
            );
        }
    }

    #[test]
    fn a_completed_record_replays_to_its_fingerprint_only() {
        for on_lapse in [Ambiguous, Retry] {
            assert_eq!(
                decide(found(LIVE, true, Held::Completed(KEPT)), on_lapse, NOW),
                ClaimStep::Replay {
                    record: RECORD,
                    completion: KEPT
                }
            );
            assert_eq!(
                decide(found(LIVE, false, Held::Completed(KEPT)), on_lapse, NOW),
                ClaimStep::Answer(Claim::Mismatch)
            );
        }
    }

    #[test]
    fn an_ambiguous_record_answers_ambiguous_to_its_fingerprint_only() {
        for on_lapse in [Ambiguous, Retry] {
            assert_eq!(
                decide(found(LIVE, true, Held::Ambiguous), on_lapse, NOW),
                ClaimStep::Answer(Claim::Ambiguous)
            );
            assert_eq!(
                decide(found(LIVE, false, Held::Ambiguous), on_lapse, NOW),
                ClaimStep::Answer(Claim::Mismatch)
            );
        }
    }

    #[test]
    fn a_record_expiring_just_after_now_is_live() {
        assert_eq!(
            decide(found(NOW + 1, true, Held::Ambiguous), Retry, NOW),
            ClaimStep::Answer(Claim::Ambiguous)
        );
    }

    #[test]
    fn milliseconds_count_the_time_until_a_later_point() {
        assert_eq!(5u64.until(1_005), Duration::from_secs(1));
        assert_eq!(5u64.until(5), Duration::ZERO);
        assert_eq!(5u64.until(4), Duration::ZERO);
    }
}
