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

/// Properties of the key parsers over generated and arbitrary input: every byte they read
/// comes from a client.
#[cfg(test)]
mod proptests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::Value;

    /// 256 cases, drawn with XorShift: ChaCha, the default generator, runs unoptimised in a
    /// debug build and would be most of the run time.
    fn config() -> ProptestConfig {
        ProptestConfig {
            rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
            ..ProptestConfig::with_cases(256)
        }
    }

    /// The documented constraints, stated apart from the parser: 1 to 255 characters, each
    /// visible ASCII (`!` to `~`).
    fn is_valid_key(key: &str) -> bool {
        (1..=MAX_KEY_LEN).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic())
    }

    /// A key in its canonical wire form: an RFC 8941 sf-string.
    fn sf_string(key: &str) -> String {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }

    /// Valid keys, lengths near the bound and keys full of `"` and `\` weighted up.
    fn valid_key() -> impl Strategy<Value = String> {
        prop_oneof!["[!-~]{1,40}", "[!-~]{250,255}", "[\"\\\\a-z]{1,20}",]
    }

    /// Spaces and tabs a sender may put around a field value.
    fn ows() -> impl Strategy<Value = String> {
        "[ \t]{0,3}"
    }

    fn assert_accepted_key_is_valid(key: &str) -> Result<(), TestCaseError> {
        prop_assert!(is_valid_key(key), "accepted invalid key {:?}", key);
        // Every accepted key has a canonical form that reads back as itself.
        prop_assert_eq!(parse_value(sf_string(key).as_bytes()), Ok(key.to_owned()));
        Ok(())
    }

    /// Values that look like keys and then do not quite: canonical forms damaged by one
    /// inserted, replaced or removed byte (any byte, often one that matters to the grammar),
    /// and bytes with no structure at all.
    fn raw_value() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..300),
            (
                valid_key(),
                any::<bool>(),
                any::<Index>(),
                prop_oneof![
                    any::<u8>(),
                    proptest::sample::select(vec![
                        b' ', b'\t', b'"', b'\\', 0x7f, 0x80, 0xff, 0, b'\r', b'\n'
                    ]),
                ],
                0u8..3
            )
                .prop_map(|(key, quoted, at, byte, how)| {
                    let mut v = if quoted { sf_string(&key) } else { key }.into_bytes();
                    let i = at.index(v.len());
                    match how {
                        0 => v.insert(i, byte),
                        1 => v[i] = byte,
                        _ => {
                            v.remove(i);
                        }
                    }
                    v
                }),
        ]
    }

    fn json_key() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::sample::select(vec!["id", "key", "a/b", "~", "~1", "", "0", "01", "-"])
                .prop_map(String::from),
            "[a-z0-9~/]{1,6}",
            any::<String>(),
        ]
    }

    fn json_string() -> impl Strategy<Value = String> {
        prop_oneof![
            "[!-~]{1,20}",
            "[!-~]{254,257}",
            any::<String>(),
            Just(String::new()),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            json_string().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec((json_key(), inner), 0..6)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect())),
            ]
        })
    }

    /// Every RFC 6901 pointer that names a value in `v`, the root's (`""`) included.
    fn pointers(v: &Value, prefix: &str, out: &mut Vec<String>) {
        out.push(prefix.to_owned());
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    pointers(item, &format!("{prefix}/{i}"), out);
                }
            }
            Value::Object(fields) => {
                for (name, item) in fields {
                    let token = name.replace('~', "~0").replace('/', "~1");
                    pointers(item, &format!("{prefix}/{token}"), out);
                }
            }
            _ => {}
        }
    }

    /// A pointer into `v` (most of the time), one past a value in it, or any string.
    fn pointer_into(v: &Value, at: Index, how: u8, other: String) -> String {
        let mut all = Vec::new();
        pointers(v, "", &mut all);
        let named = all[at.index(all.len())].clone();
        match how {
            0 | 1 => named,
            2 => format!("{named}/{other}"),
            _ => other,
        }
    }

    /// What [`from_json_body`] must answer for a body that parses to `v`, from serde_json's
    /// own pointer lookup and the documented key constraints.
    fn check_against_pointer(
        v: &Value,
        pointer: &str,
        got: Result<Option<String>, KeyError>,
    ) -> Result<(), TestCaseError> {
        let text = match v.pointer(pointer) {
            None | Some(Value::Null) => {
                prop_assert_eq!(got, Ok(None));
                return Ok(());
            }
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.as_i64().is_some() || n.as_u64().is_some() => n.to_string(),
            Some(_) => {
                prop_assert_eq!(got, Err(KeyError::NotAString));
                return Ok(());
            }
        };
        if is_valid_key(&text) {
            prop_assert_eq!(got, Ok(Some(text)));
        } else {
            prop_assert!(
                matches!(
                    got,
                    Err(KeyError::Empty | KeyError::TooLong | KeyError::BadCharacter)
                ),
                "{:?} at {:?} gave {:?}",
                text,
                pointer,
                got
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_value_is_refused_or_a_valid_key(raw in raw_value()) {
            if let Ok(key) = parse_value(&raw) {
                assert_accepted_key_is_valid(&key)?;
            }
        }

        #[test]
        fn a_valid_key_reads_back_from_its_canonical_and_bare_forms(
            key in valid_key(),
            before in ows(),
            after in ows(),
        ) {
            let sf = format!("{before}{}{after}", sf_string(&key));
            prop_assert_eq!(parse_value(sf.as_bytes()), Ok(key.clone()));
            // A bare key means itself unless it starts with `"`, which makes it an sf-string.
            if !key.starts_with('"') {
                let bare = format!("{before}{key}{after}");
                prop_assert_eq!(parse_value(bare.as_bytes()), Ok(key));
            }
        }

        #[test]
        fn keys_over_the_bound_are_too_long_in_either_form(
            key in "[!-~&&[^\"]]{256,300}",
        ) {
            prop_assert_eq!(parse_value(key.as_bytes()), Err(KeyError::TooLong));
            prop_assert_eq!(parse_value(sf_string(&key).as_bytes()), Err(KeyError::TooLong));
        }

        #[test]
        fn a_character_outside_visible_ascii_is_refused(
            head in "[!-~&&[^\"]][!-~]{0,20}",
            tail in "[!-~]{1,20}",
            bad in prop_oneof![0u8..=0x20, 0x7fu8..=0xff],
            quoted in any::<bool>(),
        ) {
            let mut key = head.into_bytes();
            key.push(bad);
            key.extend_from_slice(tail.as_bytes());
            let raw = if quoted {
                // Escape what an sf-string must escape; the bad byte stays as it is.
                let mut v = vec![b'"'];
                for &b in &key {
                    if b == b'"' || b == b'\\' {
                        v.push(b'\\');
                    }
                    v.push(b);
                }
                v.push(b'"');
                v
            } else {
                key
            };
            prop_assert_eq!(parse_value(&raw), Err(KeyError::BadCharacter));
        }

        #[test]
        fn malformed_sf_strings_are_refused(
            key in "[!-~]{0,20}",
            at in any::<Index>(),
            flaw in prop_oneof![
                // A lone quote inside, a backslash escaping anything but `"` or `\`.
                Just("\"".to_owned()),
                "\\\\[^\"\\\\]",
            ],
            unterminated in any::<bool>(),
        ) {
            let sf = sf_string(&key);
            let raw = if unterminated {
                sf[..sf.len() - 1].to_owned()
            } else {
                // Insert the flaw between two escape sequences of the canonical form, never
                // inside one.
                let inner = &sf[1..sf.len() - 1];
                let boundaries: Vec<usize> = (0..=inner.len())
                    .filter(|&i| {
                        let escapes = inner.as_bytes()[..i].iter().rev()
                            .take_while(|&&b| b == b'\\').count();
                        escapes % 2 == 0
                    })
                    .collect();
                let i = boundaries[at.index(boundaries.len())];
                format!("\"{}{flaw}{}\"", &inner[..i], &inner[i..])
            };
            prop_assert_eq!(parse_value(raw.as_bytes()), Err(KeyError::BadString), "{:?}", raw);
        }

        #[test]
        fn from_header_reads_one_field_and_refuses_repeats(
            values in proptest::collection::vec(
                prop_oneof![
                    valid_key().prop_map(String::into_bytes),
                    valid_key().prop_map(|k| sf_string(&k).into_bytes()),
                    proptest::collection::vec(
                        prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff],
                        0..40,
                    ),
                ],
                0..4,
            ),
            other in proptest::collection::vec(valid_key(), 0..3),
        ) {
            let name = HeaderName::from_static("idempotency-key");
            let mut headers = HeaderMap::new();
            for v in &other {
                headers.append("x-other", HeaderValue::from_str(v).unwrap());
            }
            for v in &values {
                headers.append(&name, HeaderValue::from_bytes(v).unwrap());
            }
            let got = from_header(&headers, &name);
            match values.as_slice() {
                [] => prop_assert_eq!(got, Ok(None)),
                [one] => {
                    prop_assert_eq!(&got, &parse_value(one).map(Some));
                    if let Ok(Some(key)) = got {
                        assert_accepted_key_is_valid(&key)?;
                    }
                }
                _ => prop_assert_eq!(got, Err(KeyError::Repeated)),
            }
        }

        #[test]
        fn json_keys_agree_with_serde_json_pointers(
            v in json_value(),
            at in any::<Index>(),
            how in 0u8..4,
            other in prop_oneof![json_key(), any::<String>()],
        ) {
            let pointer = pointer_into(&v, at, how, other);
            let body = serde_json::to_vec(&v).unwrap();
            // Checked against the generated value, not the body parsed again: the key read
            // from the bytes is the one the sender wrote.
            check_against_pointer(&v, &pointer, from_json_body(&body, &pointer))?;
        }

        #[test]
        fn json_bodies_of_any_bytes_never_panic(
            v in json_value(),
            at in any::<Index>(),
            how in 0u8..4,
            other in any::<String>(),
            raw in proptest::collection::vec(any::<u8>(), 0..200),
            damage in proptest::collection::vec((any::<Index>(), any::<u8>()), 0..3),
            use_raw in any::<bool>(),
        ) {
            let pointer = pointer_into(&v, at, how, other);
            let body = if use_raw {
                raw
            } else {
                let mut body = serde_json::to_vec(&v).unwrap();
                for (i, b) in damage {
                    let i = i.index(body.len());
                    body[i] = b;
                }
                body
            };
            let got = from_json_body(&body, &pointer);
            if let Ok(Some(key)) = &got {
                assert_accepted_key_is_valid(key)?;
            }
            match serde_json::from_slice::<Value>(&body) {
                Ok(parsed) => check_against_pointer(&parsed, &pointer, got)?,
                Err(_) => prop_assert_eq!(got, Ok(None)),
            }
        }
    }
}
