//! The OAuth client of an HTTP MCP server against `tests/mcp/oauth_server.py`
//! (an MCP server on the official Python SDK that requires bearer tokens,
//! and an authorization-server stand-in that logs every token request):
//!
//! - calls in flight when the connection's token is renewed finish on
//!   their connection (it is not cut under them);
//! - a protected resource that names another authorization server than
//!   the configured issuer is refused with a clear error, and that server
//!   never receives a token request (the client's secret).

use std::path::{Path, PathBuf};
use std::time::Duration;

use toolfleet_worker_mcp::config::McpConfig;
use toolfleet_worker_mcp::server::{Caller, Server};

/// How long anything in these tests may take.
const WAIT: Duration = Duration::from_secs(60);
const SECRET: &str = "default-s3cret-9f2a";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh directory of this test's.
fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("toolfleet-mcp-oauth-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The stand-ins' process, killed on drop.
struct Stand(std::process::Child);

impl Drop for Stand {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the OAuth MCP server on `mcp` and its authorization server on
/// `auth` (tokens of `lifetime` seconds, requests logged to `log`), and
/// waits until the MCP port answers.
async fn start(dir: &Path, mcp: u16, auth: u16, lifetime: u64, log: &Path) -> Stand {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/mcp/oauth_server.py");
    let child = std::process::Command::new("python3")
        .arg(script)
        .args([mcp.to_string(), auth.to_string()])
        .arg(log)
        .env("TOKEN_LIFETIME", lifetime.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("server-{mcp}.log"))).unwrap())
        .spawn()
        .unwrap();
    let mut stand = Stand(child);
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(("127.0.0.1", mcp))
        .await
        .is_err()
    {
        if let Some(status) = stand.0.try_wait().unwrap() {
            panic!("the OAuth MCP server ended: {status}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no OAuth MCP server"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stand
}

/// The server `tides` at `mcp`, its OAuth client trusting issuer `issuer`.
fn tides(dir: &Path, mcp: u16, issuer: &str) -> std::sync::Arc<Server> {
    let secret = dir.join("default.secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let config: McpConfig = toml::from_str(&format!(
        r#"
[servers.tides]
url = "http://127.0.0.1:{mcp}/mcp"
init_timeout_ms = 10000
[servers.tides.oauth]
issuer = "{issuer}"
client_id = "fleet"
client_secret_file = "{}"
"#,
        secret.display()
    ))
    .unwrap();
    config.check().unwrap();
    Server::new("tides", config.servers["tides"].clone())
}

/// The token requests the authorization server at `log` received.
fn token_requests(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn text(result: &rmcp::model::CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_finish_across_a_token_renewal() {
    let dir = temp_dir("renewal");
    let (mcp, auth) = (free_port(), free_port());
    let log = dir.join("as.log");
    // Tokens of 2 s: the worker renews each 1 s after it got it.
    let _stand = start(&dir, mcp, auth, 2, &log).await;
    let server = tides(&dir, mcp, &format!("http://127.0.0.1:{auth}"));
    let caller = Caller {
        tenant: "acme".into(),
        user: None,
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    let arguments = |seconds: f64| {
        serde_json::json!({ "seconds": seconds })
            .as_object()
            .unwrap()
            .clone()
    };

    // Two long calls on the first connection; while they run its token
    // is renewed (another call connects again with a new token).
    let long = |s| server.call(&caller, "slow", arguments(s), deadline);
    let later = async {
        tokio::time::sleep(Duration::from_millis(1800)).await;
        server
            .call(&caller, "whoami", Default::default(), deadline)
            .await
    };
    let (a, b, c) = tokio::join!(long(4.0), long(4.5), later);
    let c = c.expect("the call on the renewed connection");
    assert!(text(&c).contains("called by client fleet"), "{c:?}");
    for (r, s) in [(a, "4.0"), (b, "4.5")] {
        let r = r.unwrap_or_else(|e| panic!("a call in flight across the renewal: {e}"));
        assert_eq!(text(&r), format!("slept {s}s"), "{r:?}");
        assert_ne!(r.is_error, Some(true), "{r:?}");
    }
    let issued = token_requests(&log)
        .iter()
        .filter(|r| r["outcome"] == "issued")
        .count();
    assert!(issued >= 2, "the token was renewed: {issued} issued");
    server.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_naming_another_authorization_server_gets_no_secret() {
    let dir = temp_dir("issuer");
    let (trusted_mcp, trusted_auth) = (free_port(), free_port());
    let (other_mcp, other_auth) = (free_port(), free_port());
    let (trusted_log, other_log) = (dir.join("trusted.log"), dir.join("other.log"));
    let _trusted = start(&dir, trusted_mcp, trusted_auth, 600, &trusted_log).await;
    // This MCP server's protected-resource metadata names its own
    // authorization server, not the one the operator configured.
    let _other = start(&dir, other_mcp, other_auth, 600, &other_log).await;
    let issuer = format!("http://127.0.0.1:{trusted_auth}");

    let server = tides(&dir, other_mcp, &issuer);
    let refused = server
        .list_tools()
        .await
        .expect_err("the server is refused");
    let message = refused.to_string();
    assert!(
        message.contains(&format!(
            "names authorization server http://127.0.0.1:{other_auth}, not the configured issuer {issuer}"
        )),
        "{message}"
    );
    assert!(!message.contains(SECRET), "{message}");
    assert_eq!(token_requests(&other_log), Vec::<serde_json::Value>::new());
    assert_eq!(
        token_requests(&trusted_log),
        Vec::<serde_json::Value>::new()
    );

    // The same configuration for the server that names the trusted one
    // works: the refusal above was the issuer's doing.
    let good = tides(&dir, trusted_mcp, &issuer);
    let tools = good.list_tools().await.unwrap();
    assert!(tools.iter().any(|t| t.name == "whoami"), "{tools:?}");
    assert_eq!(token_requests(&trusted_log).len(), 1);
    server.close().await;
    good.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
