//! The context model: what the retrieval index holds and filters on.
//!
//! Everything searchable is an [`Item`]: a chunk of an ingested document, a
//! piece of knowledge, an event, an entity or a profile. Each item belongs to
//! a collection (a data source, or a chat's uploaded documents), has owner
//! ids (user, device, agent), timestamps and the entities it mentions.
//! Events also sit in a hierarchy: level L0 is what happened, L1–L3 are
//! summaries over a day, a week and a month, linked down to the items they
//! summarise by [`Item::child_ids`]; every event knows its day, week and
//! month [`Buckets`] so a time range maps to the summaries that cover it.
//!
//! The types serialise in camelCase, the shape of `toolfleet ingest`'s JSON
//! Lines input for context items and of the index's stored payload.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// What an item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemKind {
    /// A chunk of an ingested document.
    Document,
    /// A fact or note worth recalling.
    Knowledge,
    /// Something that happened (L0), or a summary of a period (L1–L3).
    Event,
    /// A person, place, organisation or thing, with relationships.
    Entity,
    /// What is known about a user, device or agent.
    Profile,
}

impl ItemKind {
    /// Every kind, in a fixed order.
    pub const ALL: [ItemKind; 5] = [
        ItemKind::Document,
        ItemKind::Knowledge,
        ItemKind::Event,
        ItemKind::Entity,
        ItemKind::Profile,
    ];

    /// The name used on the wire and in the index.
    pub fn as_str(self) -> &'static str {
        match self {
            ItemKind::Document => "document",
            ItemKind::Knowledge => "knowledge",
            ItemKind::Event => "event",
            ItemKind::Entity => "entity",
            ItemKind::Profile => "profile",
        }
    }
}

/// Who an item belongs to. Any of the three may be absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Owner {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
}

impl Owner {
    /// Does an item owned by `self` pass the filter `wanted`? Every id the
    /// filter names must be the item's.
    pub fn matches(&self, wanted: &Owner) -> bool {
        fn ok(have: &Option<String>, want: &Option<String>) -> bool {
            want.as_ref().is_none_or(|w| have.as_ref() == Some(w))
        }
        ok(&self.user, &wanted.user)
            && ok(&self.device, &wanted.device)
            && ok(&self.agent, &wanted.agent)
    }
}

/// An event's level in the hierarchy: L0 raw events, L1 daily, L2 weekly
/// and L3 monthly summaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Level {
    L0,
    L1,
    L2,
    L3,
}

impl Level {
    /// 0 to 3.
    pub fn number(self) -> u8 {
        match self {
            Level::L0 => 0,
            Level::L1 => 1,
            Level::L2 => 2,
            Level::L3 => 3,
        }
    }

    /// The level numbered `n`, if any.
    pub fn from_number(n: u8) -> Option<Level> {
        match n {
            0 => Some(Level::L0),
            1 => Some(Level::L1),
            2 => Some(Level::L2),
            3 => Some(Level::L3),
            _ => None,
        }
    }
}

/// The day, ISO week and month an instant falls in (UTC), as stable keys:
/// `2026-11-24`, `2026-W48`, `2026-11`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Buckets {
    pub day: String,
    pub week: String,
    pub month: String,
}

impl Buckets {
    /// The buckets of the instant `ms` milliseconds after the Unix epoch;
    /// `None` outside the range `time` represents.
    pub fn of_ms(ms: i64) -> Option<Buckets> {
        let at = OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()?;
        let (iso_year, week, _) = at.to_iso_week_date();
        Some(Buckets {
            day: format!(
                "{:04}-{:02}-{:02}",
                at.year(),
                u8::from(at.month()),
                at.day()
            ),
            week: format!("{iso_year:04}-W{week:02}"),
            month: format!("{:04}-{:02}", at.year(), u8::from(at.month())),
        })
    }

    /// The bucket key of `level` (day for L1, week for L2, month for L3;
    /// the day for L0).
    pub fn key(&self, level: Level) -> &str {
        match level {
            Level::L0 | Level::L1 => &self.day,
            Level::L2 => &self.week,
            Level::L3 => &self.month,
        }
    }

    /// Every bucket key of `level` that the range `[from_ms, to_ms]`
    /// touches, in order, at most `limit` of them (a range of years asks
    /// for thousands of days). Empty when the range is inverted.
    pub fn keys_in_range(level: Level, from_ms: i64, to_ms: i64, limit: usize) -> Vec<String> {
        const DAY_MS: i64 = 86_400_000;
        let mut keys: Vec<String> = Vec::new();
        if from_ms > to_ms {
            return keys;
        }
        // Walk day by day: each day belongs to exactly one week and month,
        // so consecutive duplicates are the only repeats.
        let mut at = from_ms;
        loop {
            if let Some(b) = Buckets::of_ms(at) {
                let key = b.key(level);
                if keys.last().map(String::as_str) != Some(key) {
                    if keys.len() == limit {
                        break;
                    }
                    keys.push(key.to_owned());
                }
            }
            if at >= to_ms {
                break;
            }
            // The last step lands on the range's end, so its bucket counts.
            at = at.saturating_add(DAY_MS).min(to_ms);
        }
        keys
    }
}

/// A named relationship from an entity to another (`works_at` → `acme`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Relation {
    /// What the relationship is, e.g. `works_at`.
    pub kind: String,
    /// The other entity's name.
    pub target: String,
}

/// One searchable thing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Item {
    /// Unique across the index; a document chunk's is `<document id>#<n>`.
    pub id: String,
    pub kind: ItemKind,
    /// The data source or upload collection it belongs to.
    pub collection: String,
    /// The document a chunk comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
    /// A chunk's position in its document, from 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<u32>,
    pub title: String,
    pub text: String,
    /// Where it came from (a path relative to the ingested root, a system).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default)]
    pub owner: Owner,
    /// When it happened or was last changed (Unix ms): what time ranges
    /// filter on.
    pub timestamp_ms: i64,
    /// When it entered the index (Unix ms).
    #[serde(default)]
    pub ingested_ms: i64,
    /// Entity names it mentions, as written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entities: Vec<String>,
    /// An event's level (events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<Level>,
    /// The items an L1–L3 summary covers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub child_ids: Vec<String>,
    /// An entity's other names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// An entity's relationships.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub relations: Vec<Relation>,
    /// The item's embedding (title and text), when an embeddings endpoint
    /// is configured or the item came with one: what vector search ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
}

/// Why an item cannot go into the index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    #[error("item id must be 1 to {MAX_ID_CHARS} characters without control characters")]
    BadId,
    #[error(
        "item {0}: the collection must be 1 to {MAX_ID_CHARS} characters without control characters"
    )]
    BadCollection(String),
    #[error("item {0}: only events have a level")]
    LevelOnNonEvent(String),
    #[error("item {0}: an event needs a level (L0 to L3)")]
    EventWithoutLevel(String),
    #[error("item {0}: an L0 event has no children; only L1 to L3 summaries do")]
    ChildrenOnL0(String),
    #[error("item {0}: the timestamp is outside the years 1 to 9999")]
    BadTimestamp(String),
    #[error("item {0}: aliases and relations belong to entities")]
    EntityFieldsOnNonEntity(String),
}

/// The longest id, collection or owner id.
pub const MAX_ID_CHARS: usize = 512;

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.chars().count() <= MAX_ID_CHARS && !id.chars().any(char::is_control)
}

impl Item {
    /// Checks the item's shape: ids, levels only on events, children only on
    /// summaries, entity fields only on entities, a representable time.
    ///
    /// # Errors
    ///
    /// The first rule the item breaks.
    pub fn validate(&self) -> Result<(), ItemError> {
        if !valid_id(&self.id) {
            return Err(ItemError::BadId);
        }
        let id = || self.id.clone();
        if !valid_id(&self.collection) {
            return Err(ItemError::BadCollection(id()));
        }
        match (self.kind, self.level) {
            (ItemKind::Event, None) => return Err(ItemError::EventWithoutLevel(id())),
            (ItemKind::Event, Some(Level::L0)) if !self.child_ids.is_empty() => {
                return Err(ItemError::ChildrenOnL0(id()));
            }
            (ItemKind::Event, Some(_)) => {}
            (_, Some(_)) => return Err(ItemError::LevelOnNonEvent(id())),
            (_, None) => {}
        }
        if self.kind != ItemKind::Entity && (!self.aliases.is_empty() || !self.relations.is_empty())
        {
            return Err(ItemError::EntityFieldsOnNonEntity(id()));
        }
        if Buckets::of_ms(self.timestamp_ms).is_none() {
            return Err(ItemError::BadTimestamp(id()));
        }
        Ok(())
    }

    /// The day, week and month of the item's timestamp.
    pub fn buckets(&self) -> Option<Buckets> {
        Buckets::of_ms(self.timestamp_ms)
    }
}

/// Normalises an entity name for comparison: case folded, accents and
/// punctuation dropped, whitespace collapsed (`"  Zoë  O'Brien "` →
/// `"zoe obrien"`).
pub fn normalize_entity(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut space = false;
    for c in name.chars() {
        let c = fold_accent(c);
        if c.is_alphanumeric() {
            if space && !out.is_empty() {
                out.push(' ');
            }
            space = false;
            out.extend(c.to_lowercase());
        } else if c.is_whitespace() || c == '-' || c == '_' || c == '.' {
            space = true;
        }
        // Other punctuation (apostrophes, quotes) joins what it separates.
    }
    out
}

/// The base letter of common Latin letters with diacritics.
fn fold_accent(c: char) -> char {
    match c {
        'à' | 'á' | 'â' | 'ã' | 'ä' | 'å' => 'a',
        'À' | 'Á' | 'Â' | 'Ã' | 'Ä' | 'Å' => 'A',
        'ç' => 'c',
        'Ç' => 'C',
        'è' | 'é' | 'ê' | 'ë' => 'e',
        'È' | 'É' | 'Ê' | 'Ë' => 'E',
        'ì' | 'í' | 'î' | 'ï' => 'i',
        'Ì' | 'Í' | 'Î' | 'Ï' => 'I',
        'ñ' => 'n',
        'Ñ' => 'N',
        'ò' | 'ó' | 'ô' | 'õ' | 'ö' | 'ø' => 'o',
        'Ò' | 'Ó' | 'Ô' | 'Õ' | 'Ö' | 'Ø' => 'O',
        'ù' | 'ú' | 'û' | 'ü' => 'u',
        'Ù' | 'Ú' | 'Û' | 'Ü' => 'U',
        'ý' | 'ÿ' => 'y',
        'Ý' => 'Y',
        c => c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// 2026-11-24T12:00:00Z.
    const NOV_24: i64 = 1_795_521_600_000;

    fn event(id: &str, level: Option<Level>) -> Item {
        Item {
            id: id.into(),
            kind: ItemKind::Event,
            collection: "c".into(),
            document_id: None,
            chunk: None,
            title: "t".into(),
            text: "x".into(),
            source: None,
            owner: Owner::default(),
            timestamp_ms: NOV_24,
            ingested_ms: 0,
            entities: vec![],
            level,
            child_ids: vec![],
            aliases: vec![],
            relations: vec![],
            embedding: None,
        }
    }

    #[test]
    fn buckets_name_the_day_iso_week_and_month() {
        let b = Buckets::of_ms(NOV_24).unwrap();
        assert_eq!(b.day, "2026-11-24");
        assert_eq!(b.week, "2026-W48");
        assert_eq!(b.month, "2026-11");
        // 2027-01-01 is a Friday: ISO week 53 of 2026.
        let b = Buckets::of_ms(1_798_761_600_000).unwrap();
        assert_eq!(
            (b.day.as_str(), b.week.as_str()),
            ("2027-01-01", "2026-W53")
        );
        assert_eq!(b.month, "2027-01");
        assert_eq!(b.key(Level::L2), "2026-W53");
        assert!(Buckets::of_ms(i64::MAX).is_none());
    }

    #[test]
    fn a_range_maps_to_the_buckets_it_touches() {
        const DAY: i64 = 86_400_000;
        // Nov 24 (Tue) to Dec 2 (Wed): 9 days, weeks 48 and 49, two months.
        let to = NOV_24 + 8 * DAY;
        let days = Buckets::keys_in_range(Level::L1, NOV_24, to, 100);
        assert_eq!(days.len(), 9);
        assert_eq!(days.first().unwrap(), "2026-11-24");
        assert_eq!(days.last().unwrap(), "2026-12-02");
        assert_eq!(
            Buckets::keys_in_range(Level::L2, NOV_24, to, 100),
            ["2026-W48", "2026-W49"]
        );
        assert_eq!(
            Buckets::keys_in_range(Level::L3, NOV_24, to, 100),
            ["2026-11", "2026-12"]
        );
        // A range ending early on a later day still includes that day.
        assert_eq!(
            Buckets::keys_in_range(Level::L1, NOV_24, NOV_24 + DAY / 2 + 1, 100),
            ["2026-11-24", "2026-11-25"]
        );
        assert_eq!(Buckets::keys_in_range(Level::L1, NOV_24, to, 3).len(), 3);
        assert!(Buckets::keys_in_range(Level::L1, to, NOV_24, 100).is_empty());
    }

    #[test]
    fn items_keep_their_shape_rules() {
        assert_eq!(event("e", Some(Level::L0)).validate(), Ok(()));
        assert_eq!(
            event("e", None).validate(),
            Err(ItemError::EventWithoutLevel("e".into()))
        );
        let mut l0 = event("e", Some(Level::L0));
        l0.child_ids = vec!["x".into()];
        assert_eq!(l0.validate(), Err(ItemError::ChildrenOnL0("e".into())));
        let mut l1 = l0.clone();
        l1.level = Some(Level::L1);
        assert_eq!(l1.validate(), Ok(()));
        let mut knowledge = event("k", Some(Level::L1));
        knowledge.kind = ItemKind::Knowledge;
        assert_eq!(
            knowledge.validate(),
            Err(ItemError::LevelOnNonEvent("k".into()))
        );
        knowledge.level = None;
        knowledge.aliases = vec!["a".into()];
        assert_eq!(
            knowledge.validate(),
            Err(ItemError::EntityFieldsOnNonEntity("k".into()))
        );
        let mut bad = event("", Some(Level::L0));
        assert_eq!(bad.validate(), Err(ItemError::BadId));
        bad.id = "ok".into();
        bad.collection = "a\nb".into();
        assert_eq!(bad.validate(), Err(ItemError::BadCollection("ok".into())));
        bad.collection = "c".into();
        bad.timestamp_ms = i64::MIN;
        assert_eq!(bad.validate(), Err(ItemError::BadTimestamp("ok".into())));
    }

    #[test]
    fn items_read_from_camel_case_json_and_refuse_unknown_fields() {
        let item: Item = serde_json::from_value(json!({
            "id": "ev-1", "kind": "event", "collection": "life", "title": "Dentist",
            "text": "Check-up at the dentist", "timestampMs": NOV_24, "level": "L0",
            "owner": {"user": "u1", "device": "phone"}, "entities": ["Dr. Ada"]
        }))
        .unwrap();
        assert_eq!(item.level, Some(Level::L0));
        assert_eq!(item.owner.user.as_deref(), Some("u1"));
        let error = serde_json::from_value::<Item>(json!({
            "id": "x", "kind": "event", "collection": "c", "title": "t", "text": "t",
            "timestampMs": 0, "colour": "red"
        }))
        .unwrap_err();
        assert!(error.to_string().contains("colour"), "{error}");
        assert!(serde_json::from_value::<Item>(json!({"id": "x", "kind": "memo"})).is_err());
    }

    #[test]
    fn owner_filters_need_every_named_id() {
        let owner = Owner {
            user: Some("u1".into()),
            device: Some("d1".into()),
            agent: None,
        };
        assert!(owner.matches(&Owner::default()));
        assert!(owner.matches(&Owner {
            user: Some("u1".into()),
            ..Owner::default()
        }));
        assert!(!owner.matches(&Owner {
            user: Some("u2".into()),
            ..Owner::default()
        }));
        assert!(!owner.matches(&Owner {
            agent: Some("a".into()),
            ..Owner::default()
        }));
    }

    #[test]
    fn entity_names_normalise_case_accents_and_punctuation() {
        assert_eq!(normalize_entity("  Zoë  O'Brien "), "zoe obrien");
        assert_eq!(normalize_entity("ACME-Corp."), "acme corp");
        assert_eq!(normalize_entity("Dr. Ada"), "dr ada");
        assert_eq!(normalize_entity("東京"), "東京");
        assert_eq!(normalize_entity("!!!"), "");
    }

    /// `schemas/context_item.schema.json`, what a client in another
    /// language writes JSON Lines from, agrees with `Item`: its examples
    /// load and validate, and what it refuses `Item` refuses too.
    #[test]
    fn the_context_item_schema_and_the_item_type_agree() {
        use toolfleet_worker::protocol::schema::Validator;
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../../schemas/context_item.schema.json"))
                .unwrap();
        let validator = Validator::compile(&schema).unwrap();
        for example in schema["examples"].as_array().unwrap() {
            assert!(validator.is_valid(example), "{example}");
            let item: Item = serde_json::from_value(example.clone()).unwrap();
            item.validate().unwrap();
        }
        let base = schema["examples"][0].clone();
        let with = |key: &str, value: serde_json::Value| {
            let mut v = base.clone();
            v[key] = value;
            v
        };
        let mut event_without_level = base.clone();
        event_without_level["kind"] = "event".into();
        for bad in [
            with("colour", "red".into()),
            with("level", "L1".into()),
            with("aliases", serde_json::json!(["x"])),
            with("kind", "document".into()),
            event_without_level,
        ] {
            assert!(!validator.is_valid(&bad), "the schema took {bad}");
            let refused = serde_json::from_value::<Item>(bad.clone())
                .map_err(|e| e.to_string())
                .and_then(|item| {
                    if item.kind == ItemKind::Document {
                        return Err("documents come from files".into());
                    }
                    item.validate().map_err(|e| e.to_string())
                });
            assert!(refused.is_err(), "Item took {bad}");
        }
    }
}
