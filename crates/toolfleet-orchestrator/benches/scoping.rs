//! Tool scoping over 10,000 definitions
//! (`cargo bench -p toolfleet-orchestrator --bench scoping`): the cost of
//! the relevance decision per invocation, of rebuilding the index on a
//! catalog swap, of a `search_tools` call, and the heap each definition
//! takes. No framework, as the root crate's benches: timed runs with
//! `Instant`, percentiles printed as a table for BENCHMARKS.md.
//!
//! The catalog is generated (a fixed seed, so every run indexes the same
//! text): namespaces, verb + noun names, categories, tags, 1–5 parameters
//! and two-to-three-sentence descriptions from word lists, every
//! definition compiled as a worker's would be (`CompiledTool::new`).
//! Memory is counted by a counting global allocator (`stats_alloc`; the
//! workspace forbids the unsafe code one would need here).

// Benchmarks are exempt from the 100-line limit: a measured scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::alloc::System;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use toolfleet_config::ScopingPolicy;
use toolfleet_llm::Message;
use toolfleet_orchestrator::tools::gating;
use toolfleet_orchestrator::tools::scoring::{self as scoping, RelevanceIndex};
use toolfleet_protocol::registry::{Registry, SourcedTool, ToolSource};
use toolfleet_protocol::tools::{CompiledTool, ToolDefinition};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const TOOLS: usize = 10_000;
const DECISION_RUNS: usize = 2_000;
const BUILD_RUNS: usize = 20;
const SEARCH_RUNS: usize = 50;

const NAMESPACES: &[(&str, &str, &str)] = &[
    // (namespace, product name, category)
    ("github", "GitHub", "devops"),
    ("gitlab", "GitLab", "devops"),
    ("jira", "Jira", "productivity"),
    ("linear", "Linear", "productivity"),
    ("slack", "Slack", "communication"),
    ("teams", "Microsoft Teams", "communication"),
    ("gmail", "Gmail", "communication"),
    ("outlook", "Outlook", "communication"),
    ("calendar", "Google Calendar", "productivity"),
    ("drive", "Google Drive", "storage"),
    ("dropbox", "Dropbox", "storage"),
    ("sheets", "Google Sheets", "productivity"),
    ("notion", "Notion", "knowledge"),
    ("confluence", "Confluence", "knowledge"),
    ("salesforce", "Salesforce", "crm"),
    ("hubspot", "HubSpot", "crm"),
    ("zendesk", "Zendesk", "support"),
    ("intercom", "Intercom", "support"),
    ("stripe", "Stripe", "finance"),
    ("quickbooks", "QuickBooks", "finance"),
    ("xero", "Xero", "finance"),
    ("shopify", "Shopify", "commerce"),
    ("amazon_seller", "Amazon Seller Central", "commerce"),
    ("shipstation", "ShipStation", "logistics"),
    ("workday", "Workday", "hr"),
    ("greenhouse", "Greenhouse", "hr"),
    ("gusto", "Gusto", "hr"),
    ("aws", "Amazon Web Services", "cloud"),
    ("gcp", "Google Cloud", "cloud"),
    ("azure", "Microsoft Azure", "cloud"),
    ("kubernetes", "Kubernetes", "cloud"),
    ("datadog", "Datadog", "monitoring"),
    ("pagerduty", "PagerDuty", "monitoring"),
    ("postgres", "PostgreSQL", "data"),
    ("snowflake", "Snowflake", "data"),
    ("analytics", "Google Analytics", "analytics"),
    ("mixpanel", "Mixpanel", "analytics"),
    ("ads", "Google Ads", "marketing"),
    ("mailchimp", "Mailchimp", "marketing"),
    ("weather", "the weather service", "weather"),
    ("maps", "the maps service", "travel"),
    ("flights", "the flight search service", "travel"),
    ("hotels", "the hotel booking service", "travel"),
    ("spotify", "Spotify", "media"),
    ("youtube", "YouTube", "media"),
    ("news", "the news service", "knowledge"),
    ("translate", "the translation service", "language"),
    ("docusign", "DocuSign", "legal"),
];

const VERBS: &[(&str, &str)] = &[
    // (verb, third person)
    ("get", "Gets"),
    ("list", "Lists"),
    ("create", "Creates"),
    ("update", "Updates"),
    ("delete", "Deletes"),
    ("search", "Searches"),
    ("find", "Finds"),
    ("send", "Sends"),
    ("fetch", "Fetches"),
    ("sync", "Synchronises"),
    ("export", "Exports"),
    ("import", "Imports"),
    ("archive", "Archives"),
    ("approve", "Approves"),
    ("cancel", "Cancels"),
    ("schedule", "Schedules"),
    ("convert", "Converts"),
    ("summarize", "Summarizes"),
    ("validate", "Validates"),
    ("upload", "Uploads"),
    ("download", "Downloads"),
    ("assign", "Assigns"),
    ("merge", "Merges"),
    ("close", "Closes"),
    ("reopen", "Reopens"),
    ("share", "Shares"),
    ("compare", "Compares"),
    ("estimate", "Estimates"),
    ("count", "Counts"),
    ("watch", "Watches"),
];

const NOUNS: &[&str] = &[
    "invoice",
    "customer",
    "order",
    "payment",
    "refund",
    "ticket",
    "message",
    "channel",
    "email",
    "event",
    "meeting",
    "file",
    "folder",
    "document",
    "spreadsheet",
    "report",
    "dashboard",
    "campaign",
    "keyword",
    "record",
    "domain",
    "bucket",
    "instance",
    "cluster",
    "pod",
    "database",
    "table",
    "user",
    "team",
    "project",
    "task",
    "comment",
    "label",
    "milestone",
    "release",
    "build",
    "deployment",
    "alert",
    "incident",
    "forecast",
    "route",
    "flight",
    "hotel",
    "booking",
    "playlist",
    "track",
    "photo",
    "album",
    "note",
    "contact",
    "lead",
    "opportunity",
    "product",
    "shipment",
    "warehouse",
    "employee",
    "payslip",
    "candidate",
    "interview",
    "subscription",
    "contract",
    "signature",
    "repository",
    "branch",
    "commit",
    "issue",
    "article",
    "translation",
    "metric",
    "log",
];

/// The nouns of some namespaces (the rest draw 12 from [`NOUNS`]), so
/// that a namespace's tools are about its own things, as in a real fleet.
const NAMESPACE_NOUNS: &[(&str, &[&str])] = &[
    (
        "stripe",
        &[
            "invoice",
            "customer",
            "payment",
            "refund",
            "subscription",
            "charge",
            "payout",
            "dispute",
            "coupon",
            "product",
        ],
    ),
    (
        "quickbooks",
        &[
            "invoice",
            "bill",
            "vendor",
            "customer",
            "payment",
            "expense",
            "account",
            "report",
            "tax_rate",
            "journal_entry",
        ],
    ),
    (
        "gmail",
        &[
            "email",
            "message",
            "contact",
            "label",
            "draft",
            "thread",
            "attachment",
            "filter",
            "signature",
            "alias",
        ],
    ),
    (
        "slack",
        &[
            "message", "channel", "user", "team", "reaction", "thread", "file", "reminder",
            "workflow", "emoji",
        ],
    ),
    (
        "github",
        &[
            "repository",
            "issue",
            "branch",
            "commit",
            "release",
            "pull_request",
            "workflow",
            "review",
            "label",
            "milestone",
        ],
    ),
    (
        "jira",
        &[
            "issue",
            "project",
            "sprint",
            "board",
            "comment",
            "label",
            "user",
            "epic",
            "version",
            "attachment",
        ],
    ),
    (
        "weather",
        &[
            "forecast",
            "alert",
            "observation",
            "station",
            "radar",
            "warning",
            "air_quality",
            "uv_index",
            "sunrise",
            "tide",
        ],
    ),
    (
        "flights",
        &[
            "flight",
            "booking",
            "airport",
            "fare",
            "seat",
            "itinerary",
            "route",
            "airline",
            "baggage",
            "checkin",
        ],
    ),
];

/// Phrases that vary the descriptions (and the vocabulary).
const CONTEXTS: &[&str] = &[
    "for a given account",
    "across all workspaces",
    "in the EU region",
    "for the current quarter",
    "with their owners and due dates",
    "including drafts",
    "for one organisation",
    "with optional filters",
    "by customer segment",
    "within a date range",
    "for a sales territory",
    "shared with external guests",
    "flagged as overdue",
    "marked as high priority",
    "in the sandbox environment",
    "with their audit trail",
    "grouped by cost centre",
    "from the last 90 days",
    "with delivery receipts",
    "with compliance labels",
];

const QUALIFIERS: &[&str] = &[
    "",
    "",
    "",
    "",
    "details",
    "history",
    "summary",
    "by_date",
    "in_bulk",
    "status",
    "owner",
    "usage",
    "permissions",
    "settings",
    "template",
];

const PARAMETERS: &[&str] = &[
    "id",
    "query",
    "limit",
    "startDate",
    "endDate",
    "customer_id",
    "amount",
    "currency",
    "email",
    "channel",
    "message",
    "title",
    "body",
    "status",
    "priority",
    "assignee",
    "projectKey",
    "file_path",
    "region",
    "language",
    "format",
    "pageToken",
    "include_archived",
    "city",
    "timezone",
    "order_id",
    "tags",
    "due_date",
    "recipient",
    "account_id",
];

const EXTRA_SENTENCES: &[&str] = &[
    "Returns at most `limit` results, newest first.",
    "Results are paginated: pass the returned page token to continue.",
    "Times are given in UTC unless a timezone is passed.",
    "Needs read access to the workspace.",
    "Changes are audited and can be undone within 30 days.",
    "Use it when the user asks about recent activity or changes.",
    "Large exports run in the background and return a link.",
    "Fails when the caller lacks permission, with a clear message.",
    "Amounts are in the account's default currency.",
    "Only items the user can see are included.",
    "Archived items are left out unless asked for.",
    "Supports filtering by status, owner and date range.",
];

const GENERIC_TAGS: &[&str] = &[
    "read",
    "write",
    "admin",
    "bulk",
    "realtime",
    "reporting",
    "automation",
    "sync",
    "search",
    "notifications",
];

/// SplitMix64: a tiny deterministic generator (no `rand` needed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

fn plural(noun: &str) -> String {
    if noun.ends_with('s') || noun.ends_with("ch") || noun.ends_with('x') {
        format!("{noun}es")
    } else if let Some(stem) = noun.strip_suffix('y') {
        format!("{stem}ies")
    } else {
        format!("{noun}s")
    }
}

/// `count` distinct, varied definitions.
fn catalog(count: usize) -> Vec<ToolDefinition> {
    let mut rng = Rng(0x7001_f1ee_7000_0001);
    let nouns_of: Vec<Vec<&str>> = NAMESPACES
        .iter()
        .map(
            |(ns, _, _)| match NAMESPACE_NOUNS.iter().find(|(n, _)| n == ns) {
                Some((_, nouns)) => nouns.to_vec(),
                None => {
                    let mut nouns: Vec<&str> = Vec::new();
                    while nouns.len() < 12 {
                        let noun = *rng.pick(NOUNS);
                        if !nouns.contains(&noun) {
                            nouns.push(noun);
                        }
                    }
                    nouns
                }
            },
        )
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let n = rng.below(NAMESPACES.len());
        let (ns, product, category) = NAMESPACES[n];
        let (verb, verbs) = *rng.pick(VERBS);
        let noun = *rng.pick(&nouns_of[n]);
        let qualifier = *rng.pick(QUALIFIERS);
        let name = if qualifier.is_empty() {
            format!("{verb}_{noun}")
        } else {
            format!("{verb}_{noun}_{qualifier}")
        };
        if !seen.insert((ns, name.clone())) {
            continue;
        }
        let function = format!("{ns}_{name}");
        if function.len() > 64 {
            continue;
        }
        let other = *rng.pick(&nouns_of[n]);
        let noun_text = noun.replace('_', " ");
        let parameter_count = 1 + rng.below(5);
        let mut properties = Map::new();
        while properties.len() < parameter_count {
            let p = *rng.pick(PARAMETERS);
            properties.insert(
                p.to_owned(),
                json!({"type": "string", "description": format!("The {} to use.", p.replace('_', " "))}),
            );
        }
        let required: Vec<&String> = properties.keys().take(1).collect();
        let mut tags = vec![noun.replace('_', "-"), (*rng.pick(GENERIC_TAGS)).to_owned()];
        if rng.below(2) == 0 {
            tags.push(ns.replace('_', "-"));
        }
        tags.dedup();
        let description = format!(
            "{verbs} {} in {product} {}{}. {} {}",
            plural(&noun_text),
            rng.pick(CONTEXTS),
            if qualifier.is_empty() {
                String::new()
            } else {
                format!(" ({})", qualifier.replace('_', " "))
            },
            format_args!(
                "Works with the related {} as well.",
                plural(&other.replace('_', " "))
            ),
            rng.pick(EXTRA_SENTENCES),
        );
        let function_description = format!(
            "{verbs} a {noun_text} in {product} {}. {}",
            rng.pick(CONTEXTS),
            rng.pick(EXTRA_SENTENCES)
        );
        let definition = json!({
            "schemaVersion": 1,
            "id": format!("{ns}:{name}@1.{}.0", rng.below(5)),
            "implementationKey": format!("{ns}.{name}"),
            "title": format!("{} {noun_text} ({product})", &verbs[..verbs.len() - 1]),
            "description": description,
            "category": category,
            "tags": tags,
            "recommendedThreshold": if rng.below(10) == 0 { json!(0.35) } else { Value::Null },
            "function": {
                "name": function,
                "description": function_description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": required,
                    "additionalProperties": false
                }
            }
        });
        let mut definition = definition;
        if definition["recommendedThreshold"].is_null()
            && let Some(object) = definition.as_object_mut()
        {
            object.remove("recommendedThreshold");
        }
        match serde_json::from_value(definition) {
            Ok(d) => out.push(d),
            Err(e) => panic!("generated an invalid definition: {e}"),
        }
    }
    out
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

struct Timing {
    p50: Duration,
    p99: Duration,
    mean: Duration,
    max: Duration,
}

fn time_runs(runs: usize, mut f: impl FnMut()) -> Timing {
    for _ in 0..runs.div_ceil(10) {
        f(); // warm-up
    }
    let mut samples: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    let total: Duration = samples.iter().sum();
    Timing {
        p50: percentile(&samples, 0.50),
        p99: percentile(&samples, 0.99),
        mean: total / runs as u32,
        max: samples[samples.len() - 1],
    }
}

fn row(case: &str, runs: usize, t: &Timing) {
    println!(
        "{case:<58} {runs:>6} {:>11.1?} {:>11.1?} {:>11.1?} {:>11.1?}",
        t.p50, t.p99, t.mean, t.max
    );
}

/// Bytes and allocations still live since `region` began (requested
/// sizes: the system allocator's own overhead, some 8–16 bytes per live
/// allocation, comes on top). A realloc is counted in both sums already.
fn live(region: &Region<'_, System>) -> (isize, isize) {
    let change = region.change();
    (
        change.bytes_allocated as isize - change.bytes_deallocated as isize,
        change.allocations as isize - change.deallocations as isize,
    )
}

/// Runs of the gating case (each copies 10,000 `Arc`s).
const GATING_RUNS: usize = 200;

/// Every tool live, as the catalog would report them.
struct LiveTools(Vec<SourcedTool>);

impl ToolSource for LiveTools {
    fn name(&self) -> &str {
        "catalog"
    }
    fn tools(&self) -> Vec<SourcedTool> {
        self.0.clone()
    }
}

fn main() {
    // `cargo bench` passes `--bench`; test runners (`cargo test
    // --all-targets`, nextest's `--list`) must not run the measurements.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }

    let definitions = catalog(TOOLS);
    let json_bytes: usize = definitions
        .iter()
        .map(|d| serde_json::to_vec(d).map_or(0, |v| v.len()))
        .sum();

    let region = Region::new(GLOBAL);
    let started = Instant::now();
    let tools: Vec<Arc<CompiledTool>> = definitions
        .into_iter()
        .map(|d| match CompiledTool::new(d) {
            Ok(t) => Arc::new(t),
            Err(e) => panic!("a generated definition does not compile: {e}"),
        })
        .collect();
    let compile_time = started.elapsed();
    let (tools_bytes, tools_allocations) = live(&region);

    let region = Region::new(GLOBAL);
    let started = Instant::now();
    let index = RelevanceIndex::build(&tools);
    let first_build = started.elapsed();
    let (index_bytes, index_allocations) = live(&region);

    let categories = index.categories(|_| true);
    println!(
        "catalog: {} definitions, {} namespaces, {} categories, {} distinct tokens, {:.0} bytes of JSON per definition",
        index.len(),
        NAMESPACES.len(),
        categories.len(),
        index.vocabulary_len(),
        json_bytes as f64 / TOOLS as f64,
    );
    println!(
        "compiling the definitions (CompiledTool::new, once per catalog reading of a new definition): {compile_time:.1?}"
    );
    println!("first index build: {first_build:.1?}");
    println!();
    let per = |bytes: isize| bytes as f64 / TOOLS as f64;
    println!(
        "heap, live: CompiledTools {tools_bytes} B in {tools_allocations} allocations ({:.0} B per definition); \
         index {index_bytes} B in {index_allocations} allocations ({:.0} B per definition); together {:.0} B per definition",
        per(tools_bytes),
        per(index_bytes),
        per(tools_bytes + index_bytes),
    );
    println!();

    let policy = ScopingPolicy::default();
    let candidates: Vec<usize> = (0..index.len()).collect();
    let conversation = vec![
        Message::System {
            content: "You are a helpful assistant with tools.".to_owned(),
        },
        Message::User {
            content: "Can you find the unpaid invoices of our customer Acme in Stripe and \
                      email a short summary to the finance team?"
                .to_owned(),
        },
        Message::Assistant {
            content: Some(
                "I'll look up Acme's open invoices first, then draft the email.".to_owned(),
            ),
            tool_calls: Vec::new(),
            opaque: Vec::new(),
        },
    ];
    let query = scoping::scoring_query(&conversation);
    let broad = "list get create update delete search find the file report for the user";
    let must = [0usize, 1, 2];

    println!(
        "{:<58} {:>6} {:>11} {:>11} {:>11} {:>11}",
        "case", "runs", "p50", "p99", "mean", "max"
    );
    let decision = time_runs(DECISION_RUNS, || {
        let query = scoping::scoring_query(black_box(&conversation));
        black_box(scoping::by_relevance(
            &index,
            &candidates,
            &query,
            &policy,
            &must,
        ));
    });
    row(
        "decision: invoices/email query, 10k candidates",
        DECISION_RUNS,
        &decision,
    );
    let broad_decision = time_runs(DECISION_RUNS, || {
        black_box(scoping::by_relevance(
            &index,
            &candidates,
            black_box(broad),
            &policy,
            &must,
        ));
    });
    row(
        "decision: broad query (common verbs), 10k candidates",
        DECISION_RUNS,
        &broad_decision,
    );
    // The gates a chat job passes first (system, profile `*` and agent
    // tools; purpose, visibleIn, confidence, liveness): over the registry
    // of the same 10,000 live tools.
    let live = LiveTools(
        tools
            .iter()
            .map(|t| SourcedTool {
                tool: t.clone(),
                workers: 1,
                families: vec!["bench".into()],
            })
            .collect(),
    );
    let registry = Registry::build(&[&live as &dyn ToolSource]);
    let profile = toolfleet_config::Profile::new("bench");
    let job = toolfleet_protocol::client::question("find the unpaid invoices");
    let gate = gating::Gate {
        documents: false,
        data_source: false,
        surface: "chat",
        provider_confidence: 0.0,
        agents: true,
        own_profile: "bench",
        tenant: "bench",
        agents_denied: &[],
    };
    let gated = time_runs(GATING_RUNS, || {
        black_box(
            gating::permitted(black_box(&registry), &profile, &job, &gate)
                .map(|p| p.tools.len())
                .unwrap_or_default(),
        );
    });
    row(
        "gating: every gate over 10k live tools",
        GATING_RUNS,
        &gated,
    );
    let half: Vec<usize> = (0..index.len()).step_by(2).collect();
    let half_decision = time_runs(DECISION_RUNS, || {
        black_box(scoping::by_relevance(&index, &half, &query, &policy, &must));
    });
    row(
        "decision: invoices/email query, 5k candidates",
        DECISION_RUNS,
        &half_decision,
    );
    let score_only = time_runs(DECISION_RUNS, || {
        black_box(index.score(black_box(&query), |_| true));
    });
    row(
        "score only (RelevanceIndex::score)",
        DECISION_RUNS,
        &score_only,
    );

    let ranked = index.score(&query, |_| true);
    let listed: Vec<&CompiledTool> = ranked
        .iter()
        .take(scoping::MAX_PLANNING_CANDIDATES)
        .filter_map(|s| index.tool(s.position).map(|t| &**t))
        .collect();
    let planning = time_runs(DECISION_RUNS, || {
        black_box(scoping::planning_messages(
            &conversation,
            &listed,
            &categories,
            &policy,
            None,
        ));
    });
    row(
        "planning prompt (100 candidates, all categories)",
        DECISION_RUNS,
        &planning,
    );
    let planning_prompt_chars: usize =
        scoping::planning_messages(&conversation, &listed, &categories, &policy, None)
            .iter()
            .map(|m| match m {
                Message::System { content } | Message::User { content } => content.len(),
                _ => 0,
            })
            .sum();
    let answer = "```json\n{\"tools\": [\"stripe_list_invoice\", \"gmail_send_email\", \"gmail_create_draft\"], \"categories\": [\"finance\"]}\n```";
    let apply = time_runs(DECISION_RUNS, || {
        let plan = scoping::parse_plan(black_box(answer));
        if let Ok(plan) = plan {
            black_box(scoping::apply_plan(
                &plan,
                &index,
                &candidates,
                &ranked,
                &policy,
                &must,
            ));
        }
    });
    row(
        "parse_plan + apply_plan (3 tools + a category)",
        DECISION_RUNS,
        &apply,
    );

    let build = time_runs(BUILD_RUNS, || {
        black_box(RelevanceIndex::build(black_box(&tools)));
    });
    row(
        "RelevanceIndex::build, 10k definitions (catalog swap)",
        BUILD_RUNS,
        &build,
    );

    let search_phrase = time_runs(SEARCH_RUNS, || {
        black_box(scoping::run_search_tools(
            &json!({"query": "refund"}),
            &tools,
            10,
        ))
        .ok();
    });
    row(
        "search_tools, phrase matches (10k pool)",
        SEARCH_RUNS,
        &search_phrase,
    );
    let search_tokens = time_runs(SEARCH_RUNS, || {
        black_box(scoping::run_search_tools(
            &json!({"query": "refund a payment"}),
            &tools,
            10,
        ))
        .ok();
    });
    row(
        "search_tools, token fallback (10k pool, builds an index)",
        SEARCH_RUNS,
        &search_tokens,
    );
    let search_indexed = time_runs(SEARCH_RUNS, || {
        black_box(scoping::run_search_tools_in(
            &json!({"query": "refund a payment"}),
            &index,
            &candidates,
            10,
        ))
        .ok();
    });
    row(
        "search_tools_in, token fallback (10k pool, snapshot index)",
        SEARCH_RUNS,
        &search_indexed,
    );
    println!();
    println!("planning prompt: {planning_prompt_chars} characters");
    let offered = scoping::by_relevance(&index, &candidates, &query, &policy, &must);
    let names: Vec<&str> = offered
        .chosen
        .iter()
        .filter_map(|&p| index.tool(p))
        .map(|t| t.definition.function.name.as_str())
        .collect();
    println!(
        "offered for the invoices/email query ({} tools, {} left out): {}",
        names.len(),
        offered.left_out,
        names.join(", ")
    );
}
