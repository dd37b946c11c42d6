//! Every limit on an HTTP/1.1 head the gateway reads, decided here.
//!
//! A client's request head passes three readers, each with its own limit, and each must stay
//! above the one after it so that a request past the configured limits gets the front
//! service's problem response (`431 headers-too-large`) rather than a bare answer:
//!
//! 1. the gateway's own loop ([`super::server`]) serves only small plain heads
//!    ([`OWN_MAX_FIELDS`], [`OWN_MAX_HEAD`]) and hands anything larger to hyper;
//! 2. hyper reads up to [`RequestHeadLimits::hyper_max_buf_size`] and
//!    [`RequestHeadLimits::hyper_max_headers`] (twice the configured limits), and answers a
//!    head past them itself;
//! 3. the front service checks the configured `max_headers` and `max_header_bytes`
//!    ([`RequestHeadLimits::refuse`]).
//!
//! An upstream's response head is read by the gateway's own client alone:
//! [`MAX_RESPONSE_FIELDS`] and [`MAX_RESPONSE_HEAD`].

use idemgate::response::Problem;

use crate::config::Limits;

/// Most fields in a request head the own loop serves; a head with more goes to hyper.
pub(crate) const OWN_MAX_FIELDS: usize = 64;
/// Largest request head the own loop serves (within hyper's limit, see
/// [`RequestHeadLimits::own_max_head`]); a longer one goes to hyper.
pub(crate) const OWN_MAX_HEAD: usize = 16 * 1024;
/// Largest request body the own loop serves. It must have arrived with its head.
pub(crate) const OWN_MAX_BODY: usize = 64 * 1024;

/// Most header fields in an upstream's response head.
pub(crate) const MAX_RESPONSE_FIELDS: usize = 128;
/// Largest upstream response head (status line and fields); also the most trailer bytes read
/// after a chunked body.
pub(crate) const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// Longest chunk-size line (size, extensions and CRLF) read from an upstream.
pub(crate) const MAX_CHUNK_LINE: usize = 4 * 1024;

/// How far above the configured head limits hyper's own are set.
const HYPER_LIMITS_FACTOR: usize = 2;
/// The header fields hyper accepts when no limit is set.
const HYPER_DEFAULT_MAX_HEADERS: usize = 100;

/// The limits on a client's request head: the configured ones, which the front service
/// answers, and those of the readers in front of it, derived from them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestHeadLimits {
    /// `max_headers`: most fields.
    max_fields: usize,
    /// `max_header_bytes`: the largest header block (request line and fields).
    max_bytes: usize,
}

impl RequestHeadLimits {
    /// The limits for a listener configured with `limits`.
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            max_fields: limits.max_headers,
            max_bytes: limits.max_header_bytes,
        }
    }

    /// The front service's answer to a request head of `fields` fields and `bytes` bytes (as
    /// sent), if it is past the configured limits: `431 headers-too-large`.
    pub(crate) fn refuse(self, fields: usize, bytes: usize) -> Option<Problem> {
        if fields > self.max_fields {
            return Some(Problem::too_many_headers(fields, self.max_fields));
        }
        (bytes > self.max_bytes).then(|| Problem::header_block_too_large(bytes, self.max_bytes))
    }

    /// hyper's HTTP/1.1 read buffer, which bounds a head: above the configured limit, so that
    /// only a head past it gets hyper's bare `431`.
    pub(crate) fn hyper_max_buf_size(self) -> usize {
        self.max_bytes.saturating_mul(HYPER_LIMITS_FACTOR)
    }

    /// hyper's HTTP/1.1 field limit, when one must be set. hyper parses a head into room for
    /// its default number of fields on the stack; any limit set explicitly costs a fill (and
    /// past that number an allocation) per request, so one is set only when the configured
    /// limit needs more room.
    pub(crate) fn hyper_max_headers(self) -> Option<usize> {
        (self.max_fields >= HYPER_DEFAULT_MAX_HEADERS)
            .then(|| self.max_fields.saturating_mul(HYPER_LIMITS_FACTOR))
    }

    /// hyper's HTTP/2 header list limit, above the configured one like its HTTP/1.1 buffer.
    pub(crate) fn hyper_h2_max_header_list_size(self) -> u32 {
        u32::try_from(self.hyper_max_buf_size()).unwrap_or(u32::MAX)
    }

    /// The longest head the own loop reads before it hands the connection to hyper: hyper's
    /// own limit (so a longer head still gets hyper's answer), within [`OWN_MAX_HEAD`].
    pub(crate) fn own_max_head(self) -> usize {
        self.hyper_max_buf_size().min(OWN_MAX_HEAD)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits(max_headers: usize, max_header_bytes: usize) -> RequestHeadLimits {
        RequestHeadLimits::new(&Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_headers,
            max_header_bytes,
        })
    }

    #[test]
    fn each_reader_stays_above_the_one_after_it() {
        for (fields, bytes) in [
            (1, 8 * 1024),
            (64, 64 * 1024),
            (100, 1 << 20),
            (500, 8 * 1024),
        ] {
            let head = limits(fields, bytes);
            assert!(head.own_max_head() <= head.hyper_max_buf_size());
            assert!(head.hyper_max_buf_size() > bytes);
            assert!(
                head.hyper_max_headers()
                    .unwrap_or(HYPER_DEFAULT_MAX_HEADERS)
                    > fields
            );
            assert!(head.refuse(fields, bytes).is_none());
            assert!(head.refuse(fields + 1, bytes).is_some());
            assert!(head.refuse(fields, bytes + 1).is_some());
        }
        // The defaults: hyper's own field limit is left alone.
        assert_eq!(limits(64, 64 * 1024).hyper_max_headers(), None);
        assert_eq!(limits(64, 64 * 1024).own_max_head(), OWN_MAX_HEAD);
        assert_eq!(limits(100, 64 * 1024).hyper_max_headers(), Some(200));
    }
}
