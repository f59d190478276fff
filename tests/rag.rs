//! Preemptive retrieval and the citation pipeline end to end: the
//! orchestrator searches the job's attachments and data source through the
//! retrieval pool before the first model call, its citations share the
//! invocation's counter with the tools' own, the in-scope directive, link
//! resolution, and `completed` carrying only what the answer cites.

use serde_json::{Value, json};
use toolfleet_protocol::{ChatEventBody, ChatJob};

use crate::support::{Env, Options};

fn profile(extra: &str) -> String {
    format!(
        r#"
default_profile = "default"
[links]
data_source = "https://wiki.example.com/{{source}}"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
{extra}
"#
    )
}

/// The messages of `role` in the model's first request.
fn first_request(env: &Env, role: &str) -> Vec<String> {
    let requests = env.model.requests();
    requests[0]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == role)
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn announced(events: &[toolfleet_protocol::ChatEvent]) -> Vec<(u64, String, Option<String>)> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::References { references } => Some(references.clone()),
            _ => None,
        })
        .flatten()
        .map(|r| (r.index, r.kind, r.source))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptive_passages_share_the_counter_with_tool_references_in_one_answer() {
    // The model cites a prefetched passage ([doc:1]) and then what its own
    // search returned, whose markers must come after the prefetched ones.
    let script = json!({
        "rules": [{ "whenUserContains": ["lighthouse"], "steps": [
            { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "fog signal horn", "topK": 2 } } ] },
            { "answer": "From before: [doc:1]. Searched: {{tool:search_data_sources}}" }
        ] }]
    });
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(profile(
                "data_source = \"handbook\"\n[profiles.default.rag]\ntop_k = 3",
            )),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How does a lighthouse warn ships?").await;
    let outcome = outcome.expect("completed");

    // The prefetch ran first, as a tool job of the data source's search.
    let calls: Vec<String> = outcome
        .events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolCall { tool, .. } => Some(tool.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        calls,
        [
            "retrieval:search_data_sources@1.0.0",
            "retrieval:search_data_sources@1.0.0"
        ]
    );
    // Its passages were in the first request, with their markers.
    // Document text never gets the system role.
    assert!(
        !first_request(&env, "system")
            .iter()
            .any(|m| m.contains("From the data source:"))
    );
    let user = first_request(&env, "user");
    let passages = user
        .iter()
        .find(|m| m.contains("From the data source:"))
        .expect("the passages message");
    assert!(
        passages.contains("[doc:1]") && passages.contains("[doc:3]"),
        "{passages}"
    );
    assert!(!passages.contains("[doc:4]"), "top_k is 3: {passages}");

    // One counter: 1..3 prefetched, then 4..5 from the model's search,
    // never an index twice; data-source references carry their links.
    let refs = announced(&outcome.events);
    let indices: Vec<u64> = refs.iter().map(|r| r.0).collect();
    assert_eq!(indices, [1, 2, 3, 4, 5], "{refs:?}");
    for (_, kind, _) in &refs {
        assert_eq!(kind, "data_source");
    }

    // `completed` carries only the cited ones, renumbered 1..k in text and
    // list alike, with links.
    let cited_by_model = toolfleet_protocol::references::cited_indices(&outcome.text);
    let distinct: std::collections::BTreeSet<u64> = cited_by_model.iter().copied().collect();
    assert_eq!(
        distinct.iter().copied().collect::<Vec<_>>(),
        (1..=outcome.references.len() as u64).collect::<Vec<_>>(),
        "{}",
        outcome.text
    );
    assert_eq!(
        outcome.references.len(),
        3,
        "[doc:1] and the two searched: {:?}",
        outcome.references
    );
    assert!(
        outcome
            .text
            .starts_with("From before: [doc:1]. Searched: [doc:2]"),
        "{}",
        outcome.text
    );
    let first = &outcome.references[0];
    let source = first.source.as_deref().unwrap();
    assert_eq!(
        first.url.as_deref(),
        Some(format!("https://wiki.example.com/{source}").as_str())
    );
    assert_eq!(outcome.references[1].index, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_documents_are_prefetched_alone_and_uploads_get_no_link() {
    let script = json!({
        "default": { "steps": [ { "answer": "Bees: [doc:1]" } ] }
    });
    // No data source: only the attachment is searched.
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(profile("")),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let job = ChatJob {
        attached_documents: vec!["handbook:honeybees.md".into()],
        ..toolfleet_protocol::client::question("How do bees and lighthouses signal?")
    };
    let outcome = env.submit(&job).await.expect("completed");
    let refs = announced(&outcome.events);
    assert!(!refs.is_empty());
    for (_, kind, source) in &refs {
        assert_eq!(kind, "document");
        // The planted neighbour (lighthouses.md matches the question too)
        // is never found: only the attachment is searched.
        assert_eq!(source.as_deref(), Some("honeybees.md"));
    }
    assert_eq!(outcome.references.len(), 1);
    assert_eq!(outcome.references[0].url, None, "uploads have no link");
    assert!(
        first_request(&env, "user")
            .iter()
            .any(|m| m.contains("From the attached documents:"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_scope_profile_that_finds_nothing_tells_the_model_to_search() {
    let script = json!({
        "default": { "steps": [ { "answer": "Nothing in the handbook." } ] }
    });
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(profile(
                "data_source = \"handbook\"\n[profiles.default.rag]\nin_scope_only = true",
            )),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("zyxwv qwertz plorbs").await;
    let outcome = outcome.expect("completed");
    assert!(announced(&outcome.events).is_empty());
    let system = first_request(&env, "system");
    let directive = system
        .iter()
        .find(|m| m.starts_with("A search of the data source"))
        .unwrap_or_else(|| panic!("no directive in {system:#?}"));
    assert!(directive.contains("(search_data_sources)"), "{directive}");
    // The directive stands right before the question.
    let requests = env.model.requests();
    let messages = requests[0]["messages"].as_array().unwrap();
    let at = messages.len() - 1;
    assert_eq!(messages[at]["role"], "user");
    assert_eq!(
        messages[at - 1]["content"],
        Value::String(directive.clone())
    );

    // Without in_scope_only, nothing is added when nothing is found.
    let env = Env::start_with(
        json!({ "default": { "steps": [ { "answer": "ok" } ] } }),
        Options {
            profiles_toml: Some(profile("data_source = \"handbook\"")),
            ..Default::default()
        },
    )
    .await;
    env.ask("zyxwv qwertz plorbs").await.1.expect("completed");
    assert_eq!(
        first_request(&env, "system").len(),
        1,
        "only the system prompt"
    );
    assert_eq!(first_request(&env, "user").len(), 1, "only the question");
}
