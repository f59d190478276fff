//! The MCP family's metrics: calls by server and outcome, their duration,
//! the tools each server gives, and the tools refused for a changed digest. Registered once per process, shared by
//! every tool set it serves (a reloaded set counts on the same series).

/// Every `outcome` of `toolfleet_mcp_calls_total`.
pub const OUTCOMES: &[&str] = &[
    "ok",
    "tool_error",
    "unavailable",
    "refused",
    "timeout",
    "cancelled",
];

/// The MCP family's metrics.
#[derive(Clone)]
pub struct McpMetrics {
    pub(crate) calls: prometheus::IntCounterVec,
    pub(crate) duration: prometheus::HistogramVec,
    pub(crate) tools: prometheus::IntGaugeVec,
    pub(crate) tool_changes: prometheus::IntCounterVec,
}

impl McpMetrics {
    /// The metrics, every outcome of every server at zero.
    ///
    /// # Errors
    ///
    /// A bad metric definition (never, for these constants).
    pub fn new<'a>(servers: impl IntoIterator<Item = &'a str>) -> prometheus::Result<Self> {
        let calls = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "toolfleet_mcp_calls_total",
                "Calls to MCP servers, by server and outcome.",
            ),
            &["server", "outcome"],
        )?;
        let duration = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "toolfleet_mcp_call_duration_seconds",
                "Duration of calls to MCP servers, by server.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["server"],
        )?;
        let tools = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "toolfleet_mcp_tools",
                "Tools each MCP server gives the fleet (at the last listing).",
            ),
            &["server"],
        )?;
        let tool_changes = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "toolfleet_mcp_tool_changes_total",
                "MCP tools refused because their description, schema or hints changed from the digest pinned or accepted, by server.",
            ),
            &["server"],
        )?;
        for server in servers {
            for outcome in OUTCOMES {
                calls.with_label_values(&[server, outcome]);
            }
            tools.with_label_values(&[server]);
            tool_changes.with_label_values(&[server]);
        }
        Ok(Self {
            calls,
            duration,
            tools,
            tool_changes,
        })
    }

    /// Calls to `server` that ended in `outcome` so far.
    pub fn calls(&self, server: &str, outcome: &str) -> u64 {
        self.calls.with_label_values(&[server, outcome]).get()
    }

    /// The tools `server` gave at its last listing.
    pub fn tools(&self, server: &str) -> i64 {
        self.tools.with_label_values(&[server]).get()
    }

    /// Tools of `server` refused so far for a changed digest.
    pub fn tool_changes(&self, server: &str) -> u64 {
        self.tool_changes.with_label_values(&[server]).get()
    }

    /// One collector for the worker's registry.
    pub fn collector(&self) -> Collectors {
        Collectors(self.clone())
    }
}

/// [`McpMetrics`] as one prometheus collector.
pub struct Collectors(McpMetrics);

impl prometheus::core::Collector for Collectors {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        let mut d = self.0.calls.desc();
        d.extend(self.0.duration.desc());
        d.extend(self.0.tools.desc());
        d.extend(self.0.tool_changes.desc());
        d
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let mut m = self.0.calls.collect();
        m.extend(self.0.duration.collect());
        m.extend(self.0.tools.collect());
        m.extend(self.0.tool_changes.collect());
        m
    }
}
