//! The two tools: [`WebSearch`] (`web:search`) and [`ReadPage`]
//! (`web:read_page`), their settings, and [`UrlPolicy`], the
//! `before_call` hook that refuses a page URL before anything runs.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use toolfleet_worker::fence::Fence;
use toolfleet_worker::hooks::{CallInfo, Hooks, Refusal};
use toolfleet_worker::protocol::tools::ToolDefinition;
use toolfleet_worker::settings::SettingsError;
use toolfleet_worker::{NewReference, Tool, ToolCtx, ToolError, ToolOutput, ToolSettings};
use url::Url;

use crate::html::{one_line, readable};
use crate::net::{Dial, FetchError, Fetcher, Limits, Request, Resolve, tls_config};
use crate::policy::NetPolicy;
use crate::search::{Backend, SearchError, SearchQuery};

/// The fence of every page and search result the model reads.
pub const WEB_FENCE: &str = "untrusted_web_content";

/// `toolfleet_web_requests_total{tool, outcome}`: every search and page
/// read by how it ended (`ok`, `empty`, `blocked`, `timeout`, `too_large`,
/// `unsupported`, `http_error`, `rate_limited`, `refused`, `unreadable`,
/// `failed`). Both tools' series start at zero, so a first refusal shows.
#[derive(Clone)]
pub struct WebMetrics {
    requests: prometheus::IntCounterVec,
}

/// Every outcome label, for zero-initialising.
pub const OUTCOMES: &[&str] = &[
    "ok",
    "empty",
    "blocked",
    "timeout",
    "too_large",
    "unsupported",
    "http_error",
    "rate_limited",
    "refused",
    "unreadable",
    "failed",
];

impl WebMetrics {
    /// The counter, every series of both tools at zero.
    ///
    /// # Errors
    ///
    /// A bad metric definition (never, for these constants).
    pub fn new() -> prometheus::Result<Self> {
        let requests = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "toolfleet_web_requests_total",
                "Web searches and page reads, by tool and outcome.",
            ),
            &["tool", "outcome"],
        )?;
        for tool in ["web:search", "web:read_page"] {
            for outcome in OUTCOMES {
                requests.with_label_values(&[tool, outcome]);
            }
        }
        Ok(Self { requests })
    }

    /// The collector, for [`toolfleet_worker::WorkerBuilder::metrics`].
    #[must_use]
    pub fn collector(&self) -> prometheus::IntCounterVec {
        self.requests.clone()
    }

    fn count(&self, tool: &str, outcome: &str) {
        self.requests.with_label_values(&[tool, outcome]).inc();
    }

    /// The count of `tool`'s `outcome` (for tests).
    #[must_use]
    pub fn get(&self, tool: &str, outcome: &str) -> u64 {
        self.requests.with_label_values(&[tool, outcome]).get()
    }
}

/// The outcome label of a tool error.
fn outcome_of(e: &ToolError) -> &'static str {
    match e.code() {
        "blocked" | "blocked_url" => "blocked",
        "timeout" => "timeout",
        "too_large" => "too_large",
        "unsupported_content_type" => "unsupported",
        "http_status" => "http_error",
        "rate_limited" => "rate_limited",
        "backend_refused" => "refused",
        "backend_unreadable" => "unreadable",
        _ => "failed",
    }
}

/// The implementation keys.
pub const SEARCH_KEY: &str = "web.search";
pub const READ_PAGE_KEY: &str = "web.read_page";

fn setting<T: for<'de> Deserialize<'de>>(
    s: &ToolSettings,
    name: &str,
) -> Result<Option<T>, SettingsError> {
    s.get(name)
}

fn required<T: for<'de> Deserialize<'de>>(
    s: &ToolSettings,
    name: &str,
) -> Result<T, SettingsError> {
    setting(s, name)?.ok_or_else(|| {
        SettingsError(format!(
            "settings of {}: {name:?} has no value and no default",
            s.tool()
        ))
    })
}

/// The network settings both tools share.
fn net_policy(s: &ToolSettings) -> Result<NetPolicy, SettingsError> {
    let bad = |m: String| SettingsError(format!("settings of {}: {m}", s.tool()));
    let cidrs: Vec<String> = required(s, "allowCidrs")?;
    let allow_cidrs = cidrs
        .iter()
        .map(|c| {
            c.parse::<ipnet::IpNet>()
                .or_else(|_| c.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    bad(format!(
                        "allowCidrs: {c:?} is not a CIDR such as 10.0.0.0/8"
                    ))
                })
        })
        .collect::<Result<_, _>>()?;
    let hosts: Vec<String> = required(s, "allowHosts")?;
    Ok(NetPolicy {
        allowed_ports: required(s, "allowedPorts")?,
        any_port: false,
        allow_hosts: hosts
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .collect(),
        allow_cidrs,
        allow_idn: setting(s, "allowIdn")?.unwrap_or(false),
    })
}

/// A timeout setting, which must leave the tool's own deadline room.
fn timeout(s: &ToolSettings, definition: &ToolDefinition) -> Result<Duration, SettingsError> {
    let ms: u64 = required(s, "timeoutMs")?;
    if ms >= definition.timeout_ms {
        return Err(SettingsError(format!(
            "settings of {}: timeoutMs {ms} must be shorter than the tool's timeoutMs {} \
             (the call would be cut before the request could report its own timeout)",
            s.tool(),
            definition.timeout_ms
        )));
    }
    Ok(Duration::from_millis(ms))
}

fn fetcher(
    s: &ToolSettings,
    policy: NetPolicy,
    resolver: Arc<dyn Resolve>,
    dialer: Arc<dyn Dial>,
) -> Result<Fetcher, SettingsError> {
    let bad = |m: String| SettingsError(format!("settings of {}: {m}", s.tool()));
    let extra_ca: Option<String> = setting(s, "extraCaFile")?;
    let tls = tls_config(extra_ca.as_deref().map(std::path::Path::new)).map_err(&bad)?;
    let agent: String = required(s, "userAgent")?;
    Fetcher::new(policy, resolver, dialer, tls, &agent).map_err(bad)
}

/// How a failed fetch is answered: a policy refusal is `blocked`, never
/// `error`.
fn fetch_error(e: FetchError) -> ToolError {
    match e {
        FetchError::Blocked(reason) => ToolError::blocked(reason),
        FetchError::Timeout(m) => ToolError::Timeout(m),
        FetchError::TooLarge(m) => ToolError::coded("too_large", m),
        FetchError::Unsupported(m) => ToolError::coded("unsupported_content_type", m),
        FetchError::Failed { message, retryable } => {
            if retryable {
                ToolError::transient(message)
            } else {
                ToolError::failed(message)
            }
        }
    }
}

/// `web:search`.
pub struct WebSearch {
    backend: Backend,
    fetcher: Fetcher,
    limits: Limits,
    default_results: usize,
    metrics: Option<WebMetrics>,
}

impl WebSearch {
    /// The tool under its checked settings. The backend's own endpoint is
    /// allowed by the policy (the operator chose it, and it may be on the
    /// internal network); every other address is checked as usual.
    ///
    /// # Errors
    ///
    /// A setting that conflicts with another or does not parse.
    pub fn new(
        definition: &ToolDefinition,
        s: &ToolSettings,
        resolver: Arc<dyn Resolve>,
        dialer: Arc<dyn Dial>,
    ) -> Result<Self, SettingsError> {
        let bad = |m: String| SettingsError(format!("settings of {}: {m}", s.tool()));
        let url = |name: &str| -> Result<Option<Url>, SettingsError> {
            let Some(text) = setting::<String>(s, name)? else {
                return Ok(None);
            };
            let url =
                Url::parse(&text).map_err(|e| bad(format!("{name} {text:?} is not a URL: {e}")))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(bad(format!("{name} must be an http or https URL")));
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err(bad(format!(
                    "{name} must not hold credentials (every request would be refused)"
                )));
            }
            Ok(Some(url))
        };
        let backend_name: String = required(s, "backend")?;
        let backend = match backend_name.as_str() {
            "duckduckgo" => Backend::DuckDuckGo {
                url: url("duckduckgoUrl")?.ok_or_else(|| bad("duckduckgoUrl is empty".into()))?,
            },
            "searxng" => Backend::Searxng {
                url: url("searxngUrl")?.ok_or_else(|| {
                    bad("backend \"searxng\" needs searxngUrl (the instance's base URL)".into())
                })?,
            },
            "brave" => Backend::Brave {
                url: url("braveUrl")?.ok_or_else(|| bad("braveUrl is empty".into()))?,
                key: s.secret("braveApiKey").cloned().ok_or_else(|| {
                    bad(format!(
                        "backend \"brave\" needs braveApiKey: set {} (or its _FILE form), or \
                         braveApiKey = {{ env = \"...\" }} in the settings file",
                        toolfleet_worker::settings::secret_variable(definition, "braveApiKey")
                    ))
                })?,
            },
            other => return Err(bad(format!("unknown backend {other:?}"))),
        };
        if backend_name != "searxng" && setting::<String>(s, "searxngUrl")?.is_some() {
            return Err(bad(format!(
                "searxngUrl is set but the backend is {backend_name:?}: set backend = \"searxng\" or remove it"
            )));
        }
        let mut policy = net_policy(s)?;
        let endpoint = backend.endpoint();
        let host = endpoint.host_str().unwrap_or_default().to_ascii_lowercase();
        let port = endpoint.port_or_known_default().unwrap_or(443);
        // `host:port` allows that port for that host only.
        policy.allow_hosts.push(format!("{host}:{port}"));
        Ok(Self {
            fetcher: fetcher(s, policy, resolver, dialer)?,
            limits: Limits {
                max_bytes: 4 * 1024 * 1024,
                timeout: timeout(s, definition)?,
                max_redirects: 3,
                content_types: Vec::new(),
            },
            default_results: required(s, "maxResults")?,
            backend,
            metrics: None,
        })
    }

    /// Counts every call in `metrics`.
    #[must_use]
    pub fn counting(mut self, metrics: WebMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The backend's name.
    #[must_use]
    pub fn backend(&self) -> &'static str {
        self.backend.name()
    }
}

/// Arguments of [`WebSearch`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchArgs {
    pub query: String,
    pub max_results: Option<usize>,
    pub language: Option<String>,
    pub region: Option<String>,
}

impl Tool for WebSearch {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let result = self.search(ctx, args).await;
        if let Some(m) = &self.metrics {
            let outcome = match &result {
                Ok(out)
                    if out
                        .data
                        .as_ref()
                        .is_some_and(|d| d["results"].as_array().is_some_and(Vec::is_empty)) =>
                {
                    "empty"
                }
                Ok(_) => "ok",
                Err(e) => outcome_of(e),
            };
            m.count("web:search", outcome);
        }
        result
    }
}

impl WebSearch {
    async fn search(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        let query = SearchQuery {
            query: args.query.trim().to_owned(),
            max_results: args
                .max_results
                .unwrap_or(self.default_results)
                .clamp(1, 20),
            language: args.language,
            region: args.region,
        };
        let backend = self.backend.name();
        ctx.attempt_started(backend);
        let hits = match self
            .backend
            .search(&self.fetcher, &query, &self.limits)
            .await
        {
            Ok(hits) => {
                ctx.attempt_completed(backend);
                hits
            }
            Err(e) => {
                ctx.attempt_failed(backend, &e.to_string());
                return Err(match e {
                    SearchError::RateLimited { message, .. } => {
                        ToolError::coded("rate_limited", message)
                    }
                    SearchError::Refused(m) => ToolError::coded("backend_refused", m),
                    SearchError::Unreadable(m) => ToolError::coded("backend_unreadable", m),
                    SearchError::Fetch(f) => fetch_error(f),
                });
            }
        };
        if hits.is_empty() {
            return ToolOutput::text(format!("No web results for {:?}.", query.query))
                .with_data(json!({"backend": backend, "results": []}));
        }
        let refs = ctx
            .cite(
                hits.iter()
                    .map(|h| NewReference {
                        kind: "web".into(),
                        title: h.title.clone(),
                        source: Some(backend.into()),
                        url: Some(h.url.clone()),
                        snippet: (!h.snippet.is_empty()).then(|| h.snippet.clone()),
                    })
                    .collect(),
            )
            .await?;
        let mut listed = String::new();
        let mut results = Vec::new();
        for (hit, r) in hits.iter().zip(&refs) {
            listed.push_str(&format!("{} {} — {}\n", r.marker(), hit.title, hit.url));
            if !hit.snippet.is_empty() {
                listed.push_str(&format!("   {}\n", hit.snippet));
            }
            results.push(json!({
                "title": hit.title, "url": hit.url, "snippet": hit.snippet, "ref": r.marker(),
            }));
        }
        // Titles, URLs and snippets are the web's: inside the fence.
        let fence = Fence::random(WEB_FENCE);
        let text = format!(
            "Web results for {:?} from {backend}. {}\n{}",
            query.query,
            fence.preamble("Each result (its title, address and snippet)"),
            fence.wrap(&listed)
        );
        ToolOutput::text(text.trim_end()).with_data(json!({"backend": backend, "results": results}))
    }
}

/// `web:read_page`.
pub struct ReadPage {
    fetcher: Fetcher,
    limits: Limits,
    max_tokens: usize,
    metrics: Option<WebMetrics>,
}

impl ReadPage {
    /// The tool under its checked settings.
    ///
    /// # Errors
    ///
    /// A setting that conflicts with another or does not parse.
    pub fn new(
        definition: &ToolDefinition,
        s: &ToolSettings,
        resolver: Arc<dyn Resolve>,
        dialer: Arc<dyn Dial>,
    ) -> Result<Self, SettingsError> {
        let policy = net_policy(s)?;
        Ok(Self {
            fetcher: fetcher(s, policy, resolver, dialer)?,
            limits: Limits {
                max_bytes: required(s, "maxBytes")?,
                timeout: timeout(s, definition)?,
                max_redirects: required(s, "maxRedirects")?,
                content_types: required(s, "contentTypes")?,
            },
            max_tokens: required(s, "maxTokens")?,
            metrics: None,
        })
    }

    /// Counts every call (and every URL its hook refuses) in `metrics`.
    #[must_use]
    pub fn counting(mut self, metrics: WebMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The hook that refuses a page URL before the call runs.
    #[must_use]
    pub fn url_policy(&self) -> UrlPolicy {
        UrlPolicy(
            Arc::new(self.fetcher.policy().clone()),
            self.metrics.clone(),
        )
    }
}

/// Arguments of [`ReadPage`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadArgs {
    pub url: String,
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub include_links: bool,
}

fn encoding() -> &'static tiktoken_rs::CoreBPE {
    static ENCODING: OnceLock<tiktoken_rs::CoreBPE> = OnceLock::new();
    ENCODING.get_or_init(|| tiktoken_rs::o200k_base().expect("the o200k_base encoding is built in"))
}

/// `text` cut to `max` tokens: the text and whether it was cut.
fn cap_tokens(text: &str, max: usize) -> (String, bool) {
    let bpe = encoding();
    let tokens = bpe.encode_ordinary(text);
    if tokens.len() <= max {
        return (text.to_owned(), false);
    }
    // A cut inside a character decodes lossily: back off to a boundary.
    let mut n = max;
    while n > 0 {
        if let Ok(cut) = bpe.decode(&tokens[..n]) {
            return (cut, true);
        }
        n -= 1;
    }
    (String::new(), true)
}

impl Tool for ReadPage {
    type Args = ReadArgs;

    async fn call(&self, ctx: &ToolCtx, args: ReadArgs) -> Result<ToolOutput, ToolError> {
        let result = self.read(ctx, args).await;
        if let Some(m) = &self.metrics {
            m.count(
                "web:read_page",
                result.as_ref().map_or_else(outcome_of, |_| "ok"),
            );
        }
        result
    }
}

impl ReadPage {
    async fn read(&self, ctx: &ToolCtx, args: ReadArgs) -> Result<ToolOutput, ToolError> {
        let fetched = self
            .fetcher
            .fetch(&Request::get(args.url.trim()), &self.limits)
            .await
            .map_err(fetch_error)?;
        if !(200..300).contains(&fetched.status) {
            // The page's own answer: the model reads it at once (a retry
            // through the queue would only delay a 404 or a busy site).
            return Err(ToolError::coded(
                "http_status",
                format!("{} answered HTTP {}", fetched.url, fetched.status),
            ));
        }
        let max = args
            .max_tokens
            .unwrap_or(self.max_tokens)
            .min(self.max_tokens);
        let final_url = fetched.url.clone();
        // Parsing and token counting are CPU work on up to maxBytes: off
        // the async threads, and on a byte budget the token cap needs.
        let (title, text, links, truncated) = tokio::task::spawn_blocking(move || {
            let raw = fetched.text();
            let (title, text, links) = match fetched.content_type.as_deref() {
                Some("text/plain") => (
                    None,
                    raw.lines()
                        .map(one_line)
                        .collect::<Vec<_>>()
                        .join("\n")
                        .trim()
                        .to_owned(),
                    Vec::new(),
                ),
                _ => {
                    let page = readable(&raw, &fetched.url);
                    (page.title, page.text, page.links)
                }
            };
            let budget = max.saturating_mul(16);
            let (text, cut) = match text.char_indices().nth(budget) {
                Some((at, _)) => (text[..at].to_owned(), true),
                None => (text, false),
            };
            let (text, truncated) = cap_tokens(&text, max);
            (title, text, links, truncated || cut)
        })
        .await
        .map_err(|e| ToolError::failed(format!("reading the page failed: {e}")))?;
        let url = final_url.to_string();
        let title = title.unwrap_or_else(|| url.clone());
        let snippet: String = text.chars().take(200).collect();
        let reference = ctx
            .cite(vec![NewReference {
                kind: "web".into(),
                title: title.clone(),
                source: final_url.host_str().map(str::to_owned),
                url: Some(url.clone()),
                snippet: (!snippet.is_empty()).then_some(snippet),
            }])
            .await?
            .remove(0);
        // Title, text and link labels are the page's: all inside the
        // fence, which its content cannot close (`toolfleet_worker::fence`).
        let mut page = format!("Title: {title}\nURL: {url}\n\n{text}");
        if args.include_links && !links.is_empty() {
            page.push_str("\n\nLinks on the page:\n");
            for (label, link) in &links {
                page.push_str(&format!("- {label} <{link}>\n"));
            }
        }
        let fence = Fence::random(WEB_FENCE);
        let mut content = format!(
            "{} {}\n{}",
            reference.marker(),
            fence.preamble("The page below (its title, text and links)"),
            fence.wrap(&page)
        );
        if truncated {
            content.push_str(&format!("\n(The text was cut at {max} tokens.)"));
        }
        let mut data = json!({
            "url": url, "title": title, "text": text, "truncated": truncated,
            "untrusted": true, "ref": reference.marker(),
        });
        if args.include_links {
            data["links"] = links
                .iter()
                .map(|(t, u)| json!({"text": t, "url": u}))
                .collect();
        }
        ToolOutput::text(content.trim_end()).with_data(data)
    }
}

/// The `before_call` hook of `web:read_page`: the URL argument passes the
/// syntactic gate (scheme, port, credentials, IP literals in every
/// spelling) before the tool runs, so a refused URL costs no resolution.
#[derive(Clone)]
pub struct UrlPolicy(Arc<NetPolicy>, Option<WebMetrics>);

impl Hooks for UrlPolicy {
    fn before_call(&self, call: &CallInfo<'_>) -> Result<(), Refusal> {
        if call.definition.implementation_key != READ_PAGE_KEY {
            return Ok(());
        }
        let Some(url) = call.arguments.get("url").and_then(|u| u.as_str()) else {
            return Ok(());
        };
        self.0.check_url(url).map(|_| ()).map_err(|blocked| {
            if let Some(m) = &self.1 {
                m.count("web:read_page", "blocked");
            }
            Refusal::new("blocked_url", blocked.0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_capped_at_a_character_boundary() {
        let text = "héllo wörld ".repeat(200);
        let (cut, truncated) = cap_tokens(&text, 50);
        assert!(truncated);
        assert!(encoding().encode_ordinary(&cut).len() <= 50);
        assert!(text.starts_with(&cut));
        let (same, truncated) = cap_tokens("short", 50);
        assert_eq!((same.as_str(), truncated), ("short", false));
    }
}
