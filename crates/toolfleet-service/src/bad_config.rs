//! [`BadConfig`]: a configuration error, in a module of its own so both
//! the flags ([`crate::args`]) and the `nats` CLI's contexts
//! ([`crate::nats_context`]) can say one without needing each other.

/// A configuration error found only when it is used (a malformed server
/// URL): commands exit with [`EXIT_CONFIG`](crate::args::EXIT_CONFIG) for
/// it, as for a bad flag ([`crate::args::exit_code_of`]). The message never
/// holds a password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadConfig(pub String);

impl std::fmt::Display for BadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadConfig {}
