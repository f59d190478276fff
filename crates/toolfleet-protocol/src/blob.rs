//! Blobs: binary outputs of tools (an image, a file) kept out of the
//! model's context and out of NATS messages. A tool stores the bytes in the
//! fleet's store and hands the model and the client a [`BlobUri`] instead:
//! `toolfleet-blob:<invocation id>/<blob id>`.
//!
//! The URI names the invocation (whose keys the blob lives and expires
//! with) and the blob within it; it carries no secret and no tenant. Ids
//! are per tenant, so a reader also names the tenant whose invocation made
//! the blob (the store keys blobs by both; `toolfleet blob get --tenant`).
//! Both parts are
//! restricted to characters that need no escaping in a URI, a subject or a
//! Redis key, so the format is plain text with no percent-encoding.

use std::fmt;
use std::str::FromStr;

use crate::wire::valid_invocation_id;

/// The URI scheme of a blob, without the `:`.
pub const BLOB_URI_SCHEME: &str = "toolfleet-blob";

/// The longest blob id (a call id of up to 128 characters, a `.` and a
/// per-call counter fit).
pub const MAX_BLOB_ID_CHARS: usize = 160;

/// The longest content type a blob carries.
pub const MAX_CONTENT_TYPE_CHARS: usize = 255;

/// Is `id` usable as a blob id: 1-[`MAX_BLOB_ID_CHARS`] of
/// `[A-Za-z0-9_.-]`, not starting or ending with `.`?
pub fn valid_blob_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_BLOB_ID_CHARS
        && !id.starts_with('.')
        && !id.ends_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Is `content_type` usable as a blob's content type: `type/subtype`
/// (parameters allowed, e.g. `text/plain; charset=utf-8`), printable ASCII,
/// at most [`MAX_CONTENT_TYPE_CHARS`]?
pub fn valid_content_type(content_type: &str) -> bool {
    let Some((kind, rest)) = content_type.split_once('/') else {
        return false;
    };
    let subtype = rest.split(';').next().unwrap_or_default().trim();
    content_type.len() <= MAX_CONTENT_TYPE_CHARS
        && !kind.is_empty()
        && !subtype.is_empty()
        && content_type.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Where a blob is: `toolfleet-blob:<invocation id>/<blob id>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlobUri {
    invocation_id: String,
    blob_id: String,
}

/// Why a text is not a [`BlobUri`] (or its parts cannot make one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "malformed blob URI {uri:?}: {reason} (expected {BLOB_URI_SCHEME}:<invocation id>/<blob id>)"
)]
pub struct BlobUriError {
    /// The text given, cut to 200 characters.
    pub uri: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl BlobUriError {
    fn new(uri: &str, reason: &'static str) -> Self {
        let uri = match uri.char_indices().nth(200) {
            Some((cut, _)) => format!("{}…", &uri[..cut]),
            None => uri.to_string(),
        };
        Self { uri, reason }
    }
}

impl BlobUri {
    /// The URI of blob `blob_id` of invocation `invocation_id`.
    ///
    /// # Errors
    ///
    /// When either part is not valid ([`valid_invocation_id`],
    /// [`valid_blob_id`]).
    pub fn new(
        invocation_id: impl Into<String>,
        blob_id: impl Into<String>,
    ) -> Result<Self, BlobUriError> {
        let (invocation_id, blob_id) = (invocation_id.into(), blob_id.into());
        let uri = || format!("{BLOB_URI_SCHEME}:{invocation_id}/{blob_id}");
        if !valid_invocation_id(&invocation_id) {
            return Err(BlobUriError::new(
                &uri(),
                "the invocation id is not 1-128 of [A-Za-z0-9_-]",
            ));
        }
        if !valid_blob_id(&blob_id) {
            return Err(BlobUriError::new(
                &uri(),
                "the blob id is not 1-160 of [A-Za-z0-9_.-] (no leading or trailing `.`)",
            ));
        }
        Ok(Self {
            invocation_id,
            blob_id,
        })
    }

    /// Reads `toolfleet-blob:<invocation id>/<blob id>` (the scheme in any
    /// case, as URI schemes are; nothing before or after).
    ///
    /// # Errors
    ///
    /// A [`BlobUriError`] saying what is wrong.
    pub fn parse(uri: &str) -> Result<Self, BlobUriError> {
        let Some((scheme, rest)) = uri.split_once(':') else {
            return Err(BlobUriError::new(uri, "no scheme"));
        };
        if !scheme.eq_ignore_ascii_case(BLOB_URI_SCHEME) {
            return Err(BlobUriError::new(uri, "not the toolfleet-blob scheme"));
        }
        let Some((invocation_id, blob_id)) = rest.split_once('/') else {
            return Err(BlobUriError::new(
                uri,
                "no `/` between the invocation and the blob",
            ));
        };
        Self::new(invocation_id, blob_id).map_err(|e| BlobUriError::new(uri, e.reason))
    }

    /// The invocation the blob belongs to (and lives and expires with).
    pub fn invocation_id(&self) -> &str {
        &self.invocation_id
    }

    /// The blob's id within its invocation.
    pub fn blob_id(&self) -> &str {
        &self.blob_id
    }
}

impl fmt::Display for BlobUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{BLOB_URI_SCHEME}:{}/{}",
            self.invocation_id, self.blob_id
        )
    }
}

impl FromStr for BlobUri {
    type Err = BlobUriError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uri_is_formatted_and_parsed_back() {
        let uri = BlobUri::new("2f0c-41_a", "call_7.2").unwrap();
        assert_eq!(uri.to_string(), "toolfleet-blob:2f0c-41_a/call_7.2");
        let back = BlobUri::parse(&uri.to_string()).unwrap();
        assert_eq!(back, uri);
        assert_eq!(
            (back.invocation_id(), back.blob_id()),
            ("2f0c-41_a", "call_7.2")
        );
        // The scheme is case-insensitive; the ids are not changed.
        let upper: BlobUri = "TOOLFLEET-BLOB:Inv/Call.1".parse().unwrap();
        assert_eq!(upper.to_string(), "toolfleet-blob:Inv/Call.1");
        let longest = "c".repeat(MAX_BLOB_ID_CHARS);
        let inv = "i".repeat(128);
        let uri = BlobUri::new(inv.as_str(), longest.as_str()).unwrap();
        assert_eq!(BlobUri::parse(&uri.to_string()).unwrap(), uri);
    }

    #[test]
    fn malformed_uris_say_what_is_wrong() {
        for (text, reason) in [
            ("", "no scheme"),
            ("inv/blob", "no scheme"),
            ("https://example.com/x", "not the toolfleet-blob scheme"),
            ("toolfleet-blobs:inv/b", "not the toolfleet-blob scheme"),
            ("toolfleet-blob:inv", "no `/`"),
            ("toolfleet-blob:/b.1", "invocation id"),
            ("toolfleet-blob:inv/", "blob id"),
            ("toolfleet-blob:inv/a/b", "blob id"),
            ("toolfleet-blob:inv/.1", "blob id"),
            ("toolfleet-blob:inv/c.", "blob id"),
            ("toolfleet-blob:inv/c 1", "blob id"),
            ("toolfleet-blob:inv/c:1", "blob id"),
            ("toolfleet-blob:inv/c.1?x=1", "blob id"),
            ("toolfleet-blob:in{v}/c.1", "invocation id"),
            ("toolfleet-blob:in.v/c.1", "invocation id"),
            ("toolfleet-blob://inv/c.1", "invocation id"),
            (" toolfleet-blob:inv/c.1", "not the toolfleet-blob scheme"),
        ] {
            let e = BlobUri::parse(text).expect_err(text);
            assert!(e.reason.contains(reason), "{text:?}: {e}");
            assert!(e.to_string().contains("malformed blob URI"), "{e}");
        }
        let long = format!("toolfleet-blob:inv/{}", "c".repeat(MAX_BLOB_ID_CHARS + 1));
        let e = BlobUri::parse(&long).unwrap_err();
        assert!(e.reason.contains("blob id"), "{e}");
        // The error quotes a long text cut short.
        assert!(e.uri.chars().count() <= 201, "{}", e.uri);
        assert!(BlobUri::new("inv", "").is_err());
        assert!(BlobUri::new("i/nv", "c.1").is_err());
    }

    #[test]
    fn content_types_are_checked() {
        for ok in [
            "image/png",
            "application/octet-stream",
            "text/plain; charset=utf-8",
            "image/svg+xml",
        ] {
            assert!(valid_content_type(ok), "{ok}");
        }
        for bad in [
            "",
            "png",
            "/png",
            "image/",
            "image/ ; q=1",
            "image/png\r\nX: y",
            "image/pñg",
        ] {
            assert!(!valid_content_type(bad), "{bad:?}");
        }
        assert!(!valid_content_type(&format!(
            "image/{}",
            "x".repeat(MAX_CONTENT_TYPE_CHARS)
        )));
    }
}
