//! Secrets out of messages: URLs with their credentials hidden.

/// A URL with any password replaced, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            // A NATS token travels as the user part: hide both.
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            if !u.username().is_empty() {
                let _ = u.set_username("***");
            }
            u.to_string()
        }
        Err(_) => "<unparseable url>".to_string(),
    }
}
