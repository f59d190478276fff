//! The MCP import authenticating to an HTTP MCP server with OAuth 2.1, as
//! the MCP authorization specification asks of a client without a
//! browser, against `tests/mcp/oauth_server.py`: an MCP server on the
//! official Python SDK that requires bearer tokens for its own resource,
//! and a small authorization-server stand-in whose token endpoint refuses
//! a request without the right `resource` parameter. The worker runs as a
//! process beside a real fleet (NATS, Redis):
//!
//! - it discovers the protected-resource metadata from the server's 401,
//!   then the authorization server's, and gets a token with the
//!   client-credentials grant and the `resource` parameter: a tenant with
//!   a client of its own is called with its own token, another with the
//!   default client's;
//! - a tenant whose client secret is wrong gets a clear error naming the
//!   client, and the stand-in saw `invalid_client`;
//! - after the server restarts (its tokens forgotten), the token it
//!   refuses is replaced with a new one;
//! - no secret is in any event, the worker's log (at debug) or the
//!   stand-in's log.

// The harness is shared with other targets; its start is over 100 lines.
#[allow(clippy::too_many_lines)]
mod support;

use std::path::Path;

use serde_json::{Value, json};
use support::{Env, KillOnDrop, WAIT};

const DEFAULT_SECRET: &str = "default-s3cret-9f2a";
const ACME_SECRET: &str = "acme-s3cret-7c1b";
const WRONG_SECRET: &str = "wrong-s3cret-0d4e";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the OAuth MCP server and its authorization server, waiting
/// until the MCP port answers.
async fn start_server(dir: &Path, mcp: u16, auth: u16) -> std::process::Child {
    let mut child = std::process::Command::new("python3")
        .arg(support::root().join("tests/mcp/oauth_server.py"))
        .args([mcp.to_string(), auth.to_string()])
        .arg(dir.join("as.log"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("server-{mcp}.log"))).unwrap())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(("127.0.0.1", mcp))
        .await
        .is_err()
    {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the OAuth MCP server ended: {status}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no OAuth MCP server"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    child
}

/// The worker's configuration: the default client, acme's own, and
/// globex's with a wrong secret; and the same server again as `fixed`,
/// with a static bearer token (`token`).
fn config(dir: &Path, mcp: u16, auth: u16, token: &str) -> std::path::PathBuf {
    let secret = |name: &str, value: &str| {
        let path = dir.join(name);
        std::fs::write(&path, format!("{value}\n")).unwrap();
        path.display().to_string()
    };
    let text = format!(
        r#"
[servers.tides]
url = "http://127.0.0.1:{mcp}/mcp"
init_timeout_ms = 5000
[servers.tides.oauth]
issuer = "http://127.0.0.1:{auth}"
client_id = "fleet"
client_secret_file = "{}"
[servers.tides.oauth.tenants.acme]
client_id = "fleet-acme"
client_secret_file = "{}"
[servers.tides.oauth.tenants.globex]
client_id = "fleet-globex"
client_secret_file = "{}"

[servers.fixed]
url = "http://127.0.0.1:{mcp}/mcp"
bearer_token_file = "{}"
"#,
        secret("default.secret", DEFAULT_SECRET),
        secret("acme.secret", ACME_SECRET),
        secret("globex.secret", WRONG_SECRET),
        secret("fixed.token", token),
    );
    let path = dir.join("mcp.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The answer to `question` as `tenant`, once the fleet offers the tool;
/// its events too.
async fn ask_as(env: &Env, tenant: &str, question: &str) -> (String, String) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut job = toolfleet_protocol::client::question(question);
        job.tenant = Some(tenant.into());
        let outcome = env.submit(&job).await.unwrap();
        if !outcome.text.contains("there is no tool named") {
            return (
                outcome.text,
                serde_json::to_string(&outcome.events).unwrap(),
            );
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", outcome.text);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// The answer to "who am I?" as `tenant` (the OAuth server), and its
/// events.
async fn ask(env: &Env, tenant: &str) -> (String, String) {
    ask_as(env, tenant, "who am I?").await
}

/// A token of the default client, as an operator would get one to
/// configure as a static bearer token.
async fn static_token(auth: u16, resource: &str) -> String {
    let answer: Value = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{auth}/token"))
        .basic_auth("fleet", Some(DEFAULT_SECRET))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!(
            "grant_type=client_credentials&resource={}",
            url::form_urlencoded::byte_serialize(resource.as_bytes()).collect::<String>()
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    answer["access_token"].as_str().unwrap().to_string()
}

/// The stand-in's log: one JSON object per token request.
fn token_requests(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("as.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_import_gets_tokens_per_tenant_with_oauth_and_the_resource_parameter() {
    let env = Env::start_bare(json!({ "rules": [
        { "whenUserContains": ["fixed"], "steps": [
            { "toolCalls": [ { "name": "mcp_fixed_whoami", "arguments": {} } ] },
            { "answer": "Fixed: {{tool:mcp_fixed_whoami}}" }
        ] },
        { "whenUserContains": ["who"], "steps": [
            { "toolCalls": [ { "name": "mcp_tides_whoami", "arguments": {} } ] },
            { "answer": "Said: {{tool:mcp_tides_whoami}}" }
        ] }
    ] }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (mcp, auth) = (free_port(), free_port());
    let resource = format!("http://127.0.0.1:{mcp}/mcp");
    let mut first = start_server(dir.path(), mcp, auth).await;
    let first = KillOnDrop(&mut first);
    let token = static_token(auth, &resource).await;
    let config = config(dir.path(), mcp, auth, &token);
    let log = dir.path().join("worker.log");
    let mut worker = start_worker(&env, &config, &log);
    let _worker = KillOnDrop(&mut worker);

    // acme's own client; the default client for a tenant without one.
    let (acme, acme_events) = ask(&env, "acme").await;
    assert!(acme.contains("called by client fleet-acme"), "{acme}");
    let (other, _) = ask(&env, "default").await;
    assert!(other.contains("called by client fleet\n"), "{other}");
    // Today's static bearer token still works.
    let (fixed, _) = ask_as(&env, "acme", "and with the fixed token?").await;
    assert!(
        fixed.contains("Fixed: ") && fixed.contains("called by client fleet\n"),
        "{fixed}"
    );
    // A wrong secret: a clear error, naming the client.
    let (globex, globex_events) = ask(&env, "globex").await;
    assert!(
        globex.contains("the authorization server refused client \"fleet-globex\": invalid_client"),
        "{globex}"
    );

    check_token_requests(dir.path(), &resource, auth).await;

    // The server restarts and forgets its tokens: the one it refuses is
    // replaced, and acme is served again.
    let acme_tokens = |dir: &Path| {
        token_requests(dir)
            .iter()
            .filter(|r| r["client_id"] == "fleet-acme" && r["outcome"] == "issued")
            .count()
    };
    let before = acme_tokens(dir.path());
    drop(first);
    let mut server = start_server(dir.path(), mcp, auth).await;
    let _server = KillOnDrop(&mut server);
    let (again, _) = ask(&env, "acme").await;
    assert!(again.contains("called by client fleet-acme"), "{again}");
    assert!(acme_tokens(dir.path()) > before, "no new token for acme");

    let as_log = std::fs::read_to_string(dir.path().join("as.log")).unwrap();
    let worker_log = std::fs::read_to_string(&log).unwrap();
    assert!(
        worker_log.contains("MCP server refused the OAuth token"),
        "{worker_log}"
    );
    check_no_secret(&[
        ("acme's events", &acme_events),
        ("globex's events", &globex_events),
        ("the worker's log", &worker_log),
        ("the authorization server's log", &as_log),
    ]);
}

/// The worker as a process, logging at debug to `log`.
fn start_worker(env: &Env, config: &Path, log: &Path) -> std::process::Child {
    std::process::Command::new(support::sibling_bin("toolfleet-worker-mcp"))
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env("TOOLFLEET_REDIS_URL", env.redis.url())
        .env("TOOLFLEET_MCP_CONFIG", config)
        .env("TOOLFLEET_METRICS_ADDR", "127.0.0.1:0")
        .env("TOOLFLEET_LOG", "debug")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Every token asked for named the resource and the client-credentials
/// grant; the stand-in refuses a request without the resource.
async fn check_token_requests(dir: &Path, resource: &str, auth: u16) {
    let requests = token_requests(dir);
    let issued: Vec<&Value> = requests
        .iter()
        .filter(|r| r["outcome"] == "issued")
        .collect();
    assert!(
        issued.iter().any(|r| r["client_id"] == "fleet-acme"),
        "{requests:?}"
    );
    assert!(
        issued.iter().any(|r| r["client_id"] == "fleet"),
        "{requests:?}"
    );
    assert!(
        requests.iter().any(|r| r["outcome"] == "invalid_client"),
        "{requests:?}"
    );
    for r in &requests {
        assert_eq!(r["resource"], json!(resource), "{r}");
        assert_eq!(r["grant_type"], "client_credentials", "{r}");
    }
    let refused = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{auth}/token"))
        .basic_auth("fleet", Some(DEFAULT_SECRET))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("grant_type=client_credentials")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    assert!(refused.text().await.unwrap().contains("invalid_target"));
}

/// None of the secrets is in any of `texts`.
fn check_no_secret(texts: &[(&str, &String)]) {
    for secret in [DEFAULT_SECRET, ACME_SECRET, WRONG_SECRET] {
        for (what, text) in texts {
            assert!(!text.contains(secret), "{what} hold a secret");
        }
    }
}
