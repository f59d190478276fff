//! Small text helpers the stages share: what events show of a call's
//! arguments, and text cut to a length.

// Replaces the values of sensitive arguments: the contract's one
// redaction, which dead letters use too.
pub(crate) use toolfleet_protocol::redact::redact_arguments as redact;

/// `text` cut to `max` characters, with `…` when cut.
pub(crate) fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_messages_are_cut_on_a_character_boundary() {
        assert_eq!(shorten("short", 10), "short");
        assert_eq!(shorten("ééééé", 3), "ééé…");
        assert_eq!(shorten(&"x".repeat(10), 10), "x".repeat(10));
    }
}
