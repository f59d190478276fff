//! The shared [`Store`] backend: PostgreSQL, for fleets whose retrieval
//! workers run on many hosts against one store.
//!
//! Two tables per prefix (`<prefix>_documents`, `<prefix>_items`), made
//! by versioned migrations that `toolfleet index migrate` runs as the
//! tables' owner ([`PostgresStore::migrate`], recorded in
//! `<prefix>_schema_migrations`); a worker only checks the version at
//! connect and alters nothing, so its role needs no DDL rights. Items are
//! ranked by full-text search over a generated `tsvector` column (title
//! weighted above text, GIN-indexed) with `websearch_to_tsquery`, which
//! reads any text without syntax errors; a query of stop words only has no
//! lexemes and finds nothing. A document's record and chunks are replaced
//! in one transaction.
//!
//! Vectors are kept as `real[]`. When the `vector` extension (pgvector) is
//! installed on the server — or can be created by the migrating role — and
//! the migration was given the embedding model's dimensions `N`, each
//! vector of `N` dimensions is also stored in a `vec vector(N)` column with
//! an HNSW index (cosine; pgvector 0.5 on, `N` up to 2000), and similarity
//! search runs inside PostgreSQL as `ORDER BY vec <=> q LIMIT k`, the shape
//! the index serves. HNSW is approximate and filters apply to what it
//! returns: the planner uses it when the tenant and scope filters keep
//! many rows, and scans the filtered rows exactly when they keep few.
//! Vectors of other dimensions, or all of them without pgvector, are read
//! as arrays and scored here, exactly. Rows written before the column
//! appeared are filled in by the next migration run.
//!
//! Statements run on connections of a pool (deadpool-postgres): a
//! connection found closed (PostgreSQL restarted, a network cut) is
//! dropped and a new one opened for the next statement, so searches recover
//! when the server returns, without restarting the worker. While the server
//! is down a statement fails as [`StoreError::Unavailable`].

use std::fmt::Write as _;
use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_postgres::Client;
#[cfg(test)]
use tokio_postgres::NoTls;
use tokio_postgres::types::ToSql;

use crate::analysis::sanitize_query;
use crate::model::{Item, normalize_entity};
use crate::search::{Hit, MAX_TOP_K, Query, has_direction, similarity, top_k_by_score};
use crate::store::{DocumentRecord, DocumentSummary, Store, StoreError, check_tenant};
use toolfleet_worker::protocol::DEFAULT_TENANT;

/// The PostgreSQL backend. Cheap to clone.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    documents: String,
    items: String,
    /// When vectors are searched in the database: the pgvector version
    /// and the `vec` column's dimensions.
    vectors: Option<(String, usize)>,
}

/// pgvector's limit on a `vector`'s dimensions: a longer vector is kept
/// only as an array and searched here.
const PGVECTOR_MAX_DIMENSIONS: usize = 16_000;
/// pgvector's limit on the dimensions of a `vector` an HNSW index holds:
/// a longer column is searched exactly, without one.
pub const HNSW_MAX_DIMENSIONS: usize = 2_000;

/// The schema version this release reads and writes: the last of
/// [`MIGRATIONS`].
pub const SCHEMA_VERSION: i32 = 1;

/// The versioned migrations, in order: (version, what it does).
const MIGRATIONS: &[(i32, &str)] = &[(
    1,
    "tables keyed by (tenant, id); full-text, scope and time indexes; vectors as real[]",
)];

/// What [`PostgresStore::migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    /// The schema version the tables are at now.
    pub version: i32,
    /// The migrations this run applied (none when already current).
    pub applied: Vec<(i32, &'static str)>,
    /// The pgvector version when vectors are searched in the database.
    pub pgvector: Option<String>,
    /// The `vec` column's dimensions (`vector(N)`), when it exists.
    pub dimensions: Option<usize>,
    /// Whether the column has its HNSW index.
    pub hnsw: bool,
}

fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    let valid = !prefix.is_empty()
        && prefix.len() <= 32
        && prefix.starts_with(|c: char| c.is_ascii_lowercase())
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "table prefix {prefix:?} must be 1-32 of a-z, 0-9 and _, starting with a letter"
        )))
    }
}

/// The schema version `<prefix>_schema_migrations` records: 0 when the
/// table is missing (never migrated).
async fn schema_version(client: &Client, prefix: &str) -> Result<i32, StoreError> {
    let table = format!("{prefix}_schema_migrations");
    let exists = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(pg("looking for the migrations table"))?
        .get::<_, bool>(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {table}"),
            &[],
        )
        .await
        .map_err(pg("reading the schema version"))?
        .get(0))
}

/// The `vec` column as a migration run left it.
struct VectorColumn {
    version: String,
    dimensions: usize,
    hnsw: bool,
}

/// Connections the pool keeps open at most.
pub const POOL_SIZE: usize = 16;
/// How long opening a connection (TCP, TLS, authentication) may take when
/// the URL sets no `connect_timeout`, and how long a statement waits for a
/// free connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn pg(action: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |e| {
        // The server going away (shutting down, refusing connections while
        // it starts, the connection lost) is unavailability, not a failure
        // of the statement.
        let going_away = e
            .code()
            .is_some_and(|c| c.code().starts_with("08") || c.code().starts_with("57P"));
        if e.is_closed() || going_away {
            StoreError::Unavailable(format!("{action}: the PostgreSQL connection is closed"))
        } else {
            // The database's own message, never the connection string;
            // else the error and its causes (a TLS handshake's says why).
            let detail = e.as_db_error().map_or_else(
                || {
                    let mut detail = e.to_string();
                    let mut source = std::error::Error::source(&e);
                    while let Some(cause) = source {
                        let _ = write!(detail, ": {cause}");
                        source = cause.source();
                    }
                    detail
                },
                |d| d.message().to_owned(),
            );
            StoreError::Engine(format!("{action}: {detail}"))
        }
    }
}

fn pool_error(action: &'static str) -> impl FnOnce(PoolError) -> StoreError {
    move |e| match e {
        PoolError::Backend(e) => match pg(action)(e) {
            StoreError::Engine(detail) => StoreError::Unavailable(detail),
            other => other,
        },
        // The pool's own messages (a timeout, closed) hold no URL.
        other => StoreError::Unavailable(format!("{action}: {other}")),
    }
}

/// The pool of connections to `url` (opened as statements need them).
fn pool(url: &str) -> Result<Pool, StoreError> {
    let (url, tls) = crate::postgres_tls::split(url)?;
    let mut config: tokio_postgres::Config = url
        .parse()
        // The parser's message names the bad part, never the password.
        .map_err(|e| StoreError::Invalid(format!("the PostgreSQL URL: {e}")))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    config.ssl_mode(tls.tokio_mode());
    let manager = Manager::from_config(
        config,
        tls.connector()?,
        ManagerConfig {
            // `Fast`: a connection whose task has ended is replaced; one
            // that died unnoticed fails its statement once, then is.
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(POOL_SIZE)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(CONNECT_TIMEOUT * 2))
        .create_timeout(Some(CONNECT_TIMEOUT * 2))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|e| StoreError::Engine(format!("building the PostgreSQL pool: {e}")))
}

/// A connection of its own, outside any pool (tests' administration).
#[cfg(test)]
async fn connect(url: &str) -> Result<Client, StoreError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.map_err(|e| {
        // The URL may hold a password: say what failed, not where.
        StoreError::Unavailable(format!("connecting to PostgreSQL: {e}"))
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

impl PostgresStore {
    /// Connects to `url` and opens the tables of `prefix`, which
    /// `toolfleet index migrate` ([`PostgresStore::migrate`]) has brought to
    /// [`SCHEMA_VERSION`]. Nothing is created or altered: the role needs
    /// only SELECT, INSERT, UPDATE and DELETE on them. `prefix` is 1-32 of
    /// `[a-z0-9_]`, starting with a letter.
    ///
    /// # Errors
    ///
    /// [`StoreError::Invalid`] for a bad prefix, [`StoreError::Unavailable`]
    /// when PostgreSQL cannot be reached or the tables are not at this
    /// release's schema version (saying to run `toolfleet index migrate`).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        check_prefix(prefix)?;
        let pool = pool(url)?;
        let documents = format!("{prefix}_documents");
        let items = format!("{prefix}_items");
        let client = pool
            .get()
            .await
            .map_err(pool_error("connecting to PostgreSQL"))?;
        let version = schema_version(&client, prefix).await?;
        if version != SCHEMA_VERSION {
            let why = if version < SCHEMA_VERSION {
                format!(
                    "the PostgreSQL tables of prefix {prefix:?} are at schema version {version}, \
                     this release needs {SCHEMA_VERSION}: run `toolfleet index migrate \
                     --store postgres --postgres-prefix {prefix}` as the tables' owner first"
                )
            } else {
                format!(
                    "the PostgreSQL tables of prefix {prefix:?} are at schema version {version}, \
                     newer than this release's {SCHEMA_VERSION}: upgrade this worker"
                )
            };
            return Err(StoreError::Unavailable(why));
        }
        // The typed column a migration made: its dimensions are its
        // typmod (an untyped column of an earlier release has -1 and is
        // not used until migrations type it).
        let vectors = client
            .query_opt(
                "SELECT e.extversion::text, a.atttypmod FROM pg_extension e, pg_attribute a
                 WHERE e.extname = 'vector' AND a.attrelid = to_regclass($1)
                   AND a.attname = 'vec' AND NOT a.attisdropped",
                &[&items],
            )
            .await
            .map_err(pg("looking for pgvector"))?
            .and_then(|row| {
                let dimensions = usize::try_from(row.get::<_, i32>(1)).ok()?;
                Some((row.get::<_, String>(0), dimensions))
            });
        drop(client);
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                documents,
                items,
                vectors,
            }),
        })
    }

    /// Brings the tables of `prefix` to [`SCHEMA_VERSION`]: each missing
    /// migration in its own transaction, under an advisory lock (two runs
    /// at once migrate once), recorded in `<prefix>_schema_migrations`;
    /// then, when the server has pgvector (installed, or creatable by this
    /// role), the `vec` column, filled for rows that predate it. Idempotent:
    /// a second run changes nothing. Run as the tables' owner (it needs
    /// CREATE); workers then need no DDL rights.
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::connect`]; [`StoreError::Engine`] when a
    /// migration fails (rolled back), [`StoreError::Invalid`] when the
    /// tables are newer than this release.
    pub async fn migrate(
        url: &str,
        prefix: &str,
        dimensions: Option<usize>,
    ) -> Result<Migrated, StoreError> {
        check_prefix(prefix)?;
        let pool = pool(url)?;
        let client = pool
            .get()
            .await
            .map_err(pool_error("connecting to PostgreSQL"))?;
        let documents = format!("{prefix}_documents");
        let items = format!("{prefix}_items");
        let migrations = format!("{prefix}_schema_migrations");
        let lock = format!("toolfleet-retrieval:{prefix}");
        let mut applied = Vec::new();
        for &(version, description) in MIGRATIONS {
            client
                .batch_execute("BEGIN")
                .await
                .map_err(pg("beginning a migration"))?;
            let done = async {
                client
                    .execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&lock])
                    .await
                    .map_err(pg("locking the schema"))?;
                client
                    .batch_execute(&format!(
                        "CREATE TABLE IF NOT EXISTS {migrations} (
                            version integer PRIMARY KEY,
                            description text NOT NULL,
                            applied_at timestamptz NOT NULL DEFAULT now())"
                    ))
                    .await
                    .map_err(pg("creating the migrations table"))?;
                let current = schema_version(&client, prefix).await?;
                if current > SCHEMA_VERSION {
                    return Err(StoreError::Invalid(format!(
                        "the PostgreSQL tables of prefix {prefix:?} are at schema version \
                         {current}, newer than this release's {SCHEMA_VERSION}"
                    )));
                }
                if current >= version {
                    return Ok(false);
                }
                match version {
                    1 => Self::create_tables(&client, &documents, &items).await?,
                    _ => unreachable!("every migration has its step"),
                }
                client
                    .execute(
                        &format!("INSERT INTO {migrations} (version, description) VALUES ($1, $2)"),
                        &[&version, &description],
                    )
                    .await
                    .map_err(pg("recording a migration"))?;
                Ok(true)
            }
            .await;
            let end = if done.is_ok() { "COMMIT" } else { "ROLLBACK" };
            let ended = client
                .batch_execute(end)
                .await
                .map_err(pg("ending a migration"));
            let done = done?;
            ended?;
            if done {
                applied.push((version, description));
            }
        }
        let vectors = Self::enable_pgvector(&client, &items, dimensions).await?;
        Ok(Migrated {
            version: SCHEMA_VERSION,
            applied,
            pgvector: vectors.as_ref().map(|v| v.version.clone()),
            dimensions: vectors.as_ref().map(|v| v.dimensions),
            hnsw: vectors.is_some_and(|v| v.hnsw),
        })
    }

    /// Migration 1: creates the tables when missing and migrates tables of
    /// a release before tenants (and before migrations) to tenants.
    async fn create_tables(
        client: &Client,
        documents: &str,
        items: &str,
    ) -> Result<(), StoreError> {
        client
            .batch_execute(&create_sql(documents, items))
            .await
            .map_err(pg("creating the tables"))?;
        for table in [documents, items] {
            Self::migrate_to_tenants(client, table).await?;
        }
        client
            .batch_execute(&index_sql(documents, items))
            .await
            .map_err(pg("creating the indexes"))
    }

    /// A table of an earlier release (no `tenant` column, keyed by `id`
    /// alone): every row becomes tenant [`DEFAULT_TENANT`]'s, the key
    /// becomes (tenant, id), and the old single-column indexes go (the
    /// tenant-led ones replace them). Nothing to do on a current table.
    async fn migrate_to_tenants(client: &Client, table: &str) -> Result<(), StoreError> {
        let has_tenant = client
            .query_opt(
                "SELECT 1 FROM information_schema.columns
                 WHERE table_schema = current_schema() AND table_name = $1
                   AND column_name = 'tenant'",
                &[&table],
            )
            .await
            .map_err(pg("looking for the tenant column"))?
            .is_some();
        if has_tenant {
            return Ok(());
        }
        let key = client
            .query_opt(
                "SELECT conname::text FROM pg_constraint
                 WHERE conrelid = $1::text::regclass AND contype = 'p'",
                &[&table],
            )
            .await
            .map_err(pg("reading the primary key"))?
            .map(|row| row.get::<_, String>(0));
        let drop_key = key
            .map(|name| format!("DROP CONSTRAINT \"{}\", ", name.replace('"', "\"\"")))
            .unwrap_or_default();
        client
            .batch_execute(&format!(
                "ALTER TABLE {table} ADD COLUMN tenant text NOT NULL DEFAULT '{DEFAULT_TENANT}';
                 ALTER TABLE {table} ALTER COLUMN tenant DROP DEFAULT, {drop_key}
                    ADD PRIMARY KEY (tenant, id);
                 DROP INDEX IF EXISTS {table}_collection;
                 DROP INDEX IF EXISTS {table}_document;"
            ))
            .await
            .map_err(pg("migrating a table to tenants"))?;
        tracing::warn!(
            table,
            tenant = DEFAULT_TENANT,
            "a retrieval table of an earlier release was migrated to tenants: its rows now belong to the default tenant"
        );
        Ok(())
    }

    /// A connection of the pool: an open one, or a new one.
    async fn client(&self, action: &'static str) -> Result<Object, StoreError> {
        self.inner.pool.get().await.map_err(pool_error(action))
    }

    /// One cheap statement through the pool: what `/readyz` asks.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] while PostgreSQL cannot be reached.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.client("checking PostgreSQL")
            .await?
            .simple_query("SELECT 1")
            .await
            .map_err(pg("checking PostgreSQL"))
            .map(drop)
    }

    /// The pgvector version in use, or `None` when vectors are scored by
    /// the worker (the extension is not installed on the server).
    #[must_use]
    pub fn pgvector(&self) -> Option<&str> {
        self.inner.vectors.as_ref().map(|(v, _)| v.as_str())
    }

    /// The dimensions of the vectors searched in the database (the `vec`
    /// column's `N`); others are scored by the worker.
    #[must_use]
    pub fn vector_dimensions(&self) -> Option<usize> {
        self.inner.vectors.as_ref().map(|(_, n)| *n)
    }

    /// Creates the `vector` extension when the server has it and the role
    /// may; makes the `vec` column `vector(dimensions)` (kept when it has
    /// them; an untyped one of an earlier release is replaced), fills it for
    /// rows that predate it, and builds its HNSW index (cosine) when pgvector
    /// has HNSW (0.5) and the dimensions fit one. Without `dimensions` an
    /// existing typed column is kept as it is, and none is made.
    async fn enable_pgvector(
        client: &Client,
        items: &str,
        dimensions: Option<usize>,
    ) -> Result<Option<VectorColumn>, StoreError> {
        let available = client
            .query_opt(
                "SELECT installed_version, default_version FROM pg_available_extensions
                 WHERE name = 'vector'",
                &[],
            )
            .await
            .map_err(pg("looking for pgvector"))?;
        let Some(row) = available else {
            return Ok(None);
        };
        if row.get::<_, Option<String>>(0).is_none()
            && let Err(e) = client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS vector")
                .await
        {
            let detail = e
                .as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned());
            tracing::warn!(
                error = %detail,
                "pgvector is available but could not be created; vectors are scored by the worker"
            );
            return Ok(None);
        }
        let existing: Option<i32> = client
            .query_opt(
                "SELECT atttypmod FROM pg_attribute
                 WHERE attrelid = to_regclass($1) AND attname = 'vec' AND NOT attisdropped",
                &[&items],
            )
            .await
            .map_err(pg("looking for the vector column"))?
            .map(|row| row.get(0));
        let existing = existing.and_then(|m| usize::try_from(m).ok());
        let dimensions = match (existing, dimensions) {
            (Some(has), Some(wanted)) if has != wanted => {
                return Err(StoreError::Invalid(format!(
                    "the vector column of {items} is vector({has}), not vector({wanted}): the \
                     dimensions are fixed when the column is made; to change them (a new \
                     embedding model), drop the column (ALTER TABLE {items} DROP COLUMN vec), \
                     migrate again and re-ingest"
                )));
            }
            (Some(has), _) => has,
            (None, Some(wanted)) if (1..=PGVECTOR_MAX_DIMENSIONS).contains(&wanted) => {
                // No column, or an untyped one: made anew, typed.
                client
                    .batch_execute(&format!(
                        "ALTER TABLE {items} DROP COLUMN IF EXISTS vec;
                         ALTER TABLE {items} ADD COLUMN vec vector({wanted});"
                    ))
                    .await
                    .map_err(pg("adding the vector column"))?;
                wanted
            }
            (None, Some(wanted)) => {
                return Err(StoreError::Invalid(format!(
                    "vector dimensions {wanted}: pgvector keeps 1 to {PGVECTOR_MAX_DIMENSIONS}"
                )));
            }
            (None, None) => return Ok(None),
        };
        // Rows written before the column (or before the extension) are
        // filled at every run.
        client
            .batch_execute(&format!(
                "UPDATE {items} SET vec = embedding::vector({dimensions})
                 WHERE embedding IS NOT NULL AND vec IS NULL
                   AND cardinality(embedding) = {dimensions}
                   AND array_position(embedding, NULL) IS NULL;"
            ))
            .await
            .map_err(pg("filling the vector column"))?;
        let version: String = client
            .query_one(
                "SELECT extversion FROM pg_extension WHERE extname = 'vector'",
                &[],
            )
            .await
            .map_err(pg("reading the pgvector version"))?
            .get(0);
        let hnsw = Self::build_hnsw(client, items, dimensions, &version).await?;
        Ok(Some(VectorColumn {
            version,
            dimensions,
            hnsw,
        }))
    }

    /// Builds the `vec` column's HNSW index (cosine) when missing, if
    /// pgvector has HNSW (0.5 on) and the dimensions fit one. Whether the
    /// column has it.
    async fn build_hnsw(
        client: &Client,
        items: &str,
        dimensions: usize,
        version: &str,
    ) -> Result<bool, StoreError> {
        let has_hnsw = client
            .query_opt("SELECT 1 FROM pg_am WHERE amname = 'hnsw'", &[])
            .await
            .map_err(pg("looking for HNSW"))?
            .is_some();
        let hnsw = has_hnsw && dimensions <= HNSW_MAX_DIMENSIONS;
        if hnsw {
            client
                .batch_execute(&format!(
                    "CREATE INDEX IF NOT EXISTS {items}_vec_hnsw ON {items}
                        USING hnsw (vec vector_cosine_ops);"
                ))
                .await
                .map_err(pg("building the HNSW index"))?;
        } else {
            tracing::warn!(
                dimensions,
                pgvector = %version,
                "no HNSW index (pgvector before 0.5, or more than {HNSW_MAX_DIMENSIONS} dimensions): vector searches scan"
            );
        }
        Ok(hnsw)
    }

    /// Inserts or replaces `items`, a thousand rows per statement (columns
    /// as arrays through `UNNEST`; entities and vectors, arrays per row,
    /// as JSON text). A later item with the same id wins.
    async fn insert_items(
        tx: &tokio_postgres::Transaction<'_>,
        table: &str,
        vector_dimensions: Option<usize>,
        tenant: &str,
        items: &[Item],
    ) -> Result<(), StoreError> {
        let statement = tx
            .prepare(&insert_sql(table, vector_dimensions))
            .await
            .map_err(pg("preparing an insert"))?;
        let rows = last_of_each_id(items)?;
        for batch in rows.chunks(1000) {
            // The text columns in statement order, without timestamp_ms.
            let mut columns: [Vec<Option<String>>; 14] = Default::default();
            let mut timestamps: Vec<i64> = Vec::with_capacity(batch.len());
            for item in batch {
                for (column, value) in columns.iter_mut().zip(text_columns(item)?) {
                    column.push(value);
                }
                timestamps.push(item.timestamp_ms);
            }
            let mut params: Vec<&(dyn ToSql + Sync)> =
                columns.iter().map(|c| c as &(dyn ToSql + Sync)).collect();
            params.insert(TIMESTAMP_COLUMN, &timestamps);
            params.push(&tenant);
            tx.execute(&statement, &params)
                .await
                .map_err(pg("inserting items"))?;
        }
        Ok(())
    }

    async fn search_async(&self, q: &Query) -> Result<Vec<Hit>, StoreError> {
        check_tenant(&q.tenant)?;
        let top_k = q.top_k.min(MAX_TOP_K);
        if top_k == 0 {
            return Ok(Vec::new());
        }
        // The tenant first: every statement below filters on it.
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = vec![Box::new(q.tenant.clone())];
        let mut filters = String::from(" AND tenant = $1");
        let mut any =
            |column: &str, values: Vec<String>, params: &mut Vec<Box<dyn ToSql + Sync + Send>>| {
                if !values.is_empty() {
                    params.push(Box::new(values));
                    let _ = write!(filters, " AND {column} = ANY(${})", params.len());
                }
            };
        any(
            "kind",
            q.kinds.iter().map(|k| k.as_str().to_owned()).collect(),
            &mut params,
        );
        any("collection", q.collections.clone(), &mut params);
        any("document_id", q.documents.clone(), &mut params);
        any("id", q.ids.clone(), &mut params);
        any(
            "level",
            q.levels
                .iter()
                .map(|l| format!("L{}", l.number()))
                .collect(),
            &mut params,
        );
        any("bucket", q.buckets.clone(), &mut params);
        for (column, value) in [
            ("owner_user", &q.owner.user),
            ("owner_device", &q.owner.device),
            ("owner_agent", &q.owner.agent),
        ] {
            if let Some(v) = value {
                any(column, vec![v.clone()], &mut params);
            }
        }
        if !q.entities.is_empty() {
            let wanted: Vec<String> = q.entities.iter().map(|e| normalize_entity(e)).collect();
            params.push(Box::new(wanted));
            let _ = write!(filters, " AND entities @> ${}", params.len());
        }
        if let Some(from) = q.time.from_ms {
            params.push(Box::new(from));
            let _ = write!(filters, " AND timestamp_ms >= ${}", params.len());
        }
        if let Some(to) = q.time.to_ms {
            params.push(Box::new(to));
            let _ = write!(filters, " AND timestamp_ms <= ${}", params.len());
        }
        params.push(Box::new(i64::try_from(top_k).unwrap_or(100)));
        let limit = params.len();
        let items = &self.inner.items;
        let text = sanitize_query(q.text.trim());
        if let Some(vector) = &q.vector {
            params.pop();
            return self.search_vectors(vector, top_k, &filters, params).await;
        }
        let sql = if text.trim().is_empty() {
            format!(
                "SELECT payload::text, 0::real FROM {items} WHERE true{filters}
                 ORDER BY timestamp_ms DESC, id LIMIT ${limit}"
            )
        } else {
            params.push(Box::new(text));
            let text_param = params.len();
            // numnode = 0: the query had only stop words.
            format!(
                "SELECT payload::text, ts_rank_cd(tsv, q)::real FROM {items},
                    websearch_to_tsquery('english', ${text_param}) AS q
                 WHERE numnode(q) > 0 AND tsv @@ q{filters}
                 ORDER BY 2 DESC, id LIMIT ${limit}"
            )
        };
        self.hits(&sql, &params, "searching").await
    }

    /// Runs `sql`, whose rows are (payload text, real score), as hits.
    async fn hits(
        &self,
        sql: &str,
        params: &[Box<dyn ToSql + Sync + Send>],
        action: &'static str,
    ) -> Result<Vec<Hit>, StoreError> {
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect();
        let rows = self
            .client(action)
            .await?
            .query(sql, &refs)
            .await
            .map_err(pg(action))?;
        rows.iter()
            .map(|row| {
                Ok(Hit {
                    item: item_of(row.get(0))?,
                    score: row.get(1),
                })
            })
            .collect()
    }

    /// The `top_k` items nearest `vector` by cosine similarity among the
    /// rows `filters` keep. Only vectors of the query's dimension compare;
    /// a zero query vector has no direction and finds nothing.
    async fn search_vectors(
        &self,
        vector: &[f32],
        top_k: usize,
        filters: &str,
        mut params: Vec<Box<dyn ToSql + Sync + Send>>,
    ) -> Result<Vec<Hit>, StoreError> {
        if !has_direction(vector) {
            return Ok(Vec::new());
        }
        let items = &self.inner.items;
        if let Some(n) = self.vector_dimensions().filter(|n| *n == vector.len()) {
            params.push(Box::new(to_json(vector)?));
            let vector_param = params.len();
            params.push(Box::new(i64::try_from(top_k).unwrap_or(100)));
            let limit = params.len();
            let sql = nearest_sql(items, n, filters, vector_param, limit);
            return self.hits(&sql, &params, "searching vectors").await;
        }
        let dimensions = i32::try_from(vector.len()).unwrap_or(i32::MAX);
        params.push(Box::new(dimensions));
        let dimensions_param = params.len();
        // Scored here, over the filtered rows' arrays.
        let sql = format!(
            "SELECT payload::text, embedding FROM {items}
             WHERE embedding IS NOT NULL AND cardinality(embedding) = ${dimensions_param}{filters}"
        );
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect();
        let rows = self
            .client("searching vectors")
            .await?
            .query(&sql, &refs)
            .await
            .map_err(pg("searching vectors"))?;
        // A vector with a NULL element (a non-finite value stored as JSON
        // null) is not read as one, and a zero vector has no direction:
        // either row is left out.
        let scored = rows.iter().filter_map(|row| {
            let candidate: Vec<f32> = row.try_get(1).ok()?;
            Some((similarity(vector, &candidate)?, row.get::<_, String>(0)))
        });
        top_k_by_score(scored, top_k)
            .into_iter()
            .map(|(score, payload)| {
                Ok(Hit {
                    item: item_of(&payload)?,
                    score,
                })
            })
            .collect()
    }
}

impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn replace_documents<'a>(
        &'a self,
        tenant: &'a str,
        batch: Vec<(DocumentRecord, Vec<Item>)>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        async move {
            check_tenant(tenant)?;
            for (document, chunks) in &batch {
                for chunk in chunks {
                    if chunk.document_id.as_deref() != Some(document.id.as_str()) {
                        return Err(StoreError::Invalid(format!(
                            "chunk {} does not belong to document {}",
                            chunk.id, document.id
                        )));
                    }
                }
            }
            let inner = &*self.inner;
            let mut client = self.client("writing").await?;
            let tx = client.transaction().await.map_err(pg("beginning"))?;
            for (document, chunks) in &batch {
                tx.execute(
                    &format!(
                        "DELETE FROM {} WHERE tenant = $1 AND document_id = $2",
                        inner.items
                    ),
                    &[&tenant, &document.id],
                )
                .await
                .map_err(pg("deleting old chunks"))?;
                let payload = serde_json::to_string(&document)
                    .map_err(|e| StoreError::Engine(e.to_string()))?;
                tx.execute(
                    &format!(
                        "INSERT INTO {} (tenant, id, collection, timestamp_ms, payload)
                     VALUES ($1, $2, $3, $4, $5::text::jsonb)
                     ON CONFLICT (tenant, id) DO UPDATE SET collection = EXCLUDED.collection,
                        timestamp_ms = EXCLUDED.timestamp_ms, payload = EXCLUDED.payload",
                        inner.documents
                    ),
                    &[
                        &tenant,
                        &document.id,
                        &document.collection,
                        &document.timestamp_ms,
                        &payload,
                    ],
                )
                .await
                .map_err(pg("writing the document record"))?;
                Self::insert_items(&tx, &inner.items, self.vector_dimensions(), tenant, chunks)
                    .await?;
            }
            tx.commit().await.map_err(pg("committing"))
        }
        .boxed()
    }

    fn upsert_items<'a>(
        &'a self,
        tenant: &'a str,
        items: Vec<Item>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        async move {
            check_tenant(tenant)?;
            if let Some(chunk) = items.iter().find(|i| i.document_id.is_some()) {
                return Err(StoreError::Invalid(format!(
                    "item {} is a document chunk: ingest its document instead",
                    chunk.id
                )));
            }
            let inner = &*self.inner;
            let mut client = self.client("writing").await?;
            let tx = client.transaction().await.map_err(pg("beginning"))?;
            Self::insert_items(&tx, &inner.items, self.vector_dimensions(), tenant, &items).await?;
            tx.commit().await.map_err(pg("committing"))
        }
        .boxed()
    }

    fn search<'a>(&'a self, query: &'a Query) -> BoxFuture<'a, Result<Vec<Hit>, StoreError>> {
        self.search_async(query).boxed()
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        PostgresStore::ping(self).boxed()
    }

    fn list_documents<'a>(
        &'a self,
        tenant: &'a str,
        collections: &'a [String],
        ids: &'a [String],
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DocumentSummary>, StoreError>> {
        async move {
            check_tenant(tenant)?;
            let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
            let rows = self
                .client("listing documents")
                .await?
                .query(
                    &format!(
                        "SELECT payload::text FROM {}
                         WHERE tenant = $4
                           AND (cardinality($1::text[]) = 0 OR collection = ANY($1))
                           AND (cardinality($2::text[]) = 0 OR id = ANY($2))
                         ORDER BY timestamp_ms DESC, id LIMIT $3",
                        self.inner.documents
                    ),
                    &[&collections, &ids, &limit, &tenant],
                )
                .await
                .map_err(pg("listing documents"))?;
            rows.iter()
                .map(|row| {
                    let d: DocumentRecord = serde_json::from_str(row.get(0)).map_err(|e| {
                        StoreError::Engine(format!("a stored document record is unreadable: {e}"))
                    })?;
                    Ok(DocumentSummary::from(d))
                })
                .collect()
        }
        .boxed()
    }

    fn document<'a>(
        &'a self,
        tenant: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<DocumentRecord>, StoreError>> {
        async move {
            check_tenant(tenant)?;
            let row = self
                .client("reading a document")
                .await?
                .query_opt(
                    &format!(
                        "SELECT payload::text FROM {} WHERE tenant = $1 AND id = $2",
                        self.inner.documents
                    ),
                    &[&tenant, &id],
                )
                .await
                .map_err(pg("reading a document"))?;
            row.map(|row| {
                serde_json::from_str(row.get(0)).map_err(|e| {
                    StoreError::Engine(format!("a stored document record is unreadable: {e}"))
                })
            })
            .transpose()
        }
        .boxed()
    }

    fn tenants(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        async move {
            let inner = &*self.inner;
            let rows = self
                .client("listing tenants")
                .await?
                .query(
                    &format!(
                        "SELECT tenant FROM {} UNION SELECT tenant FROM {} ORDER BY 1",
                        inner.documents, inner.items
                    ),
                    &[],
                )
                .await
                .map_err(pg("listing tenants"))?;
            Ok(rows.iter().map(|row| row.get(0)).collect())
        }
        .boxed()
    }
}

/// `serde_json::to_string`, failing as a store error.
fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Engine(e.to_string()))
}

/// The parameter position of `timestamp_ms` (the one non-text column) in
/// the item insert.
const TIMESTAMP_COLUMN: usize = 12;

/// An item read back from its stored JSON.
fn item_of(payload: &str) -> Result<Item, StoreError> {
    serde_json::from_str(payload)
        .map_err(|e| StoreError::Engine(format!("a stored item is unreadable: {e}")))
}

/// The tables, keyed by (tenant, id), when missing.
fn create_sql(documents: &str, items: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {documents} (
            tenant text NOT NULL,
            id text NOT NULL,
            collection text NOT NULL,
            timestamp_ms bigint NOT NULL,
            payload jsonb NOT NULL,
            PRIMARY KEY (tenant, id));
         CREATE TABLE IF NOT EXISTS {items} (
            tenant text NOT NULL,
            id text NOT NULL,
            kind text NOT NULL,
            collection text NOT NULL,
            document_id text,
            owner_user text,
            owner_device text,
            owner_agent text,
            level text,
            bucket text,
            entities text[] NOT NULL DEFAULT '{{}}',
            title text NOT NULL,
            body text NOT NULL,
            timestamp_ms bigint NOT NULL,
            payload jsonb NOT NULL,
            tsv tsvector GENERATED ALWAYS AS (
                setweight(to_tsvector('english', title), 'A') ||
                setweight(to_tsvector('english', body), 'B')) STORED,
            PRIMARY KEY (tenant, id));"
    )
}

/// The vector search in the database: the rows `filters` keep nearest
/// the `vector(n)` parameter `$vector_param`, at most `$limit`.
/// `ORDER BY vec <=> q LIMIT k` is the shape the HNSW index serves
/// (approximate; the planner scans the filtered rows exactly when the
/// filters keep few). `<=>` is cosine distance; a stored zero vector's is
/// NaN, which sorts last and is left out.
fn nearest_sql(items: &str, n: usize, filters: &str, vector_param: usize, limit: usize) -> String {
    format!(
        "SELECT payload::text, (1 - d)::real FROM (
            SELECT payload, id, vec <=> ${vector_param}::text::vector({n}) AS d
            FROM {items} WHERE vec IS NOT NULL{filters}
            ORDER BY vec <=> ${vector_param}::text::vector({n}) LIMIT ${limit}) AS nearest
         WHERE d <> 'NaN'::float8 ORDER BY d, id"
    )
}

/// The indexes, every scope filter led by the tenant (the primary key
/// serves the tenant alone and ids).
fn index_sql(documents: &str, items: &str) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {documents}_tenant_collection
            ON {documents} (tenant, collection);
         CREATE INDEX IF NOT EXISTS {items}_tsv ON {items} USING gin (tsv);
         CREATE INDEX IF NOT EXISTS {items}_tenant_collection ON {items} (tenant, collection);
         CREATE INDEX IF NOT EXISTS {items}_tenant_document ON {items} (tenant, document_id);
         CREATE INDEX IF NOT EXISTS {items}_entities ON {items} USING gin (entities);
         CREATE INDEX IF NOT EXISTS {items}_time ON {items} (timestamp_ms);
         ALTER TABLE {items} ADD COLUMN IF NOT EXISTS embedding real[];"
    )
}

/// The statement [`PostgresStore::insert_items`] runs: one row per element
/// of fifteen arrays, all of one tenant (`$16`), an upsert on (tenant,
/// id).
fn insert_sql(table: &str, vector_dimensions: Option<usize>) -> String {
    // With pgvector the array is copied into the `vec` column when it
    // can be one of its vectors: its dimensions, none missing.
    let (vec_column, vec_value, vec_update) = if let Some(n) = vector_dimensions {
        (
            ", vec",
            format!(
                ", CASE WHEN cardinality(a.embedding) = {n}
                    AND array_position(a.embedding, NULL) IS NULL
                    THEN a.embedding::vector({n}) END"
            ),
            ", vec = EXCLUDED.vec",
        )
    } else {
        ("", String::new(), "")
    };
    format!(
        "INSERT INTO {table} (tenant, id, kind, collection, document_id, owner_user,
            owner_device, owner_agent, level, bucket, entities, title, body, timestamp_ms,
            payload, embedding{vec_column})
         SELECT $16::text, u.id, u.kind, u.collection, u.document_id, u.owner_user, u.owner_device,
            u.owner_agent, u.level, u.bucket,
            ARRAY(SELECT jsonb_array_elements_text(u.entities::jsonb)),
            u.title, u.body, u.timestamp_ms, u.payload::jsonb,
            a.embedding{vec_value}
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
            $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
            $12::text[], $13::bigint[], $14::text[], $15::text[])
            AS u(id, kind, collection, document_id, owner_user, owner_device, owner_agent,
                 level, bucket, entities, title, body, timestamp_ms, payload, embedding)
         CROSS JOIN LATERAL (SELECT CASE WHEN u.embedding IS NULL THEN NULL ELSE ARRAY(
                SELECT e.v::real FROM jsonb_array_elements_text(u.embedding::jsonb)
                    WITH ORDINALITY AS e(v, n) ORDER BY e.n) END AS embedding) AS a
         ON CONFLICT (tenant, id) DO UPDATE SET kind = EXCLUDED.kind,
            collection = EXCLUDED.collection, document_id = EXCLUDED.document_id,
            owner_user = EXCLUDED.owner_user, owner_device = EXCLUDED.owner_device,
            owner_agent = EXCLUDED.owner_agent, level = EXCLUDED.level,
            bucket = EXCLUDED.bucket, entities = EXCLUDED.entities,
            title = EXCLUDED.title, body = EXCLUDED.body,
            timestamp_ms = EXCLUDED.timestamp_ms, payload = EXCLUDED.payload,
            embedding = EXCLUDED.embedding{vec_update}"
    )
}

/// The items to write, validated, the last of each id only (a statement
/// may not update a row twice).
fn last_of_each_id(items: &[Item]) -> Result<Vec<&Item>, StoreError> {
    let mut last: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, item) in items.iter().enumerate() {
        item.validate()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        last.insert(&item.id, i);
    }
    Ok(items
        .iter()
        .enumerate()
        .filter(|(i, item)| last.get(item.id.as_str()) == Some(i))
        .map(|(_, item)| item)
        .collect())
}

/// One item's text columns in the insert's order, without timestamp_ms.
fn text_columns(item: &Item) -> Result<[Option<String>; 14], StoreError> {
    let entities: Vec<String> = item.entities.iter().map(|e| normalize_entity(e)).collect();
    // The vector lives in its column; the payload stays small.
    let stored = Item {
        embedding: None,
        ..item.clone()
    };
    Ok([
        Some(item.id.clone()),
        Some(item.kind.as_str().to_owned()),
        Some(item.collection.clone()),
        item.document_id.clone(),
        item.owner.user.clone(),
        item.owner.device.clone(),
        item.owner.agent.clone(),
        item.level.map(|l| format!("L{}", l.number())),
        item.level
            .and_then(|l| item.buckets().map(|b| b.key(l).to_owned())),
        Some(to_json(&entities)?),
        Some(item.title.clone()),
        Some(item.text.clone()),
        Some(to_json(&stored)?),
        item.embedding.as_ref().map(to_json).transpose()?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PostgreSQL server of its own (toolfleet-testkit: a fresh cluster
    /// on a free loopback port, stopped on drop), never the machine's.
    fn server() -> toolfleet_testkit::postgres::PostgresServer {
        toolfleet_testkit::postgres::PostgresServer::start()
            .expect("PostgreSQL for the store suite (scripts/ensure-servers installs it)")
    }

    /// The tables of `prefix` migrated, then a store on them. Vectors of
    /// three dimensions (the conformance suite's) in the `vec` column where
    /// the server has pgvector.
    async fn migrated(url: &str, prefix: &str) -> PostgresStore {
        PostgresStore::migrate(url, prefix, Some(3)).await.unwrap();
        PostgresStore::connect(url, prefix).await.unwrap()
    }

    #[tokio::test]
    async fn passes_the_store_suite() {
        let server = server();
        let store = migrated(&server.url(), "toolfleet").await;
        crate::conformance::documents(&store).await;
        // A second prefix is a second, empty index in the same database.
        let other = migrated(&server.url(), "other").await;
        crate::conformance::context_items(&other).await;
        let vectors = migrated(&server.url(), "vectors").await;
        crate::conformance::vectors(&vectors).await;
        assert!(
            other
                .search(&crate::conformance::query("paper"))
                .await
                .unwrap()
                .is_empty()
        );
        let tenants = migrated(&server.url(), "tenants").await;
        crate::conformance::tenants(&tenants).await;
        let attacked = migrated(&server.url(), "attacked").await;
        crate::tools::tenant_attack::run(Arc::new(attacked)).await;
    }

    /// A search under a deadline (every await in a test has one).
    async fn search_once(store: &PostgresStore) -> Result<usize, StoreError> {
        let q = crate::conformance::query("lighthouse keepers");
        match tokio::time::timeout(std::time::Duration::from_secs(30), store.search(&q)).await {
            Ok(r) => r.map(|hits| hits.len()),
            Err(_) => Err(StoreError::Engine("no answer within 30 s".into())),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn searches_recover_after_a_postgresql_restart_without_restarting_the_worker() {
        use crate::conformance::{TENANT, chunk, record};
        use std::sync::atomic::{AtomicU8, Ordering};
        let mut server = server();
        let store = migrated(&server.url(), "restart").await;
        store
            .replace_document(
                TENANT,
                record("ds:a.md", "ds"),
                vec![chunk("ds:a.md", 0, "Old lighthouse keepers.")],
            )
            .await
            .unwrap();
        // A stream of searches, each tagged with the phase it started in:
        // 0 before the stop, 1 while stopped or starting, 2 after the start.
        let phase = Arc::new(AtomicU8::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stream = {
            let (store, phase, stop) = (store.clone(), phase.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let started = phase.load(Ordering::SeqCst);
                    let result = search_once(&store).await;
                    seen.push((started, phase.load(Ordering::SeqCst), result));
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                seen
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        phase.store(1, Ordering::SeqCst);
        tokio::task::block_in_place(|| server.stop());
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        tokio::task::block_in_place(|| server.start_again()).unwrap();
        phase.store(2, Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
        stop.store(true, Ordering::SeqCst);
        let seen = tokio::time::timeout(std::time::Duration::from_secs(60), stream)
            .await
            .unwrap()
            .unwrap();
        let (mut before, mut down_errors, mut after) = (0, 0, 0);
        for (started, ended, result) in &seen {
            match (started, ended, result) {
                (0, 0, r) => {
                    assert_eq!(r.as_ref().ok(), Some(&1), "before the stop: {r:?}");
                    before += 1;
                }
                (2, _, r) => {
                    assert_eq!(r.as_ref().ok(), Some(&1), "after the restart: {r:?}");
                    after += 1;
                }
                (_, _, Err(e)) => {
                    assert!(matches!(e, StoreError::Unavailable(_)), "while down: {e}");
                    down_errors += 1;
                }
                (_, _, Ok(_)) => {}
            }
        }
        assert!(before > 0 && after > 0, "{seen:?}");
        assert!(
            down_errors > 0,
            "searches failed while it was down: {seen:?}"
        );
        // The same store (the same worker) answers the readiness check.
        store.ping().await.unwrap();
    }

    #[tokio::test]
    async fn a_worker_role_without_ddl_rights_works_after_migrations() {
        use crate::conformance::{TENANT, chunk, query, record};
        let server = server();
        let admin = connect(&server.url()).await.unwrap();
        // The worker's role: rows only. PostgreSQL 15 gives no role CREATE
        // on the public schema but its owner's; said again for older ones.
        admin
            .batch_execute(
                "CREATE ROLE worker LOGIN;
                 REVOKE CREATE ON SCHEMA public FROM PUBLIC;
                 ALTER DEFAULT PRIVILEGES IN SCHEMA public
                    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO worker;",
            )
            .await
            .unwrap();
        let worker_url = format!("postgres://worker@127.0.0.1:{}/postgres", server.port());

        // Before migrations the worker refuses to start, saying what to run.
        let error = PostgresStore::connect(&worker_url, "toolfleet")
            .await
            .err()
            .expect("not migrated");
        assert!(
            error.to_string().contains("schema version 0")
                && error.to_string().contains("toolfleet index migrate"),
            "{error}"
        );
        // Nor may it migrate: it has no CREATE.
        let error = PostgresStore::migrate(&worker_url, "toolfleet", None)
            .await
            .expect_err("no DDL rights");
        assert!(error.to_string().contains("permission denied"), "{error}");

        // The owner migrates; again changes nothing.
        let first = PostgresStore::migrate(&server.url(), "toolfleet", None)
            .await
            .unwrap();
        assert_eq!(first.version, SCHEMA_VERSION);
        assert_eq!(first.applied.len(), MIGRATIONS.len());
        let again = PostgresStore::migrate(&server.url(), "toolfleet", None)
            .await
            .unwrap();
        assert!(again.applied.is_empty(), "{again:?}");
        let recorded: i64 = admin
            .query_one("SELECT count(*) FROM toolfleet_schema_migrations", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(recorded, i64::try_from(MIGRATIONS.len()).unwrap());

        // Now the worker's role writes and reads.
        let store = PostgresStore::connect(&worker_url, "toolfleet")
            .await
            .unwrap();
        store
            .replace_document(
                TENANT,
                record("ds:a.md", "ds"),
                vec![chunk("ds:a.md", 0, "Old lighthouse keepers.")],
            )
            .await
            .unwrap();
        assert_eq!(store.search(&query("lighthouse")).await.unwrap().len(), 1);
        crate::conformance::context_items(&store).await;

        // Tables newer than this release: refused, saying to upgrade.
        admin
            .execute(
                "INSERT INTO toolfleet_schema_migrations (version, description)
                 VALUES ($1, 'from the future')",
                &[&(SCHEMA_VERSION + 1)],
            )
            .await
            .unwrap();
        let error = PostgresStore::connect(&worker_url, "toolfleet")
            .await
            .err()
            .expect("too new");
        assert!(error.to_string().contains("upgrade this worker"), "{error}");
    }

    /// Tables as the release before tenants created them, with a row each.
    const PRE_TENANT_TABLES: &str = "
        CREATE TABLE old_documents (
            id text PRIMARY KEY,
            collection text NOT NULL,
            timestamp_ms bigint NOT NULL,
            payload jsonb NOT NULL);
        CREATE INDEX old_documents_collection ON old_documents (collection);
        CREATE TABLE old_items (
            id text PRIMARY KEY,
            kind text NOT NULL,
            collection text NOT NULL,
            document_id text,
            owner_user text,
            owner_device text,
            owner_agent text,
            level text,
            bucket text,
            entities text[] NOT NULL DEFAULT '{}',
            title text NOT NULL,
            body text NOT NULL,
            timestamp_ms bigint NOT NULL,
            payload jsonb NOT NULL,
            tsv tsvector GENERATED ALWAYS AS (
                setweight(to_tsvector('english', title), 'A') ||
                setweight(to_tsvector('english', body), 'B')) STORED);
        CREATE INDEX old_items_tsv ON old_items USING gin (tsv);
        CREATE INDEX old_items_collection ON old_items (collection);
        CREATE INDEX old_items_document ON old_items (document_id);
        ALTER TABLE old_items ADD COLUMN embedding real[];";

    #[tokio::test]
    async fn tables_without_tenants_are_migrated_to_the_default_tenant() {
        use crate::conformance::{TENANT, chunk, query, record};
        let server = server();
        let admin = connect(&server.url()).await.unwrap();
        admin.batch_execute(PRE_TENANT_TABLES).await.unwrap();
        let old_chunk = chunk("ds:old.md", 0, "Old lighthouse keepers.");
        admin
            .execute(
                "INSERT INTO old_items (id, kind, collection, document_id, title, body,
                    timestamp_ms, payload, embedding)
                 VALUES ($1, 'document', 'ds', 'ds:old.md', 'Bees', $2, 1000,
                    $3::text::jsonb, ARRAY[0, 1]::real[])",
                &[
                    &old_chunk.id,
                    &old_chunk.text,
                    &serde_json::to_string(&old_chunk).unwrap(),
                ],
            )
            .await
            .unwrap();
        admin
            .execute(
                "INSERT INTO old_documents VALUES ('ds:old.md', 'ds', 1000, $1::text::jsonb)",
                &[&serde_json::to_string(&record("ds:old.md", "ds")).unwrap()],
            )
            .await
            .unwrap();

        // Two migration runs at once: one migrates, the other finds it done.
        let url = server.url();
        let (a, b) = tokio::join!(
            PostgresStore::migrate(&url, "old", None),
            PostgresStore::migrate(&url, "old", None)
        );
        let mut applied = [a.unwrap().applied.len(), b.unwrap().applied.len()];
        applied.sort_unstable();
        assert_eq!(applied, [0, 1]);
        let store = PostgresStore::connect(&url, "old").await.unwrap();
        let mut q = query("lighthouse keepers");
        q.tenant = DEFAULT_TENANT.into();
        let hits = store.search(&q).await.unwrap();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].item.id, "ds:old.md#0");
        q.text.clear();
        q.vector = Some(vec![0.0, 1.0]);
        assert_eq!(store.search(&q).await.unwrap().len(), 1, "vectors kept");
        assert!(
            store
                .document(DEFAULT_TENANT, "ds:old.md")
                .await
                .unwrap()
                .is_some()
        );
        // Nothing of it is another tenant's, and another tenant may now
        // use the same ids beside it.
        assert!(store.search(&query("lighthouse")).await.unwrap().is_empty());
        assert!(store.document(TENANT, "ds:old.md").await.unwrap().is_none());
        store
            .replace_document(
                TENANT,
                record("ds:old.md", "ds"),
                vec![chunk("ds:old.md", 0, "New keepers of acme.")],
            )
            .await
            .unwrap();
        let mut q = query("lighthouse keepers");
        q.tenant = DEFAULT_TENANT.into();
        assert_eq!(store.search(&q).await.unwrap().len(), 1, "default's stays");
        assert_eq!(store.tenants().await.unwrap(), [TENANT, DEFAULT_TENANT]);
        // Keyed by (tenant, id), the old single-column indexes gone.
        let key: String = admin
            .query_one(
                "SELECT string_agg(a.attname, ',' ORDER BY k.n)
                 FROM pg_constraint c
                 CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, n)
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
                 WHERE c.conrelid = 'old_items'::regclass AND c.contype = 'p'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(key, "tenant,id");
        let old_indexes: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_indexes WHERE indexname IN
                   ('old_items_collection', 'old_items_document', 'old_documents_collection')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(old_indexes, 0);
        // No row can be written without its tenant.
        let error = admin
            .execute(
                "INSERT INTO old_documents (id, collection, timestamp_ms, payload)
                 VALUES ('x', 'ds', 0, '{}')",
                &[],
            )
            .await
            .unwrap_err();
        assert!(
            error.to_string().contains("null value") || format!("{error:?}").contains("tenant"),
            "{error:?}"
        );
    }

    /// A PostgreSQL 16 server with pgvector, started on a free loopback
    /// port in a temporary directory and stopped on drop: the binaries of
    /// pgserver (PyPI), which scripts/ensure-servers installs, since Debian
    /// 12 packages no pgvector. As root the server runs as user `postgres`
    /// (PostgreSQL refuses root).
    struct PgvectorServer {
        child: std::process::Child,
        port: u16,
        url: String,
        _dir: tempfile::TempDir,
    }

    impl PgvectorServer {
        fn home() -> std::path::PathBuf {
            let mut candidates: Vec<std::path::PathBuf> = Vec::new();
            if let Ok(home) = std::env::var("TOOLFLEET_TEST_PGVECTOR_HOME") {
                candidates.push(home.into());
            }
            candidates.push("/opt/toolfleet/pgserver/pgserver/pginstall".into());
            if let Ok(home) = std::env::var("HOME") {
                candidates
                    .push(format!("{home}/.cache/toolfleet/pgserver/pgserver/pginstall").into());
            }
            candidates
                .into_iter()
                .find(|c| c.join("bin/postgres").is_file())
                .expect(
                    "PostgreSQL with pgvector (pgserver from PyPI) is missing: \
                     scripts/ensure-servers installs it, or set TOOLFLEET_TEST_PGVECTOR_HOME \
                     to a PostgreSQL installation that has the vector extension",
                )
        }

        /// `program` run as the user that owns the data directory.
        fn command(program: std::path::PathBuf, as_root: bool) -> std::process::Command {
            if as_root {
                let mut c = std::process::Command::new("setpriv");
                c.args([
                    "--reuid=postgres",
                    "--regid=postgres",
                    "--init-groups",
                    "--",
                ]);
                c.arg(program);
                c
            } else {
                std::process::Command::new(program)
            }
        }

        async fn start() -> Self {
            let home = Self::home();
            let dir = tempfile::tempdir().unwrap();
            let as_root = std::process::Command::new("id")
                .arg("-u")
                .output()
                .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
            if as_root {
                let status = std::process::Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(dir.path())
                    .status()
                    .unwrap();
                assert!(status.success(), "chown the data directory to postgres");
            }
            let data = dir.path().join("data");
            let output = Self::command(home.join("bin/initdb"), as_root)
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "initdb: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let log = std::fs::File::create(dir.path().join("log")).unwrap();
            let child = Self::command(home.join("bin/postgres"), as_root)
                .arg("-D")
                .arg(&data)
                .arg("-k")
                .arg(dir.path())
                .args(["-p", &port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap();
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
            let mut server = Self {
                child,
                port,
                url,
                _dir: dir,
            };
            for _ in 0..300 {
                if tokio_postgres::connect(&server.url, NoTls).await.is_ok() {
                    return server;
                }
                if let Ok(Some(status)) = server.child.try_wait() {
                    panic!(
                        "the pgvector PostgreSQL exited ({status}): {}",
                        std::fs::read_to_string(server._dir.path().join("log")).unwrap_or_default()
                    );
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            panic!("the pgvector PostgreSQL did not accept connections within 30 s");
        }
    }

    impl Drop for PgvectorServer {
        fn drop(&mut self) {
            // SIGQUIT: the postmaster stops its children and exits at once.
            let _ = std::process::Command::new("kill")
                .args(["-QUIT", &self.child.id().to_string()])
                .status();
            let _ = self.child.wait();
        }
    }

    #[tokio::test]
    async fn passes_the_store_suite_with_pgvector() {
        let server = PgvectorServer::start().await;
        let store = migrated(&server.url, "toolfleet").await;
        assert!(
            store.pgvector().is_some(),
            "the vector extension is created"
        );
        crate::conformance::documents(&store).await;
        crate::conformance::context_items(&store).await;
        // Tenants, with vectors searched inside PostgreSQL.
        let tenants = migrated(&server.url, "tenants").await;
        crate::conformance::tenants(&tenants).await;
        let vectors = migrated(&server.url, "vectors").await;
        crate::conformance::vectors(&vectors).await;
        // The vectors really are searched in the database: the column is
        // filled, one row per item with a vector that can be one.
        let admin = connect(&server.url).await.unwrap();
        let filled: i64 = admin
            .query_one(
                "SELECT count(*) FROM vectors_items WHERE vec IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            filled, 5,
            "near, middle, far, elsewhere, zero: the vector(3) column holds no longer one"
        );

        // Rows written before the extension (here: before the column) are
        // filled in when migrations run again, and found.
        admin
            .batch_execute("ALTER TABLE vectors_items DROP COLUMN vec")
            .await
            .unwrap();
        let reopened = migrated(&server.url, "vectors").await;
        assert!(reopened.pgvector().is_some());
        let hits = reopened
            .search(&Query {
                tenant: crate::conformance::TENANT.into(),
                vector: Some(vec![1.0, 0.0, 0.0]),
                collections: vec!["ds".into()],
                top_k: 10,
                ..Query::default()
            })
            .await
            .unwrap();
        let ids: Vec<&str> = hits.iter().map(|h| h.item.id.as_str()).collect();
        assert_eq!(ids, ["near", "middle", "far"]);

        // A role that may not create the extension gets the array search,
        // with the same results, and says why in the log.
        for statement in [
            "CREATE ROLE plain LOGIN",
            "CREATE DATABASE plain OWNER plain",
        ] {
            admin.batch_execute(statement).await.unwrap();
        }
        let plain_url = format!("postgres://plain@127.0.0.1:{}/plain", server.port);
        let plain = migrated(&plain_url, "vectors").await;
        assert!(
            plain.pgvector().is_none(),
            "pgvector is not trusted: superuser only"
        );
        crate::conformance::vectors(&plain).await;
    }

    #[tokio::test]
    async fn vector_searches_use_the_hnsw_index_of_a_typed_column() {
        use crate::conformance::TENANT;
        let server = PgvectorServer::start().await;
        let migrated = PostgresStore::migrate(&server.url, "ann", Some(8))
            .await
            .unwrap();
        assert_eq!(migrated.dimensions, Some(8));
        assert!(migrated.hnsw, "pgvector 0.6 has HNSW");
        let store = PostgresStore::connect(&server.url, "ann").await.unwrap();
        assert_eq!(store.vector_dimensions(), Some(8));
        // Enough rows that an index beats a scan: 3000 vectors, spread.
        let items: Vec<Item> = (0..3000u32)
            .map(|i| {
                let mut item = crate::conformance::chunk("x", 0, "a note");
                item.document_id = None;
                item.kind = crate::model::ItemKind::Knowledge;
                item.id = format!("k{i}");
                #[allow(clippy::cast_precision_loss)]
                let x = i as f32;
                item.embedding = Some(
                    (0..8)
                        .map(|d| ((x + 1.0) * (d as f32 + 1.0)).sin())
                        .collect(),
                );
                item
            })
            .collect();
        store.upsert_items(TENANT, items).await.unwrap();
        let admin = connect(&server.url).await.unwrap();
        let column: String = admin
            .query_one(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                 WHERE attrelid = 'ann_items'::regclass AND attname = 'vec'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(column, "vector(8)");
        let index: String = admin
            .query_one(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'ann_items_vec_hnsw'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            index.contains("USING hnsw (vec vector_cosine_ops)"),
            "{index}"
        );
        admin.batch_execute("ANALYZE ann_items").await.unwrap();
        // The statement the store runs for a tenant's vector search, as
        // its plan.
        let probe = "[1,0,0,0,0,0,0,0]";
        let plan: Vec<String> = admin
            .query(
                &format!(
                    "EXPLAIN {}",
                    nearest_sql("ann_items", 8, " AND tenant = $1", 2, 3)
                ),
                &[&TENANT, &probe, &10i64],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert!(
            plan.iter()
                .any(|l| l.contains("Index Scan using ann_items_vec_hnsw")),
            "{plan:#?}"
        );
        let hits = store
            .search(&Query {
                tenant: TENANT.into(),
                vector: Some(vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
                top_k: 10,
                ..Query::default()
            })
            .await
            .unwrap();
        assert_eq!(hits.len(), 10);
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));

        // The dimensions are fixed once the column is made.
        let error = PostgresStore::migrate(&server.url, "ann", Some(16))
            .await
            .expect_err("other dimensions");
        assert!(
            error.to_string().contains("vector(8), not vector(16)"),
            "{error}"
        );
        // Migrating again without them keeps the column.
        let again = PostgresStore::migrate(&server.url, "ann", None)
            .await
            .unwrap();
        assert_eq!((again.dimensions, again.hnsw), (Some(8), true));
    }

    /// Whether a connection the store's pool makes for `url` is encrypted.
    async fn ssl_in_use(url: &str) -> Result<bool, StoreError> {
        let pool = pool(url)?;
        let client = pool.get().await.map_err(pool_error("connecting"))?;
        Ok(client
            .query_one(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .map_err(pg("reading pg_stat_ssl"))?
            .get(0))
    }

    #[tokio::test]
    async fn tls_follows_the_urls_sslmode_and_verify_full_checks_ca_and_host() {
        use toolfleet_testkit::postgres::{PostgresServer, TestCa, machine_bindir};
        let ca = TestCa::new().expect("openssl on PATH (apt-get install openssl)");
        let server =
            PostgresServer::start_configured(&machine_bindir().unwrap(), &ca.server_settings())
                .unwrap();
        let port = server.port();
        let url =
            |host: &str, query: &str| format!("postgres://postgres@{host}:{port}/postgres?{query}");
        let root = |name: &str| ca.path(name).display().to_string();

        // verify-full with the test CA: encrypted, and the store works.
        let full = url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={}", root("ca.pem")),
        );
        assert!(ssl_in_use(&full).await.unwrap());
        let store = migrated(&full, "tls").await;
        crate::conformance::context_items(&store).await;

        // A certificate of another CA, or for another host: refused.
        let wrong_ca = url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={}", root("other-ca.pem")),
        );
        let error = ssl_in_use(&wrong_ca).await.unwrap_err();
        assert!(matches!(error, StoreError::Unavailable(_)), "{error}");
        assert!(error.to_string().contains("certificate"), "{error}");
        let wrong_host = |mode: &str| {
            url(
                "db.example.com",
                &format!(
                    "hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
                    root("ca.pem")
                ),
            )
        };
        let error = ssl_in_use(&wrong_host("verify-full")).await.unwrap_err();
        assert!(error.to_string().contains("certificate"), "{error}");
        // verify-ca checks the chain only; the host name does not matter.
        assert!(ssl_in_use(&wrong_host("verify-ca")).await.unwrap());
        let error = ssl_in_use(&url(
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={}", root("other-ca.pem")),
        ))
        .await
        .unwrap_err();
        assert!(error.to_string().contains("certificate"), "{error}");

        // require encrypts without checking; prefer (the default) encrypts
        // when the server can; disable does not.
        assert!(
            ssl_in_use(&url("127.0.0.1", "sslmode=require"))
                .await
                .unwrap()
        );
        assert!(ssl_in_use(&url("127.0.0.1", "")).await.unwrap());
        assert!(
            !ssl_in_use(&url("127.0.0.1", "sslmode=disable"))
                .await
                .unwrap()
        );
        // A missing CA file is a clear error, not a plaintext fallback.
        let error = ssl_in_use(&url(
            "127.0.0.1",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        ))
        .await
        .unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{error}");
        assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
    }

    #[tokio::test]
    async fn bad_prefixes_and_dead_servers_are_clear_errors() {
        for prefix in ["", "1abc", "a-b", "A", "x; DROP TABLE y"] {
            let error = PostgresStore::connect("postgres://127.0.0.1:1/none", prefix)
                .await
                .err()
                .expect("refused");
            assert!(matches!(error, StoreError::Invalid(_)), "{prefix}: {error}");
        }
        // Nothing listens on port 1; the password never reaches the message.
        let error = PostgresStore::connect("postgres://u:hunter2@127.0.0.1:1/none", "ok")
            .await
            .err()
            .expect("no server");
        assert!(matches!(error, StoreError::Unavailable(_)), "{error}");
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }
}
