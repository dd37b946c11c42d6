//! Signed timestamps, judged against a tolerance either way.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderName;

use super::SignatureError;
use super::request::malformed;

/// How far a signed timestamp may be from the receiver's clock, either way, unless the
/// scheme is told otherwise: 5 minutes, as Stripe, Slack and Standard Webhooks advise.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Parses a timestamp in whole seconds since the epoch, as every scheme here sends it.
pub(crate) fn parse(value: &str, header: &HeaderName) -> Result<i64, SignatureError> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(
            header,
            "the timestamp is not a number of seconds",
        ));
    }
    value
        .parse()
        .map_err(|_| malformed(header, "the timestamp is out of range"))
}

/// `Ok` when `signed` (seconds since the epoch) is within `tolerance` of `now`.
pub(crate) fn check(
    signed: i64,
    now: SystemTime,
    tolerance: Duration,
) -> Result<(), SignatureError> {
    let now = match now.duration_since(UNIX_EPOCH) {
        Ok(since) => i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_secs()).unwrap_or(i64::MAX),
    };
    let offset = now.saturating_sub(signed);
    if offset.unsigned_abs() > tolerance.as_secs() {
        return Err(SignatureError::OutsideTolerance {
            offset_secs: offset,
            tolerance,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tolerance_holds_either_way_and_at_its_edges() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let tolerance = Duration::from_secs(300);
        for signed in [1_000_000, 999_700, 1_000_300] {
            assert_eq!(check(signed, now, tolerance), Ok(()), "{signed}");
        }
        for (signed, offset) in [(999_699, 301), (1_000_301, -301), (0, 1_000_000)] {
            assert_eq!(
                check(signed, now, tolerance),
                Err(SignatureError::OutsideTolerance {
                    offset_secs: offset,
                    tolerance
                })
            );
        }
    }

    #[test]
    fn only_whole_seconds_parse() {
        let h = HeaderName::from_static("t");
        assert_eq!(parse("1700000000", &h), Ok(1_700_000_000));
        for bad in ["", "-5", "1.5", "12a", "99999999999999999999999"] {
            assert!(parse(bad, &h).is_err(), "{bad:?}");
        }
    }
}
