//! Reading the idempotency key from a request: a header (bare or RFC 8941 sf-string form) or
//! a field of a JSON body.

use http::{HeaderMap, HeaderName};

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// Why a key was refused. Each becomes a `400` problem response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key field appeared more than once.
    #[error("the request carries more than one idempotency key field")]
    Repeated,
    /// The key was empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key was longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is longer than 255 characters")]
    TooLong,
    /// The key had a character outside visible ASCII (`!` to `~`).
    #[error("the idempotency key may hold only visible ASCII characters")]
    BadCharacter,
    /// A value that starts with `"` is not a well-formed structured-field string.
    #[error("the idempotency key is not a well-formed structured-field string")]
    BadString,
    /// The JSON field the route names is neither a string nor an integer.
    #[error("the idempotency key field in the JSON body is neither a string nor an integer")]
    NotAString,
}

/// Reads the key from header `name`. `Ok(None)` when the header is absent.
pub fn from_header(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_value(value.as_bytes()).map(Some)
}

/// Parses one field value: a bare token or an sf-string (`"abc"` is the same key as `abc`).
pub fn parse_value(raw: &[u8]) -> Result<String, KeyError> {
    let raw = raw.trim_ascii();
    let key = match raw.first() {
        Some(b'"') => unquote_sf_string(raw)?,
        _ => raw.to_vec(),
    };
    validate(&key)?;
    // Validated as ASCII just above, so this conversion cannot fail.
    String::from_utf8(key).map_err(|_| KeyError::BadCharacter)
}

fn unquote_sf_string(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    if raw.len() < 2 || raw[raw.len() - 1] != b'"' {
        return Err(KeyError::BadString);
    }
    let inner = &raw[1..raw.len() - 1];
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c),
                _ => return Err(KeyError::BadString),
            },
            b'"' => return Err(KeyError::BadString),
            _ => out.push(b),
        }
    }
    Ok(out)
}

fn validate(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::BadCharacter);
    }
    Ok(())
}

/// Reads the key from a JSON body at an RFC 6901 `pointer`. `Ok(None)` when the body is not
/// JSON or has no such field (the route's `require_key` then decides); a field that is there
/// but is not a string or integer, or is not a valid key, is an error.
pub fn from_json_body(body: &[u8], pointer: &str) -> Result<Option<String>, KeyError> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Ok(None);
    };
    let key = match value.pointer(pointer) {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(_) => return Err(KeyError::NotAString),
    };
    validate(key.as_bytes())?;
    Ok(Some(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    fn read(values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        from_header(
            &headers(values),
            &HeaderName::from_static("idempotency-key"),
        )
    }

    #[test]
    fn bare_and_sf_string_forms_are_the_same_key() {
        assert_eq!(read(&[b"abc-123"]), Ok(Some("abc-123".into())));
        assert_eq!(read(&[b"\"abc-123\""]), Ok(Some("abc-123".into())));
        assert_eq!(read(&[br#""a\"b\\c""#]), Ok(Some(r#"a"b\c"#.into())));
    }

    #[test]
    fn absent_is_none() {
        assert_eq!(read(&[]), Ok(None));
    }

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(read(&[b""]), Err(KeyError::Empty));
        assert_eq!(read(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(read(&[&[b'a'; 256]]), Err(KeyError::TooLong));
        assert_eq!(
            read(&[&[b'a'; 255]]).map(|k| k.map(|k| k.len())),
            Ok(Some(255))
        );
        assert_eq!(read(&[b"a b"]), Err(KeyError::BadCharacter));
        assert_eq!(read(&[b"a\tb"]), Err(KeyError::BadCharacter));
        assert_eq!(read(&[b"caf\xc3\xa9"]), Err(KeyError::BadCharacter));
        assert_eq!(read(&[b"\"abc"]), Err(KeyError::BadString));
        assert_eq!(read(&[b"\"a\"b\""]), Err(KeyError::BadString));
        assert_eq!(read(&[b"\"a\\nb\""]), Err(KeyError::BadString));
        assert_eq!(read(&[b"\"a b\""]), Err(KeyError::BadCharacter));
        assert_eq!(read(&[b"one", b"two"]), Err(KeyError::Repeated));
    }

    #[test]
    fn json_pointer_keys() {
        let body = br#"{"id":"evt_123","data":{"n":42,"f":1.5,"o":{}}}"#;
        assert_eq!(from_json_body(body, "/id"), Ok(Some("evt_123".into())));
        assert_eq!(from_json_body(body, "/data/n"), Ok(Some("42".into())));
        assert_eq!(from_json_body(body, "/missing"), Ok(None));
        assert_eq!(from_json_body(b"not json", "/id"), Ok(None));
        assert_eq!(from_json_body(body, "/data/f"), Err(KeyError::NotAString));
        assert_eq!(from_json_body(body, "/data/o"), Err(KeyError::NotAString));
        assert_eq!(from_json_body(br#"{"id":""}"#, "/id"), Err(KeyError::Empty));
    }
}
