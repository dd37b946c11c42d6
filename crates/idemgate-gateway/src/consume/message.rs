//! What an entry becomes on its way to the handler: its key and its body.

use bytes::Bytes;

use super::config::KeyField;
use super::source::Entry;

/// `Content-Type` of a body that is JSON (the entry's fields, or a payload that parses).
pub const JSON: &str = "application/json";
/// `Content-Type` of a payload that is not JSON.
pub const OCTETS: &str = "application/octet-stream";

/// An entry ready to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The idempotency key.
    pub key: String,
    /// The request body.
    pub body: Bytes,
    /// Its `Content-Type`.
    pub content_type: &'static str,
}

/// How the consumer reads entries into messages.
#[derive(Clone, Debug)]
pub struct Reading {
    /// Where the key is.
    pub key_field: KeyField,
    /// Whether the entry id stands in for a missing key.
    pub entry_id_fallback: bool,
    /// The field whose value is the body.
    pub payload_field: String,
}

impl Reading {
    /// The message `entry` carries, or why it has no key (for its dead letter).
    pub fn message(&self, entry: &Entry) -> Result<Message, String> {
        let (key, read_as_json) = match self.key(entry) {
            Ok(found) => found,
            Err(_) if self.entry_id_fallback => (entry.id.clone(), None),
            Err(why) => return Err(why),
        };
        let (body, content_type) = match entry.field(&self.payload_field) {
            Some(payload) => {
                // A key found by JSON pointer in the payload has shown it is JSON already.
                let json = read_as_json == Some(self.payload_field.as_str())
                    || serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_ok();
                (payload.clone(), if json { JSON } else { OCTETS })
            }
            None => (fields_as_json(entry), JSON),
        };
        Ok(Message {
            key,
            body,
            content_type,
        })
    }

    /// The entry's key, and the field it was read from when that field was parsed as JSON.
    fn key(&self, entry: &Entry) -> Result<(String, Option<&str>), String> {
        match &self.key_field {
            KeyField::Field(name) => {
                let value = entry
                    .field(name)
                    .ok_or_else(|| format!("the entry has no field {name:?}"))?;
                let key = std::str::from_utf8(value)
                    .map_err(|_| format!("the field {name:?} is not UTF-8"))?;
                if key.is_empty() {
                    return Err(format!("the field {name:?} is empty"));
                }
                Ok((key.to_owned(), None))
            }
            KeyField::JsonPointer { field, pointer } => {
                let value = entry
                    .field(field)
                    .ok_or_else(|| format!("the entry has no field {field:?}"))?;
                let document: serde_json::Value = serde_json::from_slice(value)
                    .map_err(|_| format!("the field {field:?} is not JSON"))?;
                match document.pointer(pointer) {
                    Some(serde_json::Value::String(s)) if !s.is_empty() => {
                        Ok((s.clone(), Some(field)))
                    }
                    Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                        Ok((n.to_string(), Some(field)))
                    }
                    Some(_) => Err(format!(
                        "{pointer} in the field {field:?} is not a non-empty string or an integer"
                    )),
                    None => Err(format!("the field {field:?} has nothing at {pointer}")),
                }
            }
        }
    }
}

/// The entry's fields as one JSON object, keys sorted: two entries with the same fields give
/// the same bytes, whatever order their producers wrote them in, so a producer's duplicate
/// has the first one's fingerprint.
fn fields_as_json(entry: &Entry) -> Bytes {
    let object: std::collections::BTreeMap<&str, String> = entry
        .fields
        .iter()
        .map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v).into_owned()))
        .collect();
    Bytes::from(serde_json::to_vec(&object).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fields: &[(&str, &str)]) -> Entry {
        Entry {
            id: "7-0".into(),
            fields: fields
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Bytes::from((*v).to_owned())))
                .collect(),
        }
    }

    fn reading(key: &str, fallback: bool) -> Reading {
        Reading {
            key_field: KeyField::parse(key).unwrap(),
            entry_id_fallback: fallback,
            payload_field: "payload".into(),
        }
    }

    #[test]
    fn the_key_is_a_field_and_the_body_the_payload() {
        let m = reading("event_id", false)
            .message(&entry(&[("event_id", "e-1"), ("payload", "{\"a\":1}")]))
            .unwrap();
        assert_eq!(
            (m.key.as_str(), &m.body[..], m.content_type),
            ("e-1", &b"{\"a\":1}"[..], JSON)
        );
        let plain = reading("event_id", false)
            .message(&entry(&[("event_id", "e-1"), ("payload", "not json")]))
            .unwrap();
        assert_eq!(plain.content_type, OCTETS);
    }

    #[test]
    fn without_a_payload_the_fields_go_as_sorted_json() {
        let one = reading("id", false).message(&entry(&[("id", "9"), ("b", "2"), ("a", "1")]));
        let other = reading("id", false).message(&entry(&[("a", "1"), ("id", "9"), ("b", "2")]));
        let one = one.unwrap();
        assert_eq!(&one.body[..], br#"{"a":"1","b":"2","id":"9"}"#);
        assert_eq!(one, other.unwrap());
    }

    #[test]
    fn the_key_may_be_inside_the_json_payload() {
        let r = reading("payload:/data/id", false);
        let m = r
            .message(&entry(&[("payload", r#"{"data":{"id":42}}"#)]))
            .unwrap();
        assert_eq!((m.key.as_str(), m.content_type), ("42", JSON));
        let missing = r
            .message(&entry(&[("payload", r#"{"data":{}}"#)]))
            .unwrap_err();
        assert!(missing.contains("nothing at /data/id"), "{missing}");
        let not_json = r.message(&entry(&[("payload", "x")])).unwrap_err();
        assert!(not_json.contains("not JSON"), "{not_json}");
    }

    #[test]
    fn a_missing_key_is_refused_unless_the_entry_id_may_stand_in() {
        let e = entry(&[("payload", "{}")]);
        let why = reading("event_id", false).message(&e).unwrap_err();
        assert_eq!(why, "the entry has no field \"event_id\"");
        assert_eq!(reading("event_id", true).message(&e).unwrap().key, "7-0");
    }
}
