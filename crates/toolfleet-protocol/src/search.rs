//! Searching tool definitions by a query, with scores.
//!
//! A definition's score is the best of these, compared without regard to
//! case:
//!
//! | match | score |
//! |---|---:|
//! | the query is a name of the tool | 100 |
//! | a name starts with the query | 80 |
//! | a name contains the query | 60 |
//! | the query is one of its tags | 50 |
//! | a tag contains the query | 40 |
//! | its description contains the query | 20 |
//!
//! A tool's names are its id (`ns:name@x.y.z`), the id without its
//! version (`ns:name`), the name part of the id and its function name.
//! Its description is the definition's `description` or its function's.
//! Results are sorted by score, best first; ties keep the order they were
//! given in; tools that match nothing are left out.

use serde::Serialize;

use crate::tools::ToolDefinition;

/// How many results a search returns unless told otherwise.
pub const DEFAULT_LIMIT: usize = 20;

/// Scores of each kind of match (see the module docs).
pub mod scores {
    /// The query is one of the tool's names.
    pub const EXACT_NAME: u32 = 100;
    /// One of the tool's names starts with the query.
    pub const NAME_PREFIX: u32 = 80;
    /// One of the tool's names contains the query.
    pub const NAME_SUBSTRING: u32 = 60;
    /// The query is one of the tool's tags.
    pub const EXACT_TAG: u32 = 50;
    /// One of the tool's tags contains the query.
    pub const TAG_SUBSTRING: u32 = 40;
    /// The tool's description contains the query.
    pub const DESCRIPTION_SUBSTRING: u32 = 20;
}

/// One result: a definition and its score.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Hit<'a> {
    /// How well the definition matches; higher is better (see [`scores`]).
    pub score: u32,
    /// The matching definition.
    pub definition: &'a ToolDefinition,
}

/// `definition`'s score for `query` (0: no match). An empty query matches
/// nothing.
#[must_use]
pub fn score(definition: &ToolDefinition, query: &str) -> u32 {
    let query = query.trim().to_lowercase();
    if query.is_empty() {
        return 0;
    }
    let id = &definition.id;
    let names = [
        id.to_string(),
        format!("{}:{}", id.namespace, id.name),
        id.name.clone(),
        definition.function.name.clone(),
    ]
    .map(|n| n.to_lowercase());
    let tags: Vec<String> = definition.tags.iter().map(|t| t.to_lowercase()).collect();
    let descriptions =
        [&definition.description, &definition.function.description].map(|d| d.to_lowercase());
    [
        (names.contains(&query), scores::EXACT_NAME),
        (
            names.iter().any(|n| n.starts_with(&query)),
            scores::NAME_PREFIX,
        ),
        (
            names.iter().any(|n| n.contains(&query)),
            scores::NAME_SUBSTRING,
        ),
        (tags.contains(&query), scores::EXACT_TAG),
        (
            tags.iter().any(|t| t.contains(&query)),
            scores::TAG_SUBSTRING,
        ),
        (
            descriptions.iter().any(|d| d.contains(&query)),
            scores::DESCRIPTION_SUBSTRING,
        ),
    ]
    .into_iter()
    .find_map(|(matched, score)| matched.then_some(score))
    .unwrap_or(0)
}

/// The definitions matching `query`, best first (stable among equal
/// scores), at most `limit` of them.
pub fn search<'a>(
    definitions: impl IntoIterator<Item = &'a ToolDefinition>,
    query: &str,
    limit: usize,
) -> Vec<Hit<'a>> {
    let mut hits: Vec<Hit<'a>> = definitions
        .into_iter()
        .map(|definition| Hit {
            score: score(definition, query),
            definition,
        })
        .filter(|hit| hit.score > 0)
        .collect();
    // A stable sort: equal scores keep their given order.
    hits.sort_by_key(|hit| std::cmp::Reverse(hit.score));
    hits.truncate(limit);
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn definition(id: &str, function: &str, tags: &[&str], description: &str) -> ToolDefinition {
        let json = serde_json::json!({
            "schemaVersion": 1,
            "id": id,
            "implementationKey": "test.tool",
            "title": "A tool",
            "description": description,
            "category": "utility",
            "tags": tags,
            "function": {
                "name": function,
                "description": "Does its work.",
                "parameters": { "type": "object", "properties": {} }
            }
        });
        serde_json::from_value(json).expect("a valid definition")
    }

    fn weather() -> ToolDefinition {
        definition(
            "web:weather_forecast@1.0.0",
            "weather_forecast",
            &["weather", "forecast-daily"],
            "Tells tomorrow's WEATHER for a city.",
        )
    }

    #[test]
    fn each_kind_of_match_scores_as_documented() {
        let w = weather();
        let cases = [
            ("weather_forecast", 100),
            ("web:weather_forecast", 100),
            ("web:weather_forecast@1.0.0", 100),
            ("WEATHER_FORECAST", 100),
            ("weather_fore", 80),
            ("web:wea", 80),
            ("forecast", 60),
            ("_fore", 60),
            ("daily", 40),
            ("forecast-daily", 50),
            ("tomorrow", 20),
            ("city", 20),
            ("rain", 0),
            ("", 0),
            ("   ", 0),
        ];
        for (query, expected) in cases {
            assert_eq!(score(&w, query), expected, "{query:?}");
        }
        // An exact tag outranks a tag substring but not a name match.
        let tagged = definition("x:clock@1.0.0", "clock", &["time"], "Tells the time.");
        assert_eq!(score(&tagged, "time"), 50);
        assert_eq!(score(&tagged, "tim"), 40);
        assert_eq!(score(&tagged, "clock"), 100);
        assert_eq!(score(&tagged, "the time"), 20);
    }

    #[test]
    fn results_are_sorted_stable_and_limited() {
        let defs = [
            definition("a:first@1.0.0", "first", &[], "about maps"),
            definition("a:map_tiles@1.0.0", "map_tiles", &[], "tiles"),
            definition("a:second@1.0.0", "second", &[], "about maps too"),
            definition("a:map@1.0.0", "map", &[], "the map"),
            definition("a:unrelated@1.0.0", "unrelated", &[], "nothing"),
        ];
        let hits = search(&defs, "map", DEFAULT_LIMIT);
        let got: Vec<(&str, u32)> = hits
            .iter()
            .map(|h| (h.definition.function.name.as_str(), h.score))
            .collect();
        assert_eq!(
            got,
            [
                ("map", 100),
                ("map_tiles", 80),
                ("first", 20),
                ("second", 20)
            ]
        );
        let two = search(&defs, "map", 2);
        assert_eq!(two.len(), 2);
        assert!(search(&defs, "zebra", DEFAULT_LIMIT).is_empty());
    }

    #[test]
    fn the_limit_defaults_to_twenty() {
        let defs: Vec<ToolDefinition> = (0..30)
            .map(|i| definition(&format!("n:tool_{i}@1.0.0"), &format!("tool_{i}"), &[], "x"))
            .collect();
        assert_eq!(search(&defs, "tool", DEFAULT_LIMIT).len(), 20);
        // Stable: equal scores in the order given.
        let hits = search(&defs, "tool", DEFAULT_LIMIT);
        assert_eq!(hits[0].definition.function.name, "tool_0");
        assert_eq!(hits[19].definition.function.name, "tool_19");
    }
}
