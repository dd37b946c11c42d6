//! Writing HTTP/1.1 messages: a field line, a number in decimal or hex, a chunk's size line.
//! Shared by the upstream client (requests) and the proxy's own HTTP/1.1 loop (responses).

use http::{HeaderName, HeaderValue};

/// Appends `name: value` and its line end.
pub(super) fn encode_field(name: &HeaderName, value: &HeaderValue, out: &mut Vec<u8>) {
    out.extend_from_slice(name.as_str().as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// `n` in `radix` (10 or 16, lower-case digits), without going through `fmt`.
pub(super) fn push_number(mut n: u64, radix: u64, out: &mut Vec<u8>) {
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

/// A chunk's size line, for a chunk of `len` bytes.
pub(super) fn push_chunk_size(len: usize, out: &mut Vec<u8>) {
    push_number(len as u64, 16, out);
    out.extend_from_slice(b"\r\n");
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
    fn chunk_sizes_are_written_in_hex() {
        for (len, hex) in [
            (1, "1"),
            (15, "f"),
            (16, "10"),
            (255, "ff"),
            (4096, "1000"),
            (65535, "ffff"),
        ] {
            let mut out = Vec::new();
            push_number(len, 16, &mut out);
            assert_eq!(out, hex.as_bytes(), "{len}");
        }
    }
}
