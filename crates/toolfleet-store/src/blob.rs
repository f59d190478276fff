//! Blobs: binary outputs of tools (an image, a file), stored beside the
//! invocation's citations so they never travel in a NATS message or reach
//! the model's context (the model gets a
//! [`toolfleet_protocol::blob::BlobUri`]).
//!
//! A blob is one hash, `<p>:{<t>/<inv>}:blob:<id>`, with the fields `type`
//! (the content type) and `bytes`, written with its TTL by one script: a
//! reader gets both or neither, and the key never exists without its TTL.
//! Writing the same blob id again replaces the blob (a redelivered job).

use toolfleet_protocol::blob::{MAX_CONTENT_TYPE_CHARS, valid_blob_id, valid_content_type};

use crate::{CitationError, CitationStore, ErrorKind, InvocationKey};

/// The largest blob the store takes, in bytes (32 MiB).
pub const MAX_BLOB_BYTES: usize = 32 * 1024 * 1024;

/// Replaces the blob whole (no field of an earlier one survives) and sets
/// its TTL, atomically.
const PUT_BLOB: &str = r"
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'type', ARGV[2], 'bytes', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
";

/// A stored blob.
#[derive(Clone, PartialEq, Eq)]
pub struct Blob {
    pub content_type: String,
    pub bytes: Vec<u8>,
}

// By hand: a blob's bytes can be megabytes.
impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blob")
            .field("content_type", &self.content_type)
            .field("bytes", &format_args!("<{} bytes>", self.bytes.len()))
            .finish()
    }
}

impl CitationStore {
    fn blob_key(&self, inv: InvocationKey<'_>, blob_id: &str) -> Result<String, CitationError> {
        if !valid_blob_id(blob_id) {
            return Err(CitationError::new(
                ErrorKind::Invalid,
                format!("blob id {blob_id:?} is not 1-160 of [A-Za-z0-9_.-]"),
            ));
        }
        Ok(self.key(inv, &format!("blob:{blob_id}")))
    }

    /// Stores `bytes` of `content_type` as blob `blob_id` of the
    /// invocation, for the store's TTL (the invocation's other keys'). Safe
    /// to repeat: the same id replaces the blob whole.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::TooLarge`] past [`MAX_BLOB_BYTES`] and
    /// [`ErrorKind::Invalid`] for a blob id or content type the contract
    /// refuses (both before anything is sent); otherwise as every
    /// operation.
    pub async fn put_blob(
        &self,
        inv: InvocationKey<'_>,
        blob_id: &str,
        content_type: &str,
        bytes: &[u8],
    ) -> Result<(), CitationError> {
        if bytes.len() > MAX_BLOB_BYTES {
            return Err(CitationError::new(
                ErrorKind::TooLarge,
                format!(
                    "blob {blob_id:?} is {} bytes, more than the {MAX_BLOB_BYTES} bytes (32 MiB) \
                     a blob may have",
                    bytes.len()
                ),
            ));
        }
        if !valid_content_type(content_type) {
            return Err(CitationError::new(
                ErrorKind::Invalid,
                format!(
                    "content type {content_type:?} of blob {blob_id:?} is not `type/subtype` \
                     of at most {MAX_CONTENT_TYPE_CHARS} printable ASCII characters"
                ),
            ));
        }
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(PUT_BLOB));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.blob_key(inv, blob_id)?)
            .arg(self.ttl.as_secs().max(1))
            .arg(content_type)
            .arg(bytes);
        let invocation = &invocation;
        self.run("put_blob", |mut conn| async move {
            invocation.invoke_async::<i64>(&mut conn).await
        })
        .await
        .map(drop)
    }

    /// Blob `blob_id` of the invocation; `None` when there is none (never
    /// stored, or expired with the invocation's keys).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Invalid`] for a blob id the contract refuses;
    /// [`ErrorKind::Corrupt`] for a key that is not a whole blob; otherwise
    /// as every operation.
    pub async fn get_blob(
        &self,
        inv: InvocationKey<'_>,
        blob_id: &str,
    ) -> Result<Option<Blob>, CitationError> {
        let key = &self.blob_key(inv, blob_id)?;
        let (content_type, bytes): (Option<Vec<u8>>, Option<Vec<u8>>) = self
            .run("get_blob", |mut conn| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("type")
                    .arg("bytes")
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        let corrupt = |what: &str| {
            CitationError::new(ErrorKind::Corrupt, format!("blob {blob_id:?}: {what}"))
        };
        match (content_type, bytes) {
            (None, None) => Ok(None),
            (Some(content_type), Some(bytes)) => Ok(Some(Blob {
                content_type: String::from_utf8(content_type)
                    .map_err(|_| corrupt("its content type is not UTF-8"))?,
                bytes,
            })),
            _ => Err(corrupt("the stored hash lacks its type or its bytes")),
        }
    }
}
