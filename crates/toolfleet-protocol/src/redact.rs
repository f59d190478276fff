//! Secrets out of messages: URLs with their credentials hidden. The one
//! redaction every crate uses for a URL it shows (logs, errors, `Debug`).

/// A URL for people: any user info (a user and password, or a NATS token
/// in the user part) becomes `***`, and a query (which may carry a key) is
/// `[redacted]`. Text that is not a URL shows nothing of itself.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if !u.username().is_empty() || u.password().is_some() {
                // Both setters only fail for URLs that cannot have
                // credentials at all.
                let _ = u.set_password(None);
                let _ = u.set_username("***");
            }
            if u.query().is_some() {
                u.set_query(Some("[redacted]"));
            }
            u.to_string()
        }
        Err(_) => "<unparsable url>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_queries_are_hidden() {
        assert_eq!(
            redact_url("redis://app:s3cr%40t@host:6379/2"),
            "redis://***@host:6379/2"
        );
        assert_eq!(
            redact_url("redis://:hunter2@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(
            redact_url("nats://s3cr3t-token@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_url("https://api.example.com/v1?api-key=k"),
            "https://api.example.com/v1?[redacted]"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(redact_url("not a url hunter2"), "<unparsable url>");
    }
}
