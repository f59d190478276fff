//! The shipped identities of `ops/nats/auth.conf` in a test: a server
//! running them, and each role's password (a canary the tests look for in
//! what must not hold it), inbox prefix and connection.

use toolfleet_local::servers::{NatsConfig, NatsServer};

use super::{WAIT, root};

/// (user, the server's environment variable with its password): every
/// identity of `ops/nats/auth.conf` (the server needs them all).
pub(crate) const USERS: [(&str, &str); 11] = [
    ("client-acme", "TOOLFLEET_NATS_CLIENT_ACME_PASSWORD"),
    ("client-globex", "TOOLFLEET_NATS_CLIENT_GLOBEX_PASSWORD"),
    ("orchestrator", "TOOLFLEET_NATS_ORCHESTRATOR_PASSWORD"),
    ("worker-system", "TOOLFLEET_NATS_SYSTEM_PASSWORD"),
    ("worker-retrieval", "TOOLFLEET_NATS_RETRIEVAL_PASSWORD"),
    ("worker-llm", "TOOLFLEET_NATS_LLM_PASSWORD"),
    ("worker-web", "TOOLFLEET_NATS_WEB_PASSWORD"),
    ("worker-units", "TOOLFLEET_NATS_UNITS_PASSWORD"),
    ("worker-mcp", "TOOLFLEET_NATS_MCP_PASSWORD"),
    ("operator", "TOOLFLEET_NATS_OPERATOR_PASSWORD"),
    ("gateway", "TOOLFLEET_NATS_GATEWAY_PASSWORD"),
];

/// `user`'s password on a test server.
pub(crate) fn password(user: &str) -> String {
    format!("pw-{user}-canary-7f3a")
}

/// The inbox prefix a role's processes set (ops/nats/auth.conf).
pub(crate) fn inbox_prefix(user: &str) -> String {
    if let Some(family) = user.strip_prefix("worker-") {
        format!("_INBOX.worker.{family}")
    } else if let Some(tenant) = user.strip_prefix("client-") {
        format!("_INBOX.client.{tenant}")
    } else {
        format!("_INBOX.{user}")
    }
}

/// `nats-server` running the shipped identities, the MCP pool's role being
/// `mcp_role` (what `toolfleet-worker-mcp --print-nats-role` printed)
/// instead of the shipped `mcp-role.conf` when given.
pub(crate) fn secure_nats_with_mcp_role(mcp_role: Option<Vec<u8>>) -> NatsServer {
    let dir = root().join("ops/nats");
    let mcp_role = mcp_role.unwrap_or_else(|| std::fs::read(dir.join("mcp-role.conf")).unwrap());
    NatsServer::start_configured(NatsConfig {
        extra: Some("include \"auth.conf\"".into()),
        files: vec![
            (
                "auth.conf".into(),
                std::fs::read(dir.join("auth.conf")).unwrap(),
            ),
            ("mcp-role.conf".into(), mcp_role),
        ],
        env: USERS
            .iter()
            .map(|(user, var)| (var.to_string(), password(user)))
            .collect(),
        ..NatsConfig::default()
    })
    .expect("nats-server with ops/nats/auth.conf")
}

/// `nats-server` running the shipped identities.
pub(crate) fn secure_nats() -> NatsServer {
    secure_nats_with_mcp_role(None)
}

/// `user`'s connection to `nats`, with its role's inbox prefix.
pub(crate) async fn connect_as(nats: &NatsServer, user: &str) -> async_nats::Client {
    tokio::time::timeout(
        WAIT,
        async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
            .custom_inbox_prefix(inbox_prefix(user))
            .connect(nats.url()),
    )
    .await
    .expect("connect in time")
    .expect("connect")
}
