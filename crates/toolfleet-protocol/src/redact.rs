//! Secrets out of messages: URLs with their credentials hidden. The one
//! redaction every crate uses for a URL it shows (logs, errors, `Debug`).

/// A URL for people: any user info (a user and password, or a NATS token
/// in the user part) becomes `***`, and a query (which may carry a key) is
/// `[redacted]`; the rest stays as written. Text that is not a URL shows
/// nothing of itself.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let host = match authority.rfind('@') {
        Some(at) => format!("***@{}", &authority[at + 1..]),
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let fragment = query.find('#').map_or("", |f| &query[f..]);
            format!("{path}?[redacted]{fragment}")
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{host}{tail}")
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
        assert_eq!(redact_url("http://:hunter2@x"), "http://***@x");
        assert_eq!(redact_url("redis://:hunter2@[bad"), "redis://***@[bad");
        assert_eq!(
            redact_url("https://u:p@h/a@b?k=v#top"),
            "https://***@h/a@b?[redacted]#top"
        );
    }
}
