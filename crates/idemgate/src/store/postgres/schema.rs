//! The store's tables, created (or checked) at the first connection that succeeds and
//! versioned: `idemgate_schema` holds the version of the layout of `idemgate_records`, and a
//! layout newer than this build is refused.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::config::server_error;
use crate::store::StoreError;

/// The layout of the records table this build reads and writes. Raised with every change to
/// it, with a migration from each older version in [`setup`].
pub(super) const SCHEMA_VERSION: i32 = 2;

/// The advisory lock held (for one transaction) while a gateway sets the tables up, so that
/// gateways starting together do not race to create them. "idemgate" in ASCII.
const SETUP_LOCK: i64 = 0x6964_656d_6761_7465;

const CREATE_META: &str = "CREATE TABLE IF NOT EXISTS idemgate_schema (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    version integer NOT NULL
)";

/// Version 2. One row per record; times are the database's (`now()` when written). A record is
/// live while `now() < expires_at`; expired rows are never returned and are deleted in
/// batches through the index on `expires_at`. Autovacuum is asked to visit the table after 1%
/// of its rows changed rather than PostgreSQL's default 20%: every row is inserted, updated
/// and deleted within its ttl, so the table churns far more than it grows.
///
/// The table has no `CHECK` constraints (version 1 had three, tying `state` to `owner`,
/// `lease_deadline` and `body`): PostgreSQL reads each constraint's expression again for every
/// statement that writes a row, about a fifth of the server's CPU for a claim and its
/// completion. Only idemgate writes the table, every statement sets those columns together,
/// and a row that breaks the rule is read as a corrupt record, never trusted.
const CREATE_V2: &str = "
CREATE TABLE idemgate_records (
    key bytea PRIMARY KEY,
    state text NOT NULL,
    fingerprint bytea NOT NULL,
    owner bytea,
    lease_deadline timestamptz,
    stored_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    body bytea
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);
CREATE INDEX idemgate_records_expires_at ON idemgate_records (expires_at);
COMMENT ON TABLE idemgate_records IS
    'idemgate idempotency records (schema version in idemgate_schema); written only by idemgate';
INSERT INTO idemgate_schema (version) VALUES (2);
";

/// From version 1 to 2: the table's `CHECK` constraints dropped, whatever their names.
const MIGRATE_V1_TO_V2: &str = "
DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint
             WHERE conrelid = 'idemgate_records'::regclass AND contype = 'c'
    LOOP
        EXECUTE format('ALTER TABLE idemgate_records DROP CONSTRAINT %I', c.conname);
    END LOOP;
END $$;
UPDATE idemgate_schema SET version = 2;
";

/// The records table is newer than this build: refused, so an older gateway never misreads
/// or corrupts records a newer one wrote.
#[derive(Debug, thiserror::Error)]
#[error(
    "the idemgate_records table has schema version {found}, newer than version {supported} \
     that this idemgate reads and writes; upgrade idemgate (or point it at another database)"
)]
pub(super) struct NewerSchema {
    found: i32,
    supported: i32,
}

/// The error every call of a store gets while its table is of version `found`, newer than
/// this build's.
fn refused_error(server: &str, found: i32) -> StoreError {
    server_error(
        server,
        "refusing the records table",
        Some(Box::new(NewerSchema {
            found,
            supported: SCHEMA_VERSION,
        })),
    )
}

/// How long a store that found a newer table answers every call with that refusal before it
/// reads the version again (an operator may have pointed it elsewhere, or restored a table).
const RECHECK_REFUSAL: Duration = Duration::from_secs(1);

/// Whether a store's tables have been set up (created, or their version checked) on its
/// database: done once, by the first call whose connection to the server succeeds, so that a
/// store can be made while PostgreSQL is down.
#[derive(Debug, Default)]
pub(super) struct Check {
    /// Set once the tables are there in this build's version.
    ready: OnceCell<()>,
    /// The newer version found, and when it was read.
    refused: Mutex<Option<(i32, Instant)>>,
}

impl Check {
    /// Whether the tables were set up already: then nothing is left to do, ever.
    pub(super) fn is_ready(&self) -> bool {
        self.ready.initialized()
    }

    /// The refusal of a newer table read less than [`RECHECK_REFUSAL`] ago, if any: answered
    /// without a round trip.
    pub(super) fn recent_refusal(&self, server: &str) -> Result<(), StoreError> {
        let refused = *self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        match refused {
            Some((found, at)) if at.elapsed() < RECHECK_REFUSAL => {
                Err(refused_error(server, found))
            }
            _ => Ok(()),
        }
    }

    /// Sets the tables up on `client` unless that is done already; concurrent callers wait
    /// for the one setting up (and try again themselves if it fails).
    pub(super) async fn ensure(
        &self,
        client: &mut Object,
        server: &str,
        pg_error: impl Fn(tokio_postgres::Error) -> StoreError,
    ) -> Result<(), StoreError> {
        self.ready
            .get_or_try_init(|| async {
                // A caller that waited for another's refusal does not read the version again.
                self.recent_refusal(server)?;
                let outcome = setup(client, server, pg_error).await;
                let mut refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
                match outcome? {
                    Setup::Ready => {
                        *refused = None;
                        Ok(())
                    }
                    Setup::Newer(found) => {
                        *refused = Some((found, Instant::now()));
                        Err(refused_error(server, found))
                    }
                }
            })
            .await
            .map(drop)
    }
}

/// What [`setup`] found.
enum Setup {
    /// The tables are there (now) in this build's version.
    Ready,
    /// The table is of this newer version; nothing was changed.
    Newer(i32),
}

/// Creates the tables if they are missing, or checks their version, in one transaction under
/// [`SETUP_LOCK`].
async fn setup(
    client: &mut Object,
    server: &str,
    pg_error: impl Fn(tokio_postgres::Error) -> StoreError,
) -> Result<Setup, StoreError> {
    let tx = client.transaction().await.map_err(&pg_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SETUP_LOCK])
        .await
        .map_err(&pg_error)?;
    tx.batch_execute(CREATE_META).await.map_err(&pg_error)?;
    let found: Option<i32> = tx
        .query_opt("SELECT version FROM idemgate_schema", &[])
        .await
        .map_err(&pg_error)?
        .map(|row| row.get(0));
    match found {
        None => {
            tx.batch_execute(CREATE_V2).await.map_err(&pg_error)?;
            tracing::info!(postgres = %server, version = SCHEMA_VERSION, "created the idemgate_records table");
        }
        Some(1) => {
            tx.batch_execute(MIGRATE_V1_TO_V2)
                .await
                .map_err(&pg_error)?;
            tracing::info!(postgres = %server, from = 1, to = SCHEMA_VERSION, "migrated the idemgate_records table");
        }
        Some(SCHEMA_VERSION) => {}
        Some(found) if found > SCHEMA_VERSION => return Ok(Setup::Newer(found)),
        Some(found) => {
            return Err(server_error(
                server,
                format!("idemgate_schema holds version {found}, which no idemgate wrote"),
                None,
            ));
        }
    }
    tx.commit().await.map_err(&pg_error)?;
    Ok(Setup::Ready)
}
