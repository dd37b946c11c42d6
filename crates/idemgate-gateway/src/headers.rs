//! Header rules of the gateway's HTTP/1.1: list fields, transfer codings, `Connection: close`.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName, TRANSFER_ENCODING};

/// The elements of a comma-separated list field (RFC 9110 §5.6.1), over all of its field
/// lines, trimmed, with empty elements left out.
pub(crate) fn list_elements<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> impl Iterator<Item = &'a [u8]> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&byte| byte == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|element| !element.is_empty())
}

/// Whether a message's `Transfer-Encoding` is `chunked` alone (RFC 9112 §6.1): the only
/// transfer coding the proxy reads or forwards, on requests and upstream responses alike. The
/// HTTP layer takes the chunked framing off; any coding under it (`gzip, chunked`), or one
/// instead of it, would be left on a body passed on as if it were plain.
pub(crate) fn chunked_alone(headers: &HeaderMap) -> bool {
    let mut codings = list_elements(headers, &TRANSFER_ENCODING);
    codings
        .next()
        .is_some_and(|coding| coding.eq_ignore_ascii_case(b"chunked"))
        && codings.next().is_none()
}

/// Whether `Connection` says `close`. A value that is not text counts as saying it.
pub(crate) fn asks_to_close(headers: &HeaderMap) -> bool {
    headers.get_all(CONNECTION).iter().any(|value| {
        value.to_str().map_or(true, |value| {
            value
                .split(',')
                .any(|token| token.trim().eq_ignore_ascii_case("close"))
        })
    })
}
