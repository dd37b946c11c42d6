//! The chunked transfer coding (RFC 9112 §7.1): the decoder the client reads an upstream's
//! chunked body with, and the pieces both writers frame chunks with (see
//! [`super::codec::Framing`]).

use bytes::{Buf, Bytes, BytesMut};

use super::codec::{Malformed, push_number};
use super::limits::{MAX_CHUNK_LINE, MAX_RESPONSE_HEAD};

/// What follows a chunk's data.
pub(crate) const CHUNK_END: &[u8] = b"\r\n";
/// The last chunk, without trailers: the end of a chunked body.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Appends a chunk's size line, for a chunk of `len` bytes.
pub(crate) fn push_chunk_size(len: usize, out: &mut Vec<u8>) {
    push_number(len as u64, 16, out);
    out.extend_from_slice(b"\r\n");
}

/// Where a chunked body's decoding stands. Strict: a malformed size line, a chunk without its
/// CRLF, or trailers over [`MAX_RESPONSE_HEAD`] are errors. Trailer fields are read and
/// dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChunkedDecoder {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk: so many bytes left, then its CRLF.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer fields after the last chunk, up to an empty line; so many bytes of them read.
    Trailers(usize),
    /// The body has ended.
    Done,
}

/// What one step of the decoder did with the bytes read so far.
#[derive(Debug)]
pub(crate) enum Decoded {
    /// Body bytes, taken off the buffer.
    Data(Bytes),
    /// Framing taken off the buffer; the decoder moved on (to [`ChunkedDecoder::Done`] at the
    /// end).
    Next,
    /// Nothing can be taken until more is read.
    More,
}

impl ChunkedDecoder {
    /// One step of decoding from the front of `read`: the decoder itself, apart from any
    /// socket, so that it can be fed bytes split anywhere.
    pub(crate) fn step(&mut self, read: &mut BytesMut) -> Result<Decoded, Malformed> {
        match self {
            ChunkedDecoder::Size => match chunk_size(read)? {
                Some(0) => *self = ChunkedDecoder::Trailers(0),
                Some(n) => *self = ChunkedDecoder::Data(n),
                None => return Ok(Decoded::More),
            },
            ChunkedDecoder::Data(left) => {
                if read.is_empty() {
                    return Ok(Decoded::More);
                }
                let n = (*left).min(read.len() as u64) as usize;
                *left -= n as u64;
                if *left == 0 {
                    *self = ChunkedDecoder::DataEnd;
                }
                return Ok(Decoded::Data(read.split_to(n).freeze()));
            }
            ChunkedDecoder::DataEnd => {
                if read.len() < 2 {
                    return Ok(Decoded::More);
                }
                if &read[..2] != CHUNK_END {
                    return Err(Malformed("a chunk without its CRLF"));
                }
                read.advance(2);
                *self = ChunkedDecoder::Size;
            }
            ChunkedDecoder::Trailers(seen) => match trailer_line(read) {
                Some(0) => *self = ChunkedDecoder::Done,
                Some(line) => {
                    *seen += line;
                    if *seen > MAX_RESPONSE_HEAD {
                        return Err(Malformed("trailers too large"));
                    }
                }
                None if read.len() > MAX_RESPONSE_HEAD => {
                    return Err(Malformed("trailers too large"));
                }
                None => return Ok(Decoded::More),
            },
            // Nothing more to take.
            ChunkedDecoder::Done => {}
        }
        Ok(Decoded::Next)
    }
}

/// Where the first CRLF in `buf` starts.
fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// Takes a chunk-size line (`HEX[;extensions]CRLF`) off `buf`: the size, or `None` if the
/// line is not complete yet. Leading zeros aside, at most 15 hex digits.
fn chunk_size(buf: &mut BytesMut) -> Result<Option<u64>, Malformed> {
    let Some(end) = find_crlf(buf) else {
        if buf.len() > MAX_CHUNK_LINE {
            return Err(Malformed("chunk-size line too long"));
        }
        return Ok(None);
    };
    if end > MAX_CHUNK_LINE {
        return Err(Malformed("chunk-size line too long"));
    }
    let bad = Malformed("bad chunk size");
    // HEX, then optional whitespace before any extension.
    let digits = buf[..end]
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii_end();
    if digits.is_empty() {
        return Err(bad);
    }
    let mut size = 0u64;
    for &b in digits {
        let Some(digit) = char::from(b).to_digit(16) else {
            return Err(bad);
        };
        // A 16th significant digit.
        if size >> 56 != 0 {
            return Err(bad);
        }
        size = size << 4 | u64::from(digit);
    }
    buf.advance(end + 2);
    Ok(Some(size))
}

/// Takes one trailer line off `buf` (the field is dropped): its length without the CRLF
/// (`0` for the empty line that ends the message), or `None` if the line is not complete yet.
fn trailer_line(buf: &mut BytesMut) -> Option<usize> {
    let end = find_crlf(buf)?;
    buf.advance(end + 2);
    Some(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_written_in_hex() {
        for (len, hex) in [
            (1, "1\r\n"),
            (15, "f\r\n"),
            (16, "10\r\n"),
            (255, "ff\r\n"),
            (4096, "1000\r\n"),
            (65535, "ffff\r\n"),
        ] {
            let mut out = Vec::new();
            push_chunk_size(len, &mut out);
            assert_eq!(out, hex.as_bytes(), "{len}");
        }
    }

    /// Property tests of the decoder, which reads the upstream's bytes.
    mod properties {
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        /// Feeds `input` to the chunked decoder in pieces cut at `cuts` (positions, any
        /// order), as reads would hand them over. Answers the body, what was left after its
        /// end (`None` if it never ended), or the decoder's error. Bounded: every step must
        /// take bytes, move the state on or ask for more.
        fn decode(input: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, Option<Vec<u8>>), Malformed> {
            let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(input.len())).collect();
            cuts.push(input.len());
            cuts.sort_unstable();
            let mut pieces = cuts.iter().scan(0, |from, &to| {
                let piece = &input[*from..to];
                *from = to;
                Some(piece)
            });
            let mut decoder = ChunkedDecoder::Size;
            let mut read = BytesMut::new();
            let mut body = Vec::new();
            for _ in 0..4 * input.len() + 64 {
                if decoder == ChunkedDecoder::Done {
                    return Ok((body, Some(read.to_vec())));
                }
                match decoder.step(&mut read)? {
                    Decoded::Data(data) => {
                        assert!(!data.is_empty(), "an empty piece of body");
                        body.extend_from_slice(&data);
                    }
                    Decoded::Next => {}
                    Decoded::More => match pieces.next() {
                        Some(piece) => read.extend_from_slice(piece),
                        None => return Ok((body, None)),
                    },
                }
            }
            panic!("the decoder made no progress on {input:?}");
        }

        /// A chunked encoding of `body`, cut into chunks at `cuts`, each size line written as
        /// `style` says, then the last chunk, `trailers`, and `after` (the next response).
        fn encode(
            body: &[u8],
            cuts: &[usize],
            style: (bool, usize, bool),
            trailers: &[&str],
            after: &[u8],
        ) -> Vec<u8> {
            let (upper, zeros, extension) = style;
            let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(body.len())).collect();
            cuts.push(body.len());
            cuts.sort_unstable();
            cuts.dedup();
            let mut out = Vec::new();
            let mut from = 0;
            for to in cuts {
                if to == from {
                    continue;
                }
                let size = format!("{:0width$x}", to - from, width = zeros + 1);
                let size = if upper { size.to_uppercase() } else { size };
                out.extend_from_slice(size.as_bytes());
                if extension {
                    out.extend_from_slice(b" ;name=\"v;x\"");
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&body[from..to]);
                out.extend_from_slice(b"\r\n");
                from = to;
            }
            out.extend_from_slice(b"0\r\n");
            for trailer in trailers {
                out.extend_from_slice(trailer.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(after);
            out
        }

        fn cuts() -> impl Strategy<Value = Vec<usize>> {
            prop::collection::vec(0usize..600, 0..12)
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn a_body_chunked_and_read_in_any_pieces_decodes_to_itself(
                body in prop::collection::vec(any::<u8>(), 0..400),
                chunks in cuts(),
                reads in cuts(),
                style in (any::<bool>(), 0usize..4, any::<bool>()),
                trailers in prop::collection::vec(select(vec!["x-sum: 1", "X-Other: a, b", "t:"]), 0..3),
                after in prop::collection::vec(any::<u8>(), 0..20),
            ) {
                let input = encode(&body, &chunks, style, &trailers, &after);
                let (decoded, rest) = decode(&input, &reads).unwrap();
                prop_assert_eq!(decoded, body);
                // The decoder stops at the body's end: what follows is left for the next read.
                let rest = rest.expect("the body ended");
                prop_assert!(after.starts_with(&rest));
            }

            #[test]
            fn the_writers_framing_decodes_to_the_body(
                pieces in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..50), 0..8),
                reads in cuts(),
            ) {
                let mut input = Vec::new();
                for piece in &pieces {
                    crate::http1::codec::Framing::Chunked.encode_data(piece, &mut input);
                }
                input.extend_from_slice(LAST_CHUNK);
                let (decoded, rest) = decode(&input, &reads).unwrap();
                prop_assert_eq!(decoded, pieces.concat());
                prop_assert_eq!(rest, Some(Vec::new()));
            }

            #[test]
            fn random_bytes_never_panic_the_decoder(
                input in prop::collection::vec(any::<u8>(), 0..300),
                reads in cuts(),
            ) {
                let _ = decode(&input, &reads);
            }

            #[test]
            fn a_mutated_chunked_body_never_panics_and_never_decodes_longer(
                body in prop::collection::vec(any::<u8>(), 1..200),
                chunks in cuts(),
                reads in cuts(),
                at in any::<prop::sample::Index>(),
                byte in select(vec![b'0', b'f', b'F', b'\r', b'\n', b';', b' ', b'x', 0xff]),
                how in 0..3u8,
            ) {
                let mut input = encode(&body, &chunks, (false, 0, false), &[], b"");
                let i = at.index(input.len());
                match how {
                    0 => input[i] = byte,
                    1 => input.insert(i, byte),
                    _ => { input.remove(i); }
                }
                if let Ok((decoded, _)) = decode(&input, &reads) {
                    // A changed size can move the body's end, never past what was sent.
                    prop_assert!(decoded.len() <= input.len());
                }
            }
        }
    }
}
