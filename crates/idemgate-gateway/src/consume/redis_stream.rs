//! The Redis Streams [`Source`]: a consumer group read with `XREADGROUP`, settled with
//! `XACK`, dead letters written with `XADD` in the same `MULTI` as their `XACK`, stale
//! entries of dead consumers taken over with `XAUTOCLAIM`, and the entries waiting for a
//! retry kept from them with `XCLAIM … JUSTID`.
//!
//! Blocking reads have a connection of their own: Redis answers a connection's commands in
//! order, so an acknowledgement queued behind a read blocked for a second would wait for it.

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, Value};

use super::config::StreamSpec;
use super::source::{Backlog, DeadLetter, Entry, Source, SourceError};

/// Bound on a command that does not block (acknowledgements, claims, dead letters).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A Redis stream read through a consumer group.
pub(super) struct RedisStreamSource {
    spec: StreamSpec,
    name: String,
    dead_letter_stream: String,
    reads: ConnectionManager,
    commands: ConnectionManager,
    /// Where the next read of this consumer's own pending entries (left by an earlier run
    /// under the same name) starts: after the last one read, so that entries still in flight
    /// are not read again. `None` once they have all been read; reads then ask for new
    /// entries.
    history: Mutex<Option<String>>,
    /// Where the next `XAUTOCLAIM` scan starts.
    claim_cursor: Mutex<String>,
}

impl std::fmt::Debug for RedisStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamSource")
            .field("source", &self.name)
            .field("consumer", &self.spec.consumer)
            .finish_non_exhaustive()
    }
}

impl RedisStreamSource {
    /// A source on `spec`, writing dead letters to `dead_letter_stream`. Redis is not
    /// contacted here: a consumer starts while it is down and reads once it answers.
    pub(super) fn connect_lazy(
        spec: StreamSpec,
        dead_letter_stream: String,
        block: Duration,
    ) -> Result<Self, SourceError> {
        let name = spec.to_string();
        let error = |cause: RedisError| SourceError {
            source_name: name.clone(),
            what: "connect",
            cause: Box::new(cause),
        };
        let client = redis::Client::open(spec.redis_url.as_str()).map_err(error)?;
        let config = |timeout| {
            ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
        };
        let reads = ConnectionManager::new_lazy_with_config(
            client.clone(),
            config(block + COMMAND_TIMEOUT),
        )
        .map_err(error)?;
        let commands = ConnectionManager::new_lazy_with_config(client, config(COMMAND_TIMEOUT))
            .map_err(error)?;
        Ok(Self {
            spec,
            name,
            dead_letter_stream,
            reads,
            commands,
            history: Mutex::new(Some("0".to_owned())),
            claim_cursor: Mutex::new("0-0".to_owned()),
        })
    }

    fn error(&self, what: &'static str, cause: RedisError) -> SourceError {
        SourceError {
            source_name: self.name.clone(),
            what,
            cause: Box::new(cause),
        }
    }

    /// Creates the group (and the stream) if missing. A new group starts at the stream's
    /// first entry, so nothing written before the first consumer started is skipped.
    async fn create_group(&self) -> Result<(), SourceError> {
        let created: Result<Value, RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.spec.stream)
            .arg(&self.spec.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.commands.clone())
            .await;
        match created {
            Ok(_) => {
                tracing::info!(source = %self.name, "consumer group created");
                Ok(())
            }
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(self.error("XGROUP CREATE", e)),
        }
    }

    async fn read_group(
        &self,
        id: &str,
        max: usize,
        block: Option<Duration>,
    ) -> Result<Value, RedisError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.spec.group)
            .arg(&self.spec.consumer)
            .arg("COUNT")
            .arg(max);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS").arg(&self.spec.stream).arg(id);
        cmd.query_async(&mut self.reads.clone()).await
    }
}

/// Whether Redis said the group (or its stream) is missing: a first start, or a Redis that
/// lost its data.
fn no_group(error: &RedisError) -> bool {
    error.code() == Some("NOGROUP")
}

#[async_trait]
impl Source for RedisStreamSource {
    fn name(&self) -> &str {
        &self.name
    }

    async fn read(&self, max: usize, block: Duration) -> Result<Vec<Entry>, SourceError> {
        let history = self
            .history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (id, block) = match &history {
            Some(after) => (after.as_str(), None),
            None => (">", Some(block)),
        };
        let reply = match self.read_group(id, max, block).await {
            Err(e) if no_group(&e) => {
                self.create_group().await?;
                self.read_group(id, max, block).await
            }
            reply => reply,
        };
        let reply = reply.map_err(|e| self.error("XREADGROUP", e))?;
        let entries = stream_entries(&reply);
        if history.is_some() {
            *self.history.lock().unwrap_or_else(|p| p.into_inner()) =
                entries.last().map(|last| last.id.clone());
        }
        Ok(entries)
    }

    async fn claim_stale(&self, min_idle: Duration, max: usize) -> Result<Vec<Entry>, SourceError> {
        let start = self
            .claim_cursor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let claimed = redis::cmd("XAUTOCLAIM")
            .arg(&self.spec.stream)
            .arg(&self.spec.group)
            .arg(&self.spec.consumer)
            .arg(min_idle.as_millis() as u64)
            .arg(&start)
            .arg("COUNT")
            .arg(max)
            .query_async(&mut self.commands.clone())
            .await;
        let reply: Value = match claimed {
            Ok(reply) => reply,
            // No group yet, so nothing pending to take over.
            Err(e) if no_group(&e) => {
                self.create_group().await?;
                return Ok(Vec::new());
            }
            Err(e) => return Err(self.error("XAUTOCLAIM", e)),
        };
        let Value::Array(parts) = reply else {
            return Err(self.error("XAUTOCLAIM", unexpected("XAUTOCLAIM")));
        };
        let next = parts
            .first()
            .and_then(text)
            .unwrap_or_else(|| "0-0".to_owned());
        *self.claim_cursor.lock().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(parts.get(1).map(entry_list).unwrap_or_default())
    }

    async fn touch(&self, id: &str) -> Result<(), SourceError> {
        // XCLAIM by the entry's own consumer with no minimum idle time: only the idle time
        // changes (JUSTID leaves the delivery count alone).
        let _: Value = redis::cmd("XCLAIM")
            .arg(&self.spec.stream)
            .arg(&self.spec.group)
            .arg(&self.spec.consumer)
            .arg(0)
            .arg(id)
            .arg("JUSTID")
            .query_async(&mut self.commands.clone())
            .await
            .map_err(|e| self.error("XCLAIM", e))?;
        Ok(())
    }

    async fn ack(&self, id: &str) -> Result<(), SourceError> {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.spec.stream)
            .arg(&self.spec.group)
            .arg(id)
            .query_async(&mut self.commands.clone())
            .await
            .map_err(|e| self.error("XACK", e))?;
        Ok(())
    }

    async fn dead_letter(&self, entry: &Entry, letter: &DeadLetter) -> Result<(), SourceError> {
        let fields: serde_json::Map<String, serde_json::Value> = entry
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned().into()))
            .collect();
        let mut add = redis::cmd("XADD");
        add.arg(&self.dead_letter_stream)
            .arg("*")
            .arg("reason")
            .arg(letter.reason)
            .arg("detail")
            .arg(&letter.detail)
            .arg("ambiguous")
            .arg(if letter.ambiguous { "true" } else { "false" })
            .arg("attempts")
            .arg(letter.attempts)
            .arg("stream")
            .arg(&self.spec.stream)
            .arg("group")
            .arg(&self.spec.group)
            .arg("entry_id")
            .arg(&entry.id)
            .arg("fields")
            .arg(serde_json::Value::Object(fields).to_string());
        if let Some(status) = letter.status {
            add.arg("status").arg(status);
        }
        if let Some(key) = &letter.key {
            add.arg("key").arg(key);
        }
        let mut ack = redis::cmd("XACK");
        ack.arg(&self.spec.stream)
            .arg(&self.spec.group)
            .arg(&entry.id);
        let _: Value = redis::pipe()
            .atomic()
            .add_command(add)
            .add_command(ack)
            .query_async(&mut self.commands.clone())
            .await
            .map_err(|e| self.error("XADD dead letter + XACK", e))?;
        Ok(())
    }

    async fn backlog(&self) -> Result<Backlog, SourceError> {
        let groups: Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.spec.stream)
            .query_async(&mut self.commands.clone())
            .await
            .map_err(|e| self.error("XINFO GROUPS", e))?;
        let Value::Array(groups) = groups else {
            return Err(self.error("XINFO GROUPS", unexpected("XINFO GROUPS")));
        };
        let backlog = groups.iter().map(pairs).find_map(|group| {
            let name = group
                .iter()
                .find(|(k, _)| k == "name")
                .and_then(|(_, v)| text(v));
            (name.as_deref() == Some(self.spec.group.as_str())).then(|| Backlog {
                pending: number(&group, "pending").unwrap_or(0),
                lag: number(&group, "lag"),
            })
        });
        Ok(backlog.unwrap_or_default())
    }
}

fn unexpected(command: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Parse, "unexpected reply", command.to_owned()))
}

/// The entries of an `XREADGROUP` reply for one stream (nil when none arrived in time).
fn stream_entries(reply: &Value) -> Vec<Entry> {
    match reply {
        Value::Array(streams) => streams
            .iter()
            .filter_map(|stream| match stream {
                Value::Array(parts) => parts.get(1).map(entry_list),
                _ => None,
            })
            .flatten()
            .collect(),
        Value::Map(streams) => streams.iter().flat_map(|(_, v)| entry_list(v)).collect(),
        _ => Vec::new(),
    }
}

/// `[[id, [field, value, …]], …]`. An entry deleted from the stream while pending comes
/// back with no fields (nil).
fn entry_list(list: &Value) -> Vec<Entry> {
    let Value::Array(items) = list else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let Value::Array(parts) = item else {
                return None;
            };
            let id = parts.first().and_then(text)?;
            let fields = match parts.get(1) {
                Some(Value::Array(flat)) => flat
                    .chunks_exact(2)
                    .filter_map(|kv| Some((text(&kv[0])?, bytes(&kv[1])?)))
                    .collect(),
                _ => Vec::new(),
            };
            Some(Entry { id, fields })
        })
        .collect()
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Int(n) => Some(Bytes::from(n.to_string())),
        _ => None,
    }
}

/// A flat `[key, value, …]` reply (or a RESP3 map) as pairs.
fn pairs(value: &Value) -> Vec<(String, Value)> {
    match value {
        Value::Array(flat) => flat
            .chunks_exact(2)
            .filter_map(|kv| Some((text(&kv[0])?, kv[1].clone())))
            .collect(),
        Value::Map(map) => map
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, v.clone())))
            .collect(),
        _ => Vec::new(),
    }
}

fn number(pairs: &[(String, Value)], name: &str) -> Option<u64> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| match v {
            Value::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn read_replies_become_entries_in_field_order() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![
                Value::Array(vec![
                    bulk("1-0"),
                    Value::Array(vec![bulk("z"), bulk("1"), bulk("a"), bulk("2")]),
                ]),
                // Deleted while pending: no fields.
                Value::Array(vec![bulk("2-0"), Value::Nil]),
            ]),
        ])]);
        let entries = stream_entries(&reply);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(
            entries[0].fields,
            vec![
                ("z".to_owned(), Bytes::from("1")),
                ("a".to_owned(), Bytes::from("2"))
            ]
        );
        assert!(entries[1].fields.is_empty());
        assert!(stream_entries(&Value::Nil).is_empty());
    }
}
