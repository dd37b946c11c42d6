//! What both directions share: how a body is framed ([`Framing`]), the `Content-Length`
//! parser, the framing rules of a head's fields, the head writer's pieces, and the reads
//! into a connection's buffer.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use tokio::io::AsyncRead;

use super::chunked;

/// Room made in a connection's read buffer before each read.
pub(crate) const READ_CHUNK: usize = 8 * 1024;
/// A message that fits this (a response's head and body, a request body with its head) goes
/// out in one write.
pub(crate) const ONE_WRITE: usize = 16 * 1024;

/// A message the gateway cannot read for certain; the connection is not used again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Malformed(pub(crate) &'static str);

/// How a message's body is delimited on the wire (RFC 9112 §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body, and no framing field written: a `GET` without one; a response to `HEAD`, a
    /// `1xx`, `204` or `304`; a response whose length is 0.
    None,
    /// `Content-Length`: this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the sender closes the connection (a response without either field).
    UntilClose,
}

impl Framing {
    /// The most body bytes this framing lets through.
    pub(crate) fn most(self) -> u64 {
        match self {
            Framing::None => 0,
            Framing::Length(n) => n,
            Framing::Chunked | Framing::UntilClose => u64::MAX,
        }
    }

    /// Appends the field that says this framing, if it has one.
    pub(crate) fn write_field(self, out: &mut Vec<u8>) {
        match self {
            Framing::None | Framing::UntilClose => {}
            Framing::Length(n) => write_content_length(n, out),
            Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        }
    }

    /// Appends what goes before `len` bytes of body data: a chunk's size line.
    pub(crate) fn write_data_start(self, len: usize, out: &mut Vec<u8>) {
        if self == Framing::Chunked {
            chunked::push_chunk_size(len, out);
        }
    }

    /// Appends what goes after a piece of body data: a chunk's CRLF.
    pub(crate) fn write_data_end(self, out: &mut Vec<u8>) {
        if self == Framing::Chunked {
            out.extend_from_slice(chunked::CHUNK_END);
        }
    }

    /// Appends one piece of body data as it goes on the wire.
    pub(crate) fn encode_data(self, data: &[u8], out: &mut Vec<u8>) {
        self.write_data_start(data.len(), out);
        out.extend_from_slice(data);
        self.write_data_end(out);
    }

    /// Appends what ends the body: the last chunk.
    pub(crate) fn write_end(self, out: &mut Vec<u8>) {
        if self == Framing::Chunked {
            out.extend_from_slice(chunked::LAST_CHUNK);
        }
    }
}

/// The value of one `Content-Length` field line: decimal digits only (no sign, space or
/// list), within `u64`.
pub(crate) fn content_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |len, &digit| {
        if !digit.is_ascii_digit() {
            return None;
        }
        len.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

/// The length all of a message's `Content-Length` values say, over all its field lines and
/// the elements of each (RFC 9110 §8.6: `5, 5` is 5): `None` when it has none, an error when
/// one is not a number or two differ.
pub(crate) fn content_length_of(headers: &HeaderMap) -> Result<Option<u64>, Malformed> {
    let mut length = None;
    for value in &headers.get_all(CONTENT_LENGTH) {
        for part in value.as_bytes().split(|&b| b == b',') {
            let n = content_length(part.trim_ascii()).ok_or(Malformed("bad Content-Length"))?;
            if length.is_some_and(|seen| seen != n) {
                return Err(Malformed("conflicting Content-Length"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

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

/// Appends a request line: `METHOD TARGET HTTP/1.1`.
pub(crate) fn write_request_line(method: &Method, target: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
}

/// Appends a status line: `HTTP/1.1 CODE REASON`.
pub(crate) fn write_status_line(status: StatusCode, out: &mut Vec<u8>) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends the fields of `headers` that `keep` keeps, in order, but never the framing fields
/// (`Content-Length`, `Transfer-Encoding`): the writer says the framing itself (see
/// [`Framing::write_field`]). `keep` sees every field, the framing ones included, so that a
/// writer notes what it needs in the same pass.
#[inline]
pub(crate) fn write_fields<'h>(
    headers: &'h HeaderMap,
    out: &mut Vec<u8>,
    mut keep: impl FnMut(&HeaderName, &'h HeaderValue) -> bool,
) {
    for (name, value) in headers {
        if keep(name, value) && name != CONTENT_LENGTH && name != TRANSFER_ENCODING {
            encode_field(name, value, out);
        }
    }
}

/// Appends `name: value` and its line end.
pub(crate) fn encode_field(name: &HeaderName, value: &HeaderValue, out: &mut Vec<u8>) {
    out.extend_from_slice(name.as_str().as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends `content-length: LEN`.
pub(crate) fn write_content_length(len: u64, out: &mut Vec<u8>) {
    out.extend_from_slice(b"content-length: ");
    push_number(len, 10, out);
    out.extend_from_slice(b"\r\n");
}

/// `n` in `radix` (10 or 16, lower-case digits), without going through `fmt`.
pub(crate) fn push_number(mut n: u64, radix: u64, out: &mut Vec<u8>) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[(n % radix) as usize];
        n /= radix;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Where a part of a parsed head lies in the buffer it was parsed from, so that the values
/// built from it can share the buffer's bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    start: usize,
    len: usize,
}

impl Span {
    /// Where `part`, a slice of `buffer`, lies in it.
    pub(crate) fn of(part: &[u8], buffer: &[u8]) -> Self {
        Self {
            start: part.as_ptr() as usize - buffer.as_ptr() as usize,
            len: part.len(),
        }
    }

    pub(crate) fn range(self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// Reads what `io` has into `buf`, after making room for [`READ_CHUNK`] bytes: how many bytes
/// came, 0 at the end of the stream.
#[inline]
pub(crate) fn poll_read_more<R: AsyncRead + Unpin>(
    io: &mut R,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    buf.reserve(READ_CHUNK);
    tokio_util::io::poll_read_buf(Pin::new(io), cx, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_in_decimal_and_hex() {
        for (n, decimal, hex) in [
            (0, "0", "0"),
            (9, "9", "9"),
            (255, "255", "ff"),
            (4096, "4096", "1000"),
            (u64::MAX, "18446744073709551615", "ffffffffffffffff"),
        ] {
            let mut out = b"x".to_vec();
            push_number(n, 10, &mut out);
            assert_eq!(out, format!("x{decimal}").as_bytes());
            out.clear();
            push_number(n, 16, &mut out);
            assert_eq!(out, hex.as_bytes());
        }
    }

    #[test]
    fn a_content_length_is_digits_within_u64() {
        for (value, length) in [
            (&b"0"[..], Some(0)),
            (b"05", Some(5)),
            (b"65536", Some(65_536)),
            (b"18446744073709551615", Some(u64::MAX)),
            (b"18446744073709551616", None),
            (b"", None),
            (b"+5", None),
            (b"-1", None),
            (b" 5", None),
            (b"5, 5", None),
        ] {
            assert_eq!(content_length(value), length, "{value:?}");
        }
        let mut headers = HeaderMap::new();
        for value in ["5, 5", "5"] {
            headers.append(CONTENT_LENGTH, HeaderValue::from_static(value));
        }
        assert_eq!(content_length_of(&headers), Ok(Some(5)));
        headers.append(CONTENT_LENGTH, HeaderValue::from_static("6"));
        assert_eq!(
            content_length_of(&headers),
            Err(Malformed("conflicting Content-Length"))
        );
        assert_eq!(content_length_of(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn each_framing_writes_its_field_and_frames_its_data() {
        for (framing, field, data, end) in [
            (Framing::None, "", "ab", ""),
            (Framing::Length(2), "content-length: 2\r\n", "ab", ""),
            (
                Framing::Chunked,
                "transfer-encoding: chunked\r\n",
                "2\r\nab\r\n",
                "0\r\n\r\n",
            ),
        ] {
            let mut out = Vec::new();
            framing.write_field(&mut out);
            assert_eq!(out, field.as_bytes(), "{framing:?}");
            out.clear();
            framing.encode_data(b"ab", &mut out);
            assert_eq!(out, data.as_bytes(), "{framing:?}");
            out.clear();
            framing.write_end(&mut out);
            assert_eq!(out, end.as_bytes(), "{framing:?}");
        }
    }
}
