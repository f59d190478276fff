//! The tool implementations shipped with the fleet, looked up by the
//! `implementationKey` of their definition file.
//!
//! - `system.current_datetime`: the current date and time.
//! - `retrieval.search_documents`: full-text search over the document index,
//!   citing every passage it returns.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};

use crate::citations::NewReference;
use crate::index::DocumentIndex;
use crate::worker::{ToolCtx, ToolError, ToolHandler, ToolOutput};

/// `system.current_datetime`.
pub struct CurrentDatetime;

fn parse_offset(s: &str) -> Result<time::UtcOffset, ToolError> {
    let format = time::macros::format_description!("[offset_hour sign:mandatory]:[offset_minute]");
    time::UtcOffset::parse(s, &format)
        .map_err(|e| ToolError::InvalidInput(format!("utcOffset {s:?} is not like +02:00: {e}")))
}

impl CurrentDatetime {
    pub fn at(now: time::OffsetDateTime, args: &Value) -> Result<ToolOutput, ToolError> {
        let offset = match args.get("utcOffset").and_then(Value::as_str) {
            Some(s) => parse_offset(s)?,
            None => time::UtcOffset::UTC,
        };
        let local = now.to_offset(offset);
        let iso = local
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| ToolError::failed(e.to_string()))?;
        let weekday = local.weekday().to_string();
        Ok(ToolOutput {
            content: format!("{iso} ({weekday})"),
            data: Some(json!({
                "iso": iso,
                "weekday": weekday,
                "unixMs": (now.unix_timestamp_nanos() / 1_000_000) as i64,
                "utcOffset": if offset.is_utc() { "+00:00".to_string() } else { args["utcOffset"].as_str().unwrap_or_default().to_string() },
            })),
        })
    }
}

impl ToolHandler for CurrentDatetime {
    fn call<'a>(
        &'a self,
        _ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>> {
        async move { Self::at(time::OffsetDateTime::now_utc(), &args) }.boxed()
    }
}

/// `retrieval.search_documents`.
pub struct SearchDocuments {
    index: DocumentIndex,
}

/// Results per search when the model does not say.
pub const DEFAULT_LIMIT: usize = 5;

impl SearchDocuments {
    pub fn new(index: DocumentIndex) -> Self {
        Self { index }
    }
}

impl ToolHandler for SearchDocuments {
    fn call<'a>(
        &'a self,
        ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>> {
        async move {
            let query = args
                .get("query")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let limit = args
                .get("limit")
                .and_then(Value::as_u64)
                .map(|l| l as usize)
                .unwrap_or(DEFAULT_LIMIT);
            let index = self.index.clone();
            let q = query.clone();
            // Tantivy searches are CPU work: keep them off the runtime's
            // worker threads.
            let hits = tokio::task::spawn_blocking(move || index.search(&q, limit))
                .await
                .map_err(|e| ToolError::transient(format!("search task failed: {e}")))?
                .map_err(|e| ToolError::failed(format!("search failed: {e}")))?;
            if hits.is_empty() {
                return Ok(ToolOutput {
                    content: format!("No documents matched {query:?}."),
                    data: Some(json!({ "hits": [] })),
                });
            }
            let refs = hits
                .iter()
                .map(|h| NewReference {
                    kind: "document".into(),
                    title: h.title.clone(),
                    source: Some(h.source.clone()),
                    url: None,
                    snippet: Some(h.snippet.clone()),
                })
                .collect();
            let cited = ctx.cite(refs).await?;
            // One line per passage, led by its marker. The tool's
            // description tells the model to cite with these markers.
            let content = hits
                .iter()
                .zip(&cited)
                .map(|(h, r)| {
                    let section = h.section.as_deref().map(|s| format!(" › {s}")).unwrap_or_default();
                    format!("{} {}{section}: {}", r.marker(), h.title, h.snippet)
                })
                .collect::<Vec<_>>()
                .join("\n");
            Ok(ToolOutput {
                content,
                data: Some(json!({ "hits": hits, "indices": cited.iter().map(|r| r.index).collect::<Vec<_>>() })),
            })
        }
        .boxed()
    }
}

/// The handler for an implementation key, if the fleet ships one.
pub fn handler(key: &str, index: Option<&DocumentIndex>) -> Option<Arc<dyn ToolHandler>> {
    match key {
        "system.current_datetime" => Some(Arc::new(CurrentDatetime)),
        "retrieval.search_documents" => {
            index.map(|i| Arc::new(SearchDocuments::new(i.clone())) as Arc<dyn ToolHandler>)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datetime_in_utc_and_at_an_offset() {
        let now = time::macros::datetime!(2026-11-21 22:50:00 UTC);
        let out = CurrentDatetime::at(now, &json!({})).unwrap();
        assert_eq!(out.content, "2026-11-21T22:50:00Z (Saturday)");
        let out = CurrentDatetime::at(now, &json!({"utcOffset": "+05:30"})).unwrap();
        assert_eq!(out.content, "2026-11-22T04:20:00+05:30 (Sunday)");
        assert!(matches!(
            CurrentDatetime::at(now, &json!({"utcOffset": "25:00"})),
            Err(ToolError::InvalidInput(_))
        ));
    }
}
