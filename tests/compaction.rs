//! Context compaction: a conversation over its profile's token budget is
//! summarised through the llm:summarize tool (issue 11, item 6).
