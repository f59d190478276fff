//! The suite every [`Store`] backend passes (tantivy on disk, PostgreSQL on
//! a real server): the same calls, the same answers.

#![cfg(test)]

use crate::model::{Item, ItemKind, Level, Owner};
use crate::search::{Query, TimeRange};
use crate::store::{DocumentRecord, Store, StoreError};

pub(crate) fn chunk(doc: &str, n: u32, text: &str) -> Item {
    Item {
        id: format!("{doc}#{n}"),
        kind: ItemKind::Document,
        collection: "ds".into(),
        document_id: Some(doc.into()),
        chunk: Some(n),
        title: "Bees".into(),
        text: text.into(),
        source: Some("bees.md".into()),
        owner: Owner::default(),
        timestamp_ms: 1_000,
        ingested_ms: 1_000,
        entities: vec![],
        level: None,
        child_ids: vec![],
        aliases: vec![],
        relations: vec![],
        embedding: None,
    }
}

pub(crate) fn record(id: &str, collection: &str) -> DocumentRecord {
    DocumentRecord {
        id: id.into(),
        collection: collection.into(),
        title: "Bees".into(),
        source: "bees.md".into(),
        format: "markdown".into(),
        owner: Owner::default(),
        text: "t".into(),
        raw: None,
        timestamp_ms: 1_000,
        ingested_ms: 1_000,
        chunks: 1,
        tokens: 1,
    }
}

/// The tenant the suites write and read as.
pub(crate) const TENANT: &str = "acme";

pub(crate) fn query(text: &str) -> Query {
    Query {
        tenant: TENANT.into(),
        text: text.into(),
        top_k: 10,
        ..Query::default()
    }
}

pub(crate) async fn documents(store: &dyn Store) {
    store
        .replace_document(
            TENANT,
            record("ds:bees.md", "ds"),
            vec![
                chunk("ds:bees.md", 0, "Bees dance to tell where nectar is."),
                chunk("ds:bees.md", 1, "Hives keep a queen."),
            ],
        )
        .await
        .unwrap();
    let hits = store.search(&query("nectar dance")).await.unwrap();
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].item.id, "ds:bees.md#0");

    // Re-ingested: the old chunks are gone in the same commit.
    store
        .replace_document(
            TENANT,
            record("ds:bees.md", "ds"),
            vec![chunk("ds:bees.md", 0, "Wasps build paper nests.")],
        )
        .await
        .unwrap();
    assert!(store.search(&query("nectar")).await.unwrap().is_empty());
    assert!(store.search(&query("queen")).await.unwrap().is_empty());
    assert_eq!(store.search(&query("paper")).await.unwrap().len(), 1);

    // Scope filters really filter.
    let mut scoped = query("paper");
    scoped.collections = vec!["other".into()];
    assert!(store.search(&scoped).await.unwrap().is_empty());
    scoped.collections.clear();
    scoped.documents = vec!["ds:elsewhere.md".into()];
    assert!(store.search(&scoped).await.unwrap().is_empty());
    scoped.documents = vec!["ds:bees.md".into()];
    assert_eq!(store.search(&scoped).await.unwrap().len(), 1);
    scoped.time = TimeRange {
        from_ms: Some(1_001),
        to_ms: None,
    };
    assert!(store.search(&scoped).await.unwrap().is_empty());

    // Only stop words: an empty result, not an error.
    assert!(store.search(&query("the and of")).await.unwrap().is_empty());

    let listed = store
        .list_documents(TENANT, &["ds".into()], &[], 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, "ds:bees.md");
    assert!(
        store
            .list_documents(TENANT, &["x".into()], &[], 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store
            .document(TENANT, "ds:bees.md")
            .await
            .unwrap()
            .unwrap()
            .collection,
        "ds"
    );
    assert!(store.document(TENANT, "ds:none").await.unwrap().is_none());
}

pub(crate) async fn context_items(store: &dyn Store) {
    let mut l0 = chunk("x", 0, "Lunch with Ada at the harbour.");
    l0.id = "ev-1".into();
    l0.kind = ItemKind::Event;
    l0.document_id = None;
    l0.chunk = None;
    l0.level = Some(Level::L0);
    l0.timestamp_ms = 1_795_521_600_000;
    l0.entities = vec!["Ada Lovelace".into()];
    l0.owner.user = Some("u1".into());
    let mut l1 = l0.clone();
    l1.id = "day-1".into();
    l1.level = Some(Level::L1);
    l1.child_ids = vec!["ev-1".into()];
    l1.text = "A day at the harbour.".into();
    store.upsert_items(TENANT, vec![l0, l1]).await.unwrap();

    let mut q = query("harbour");
    q.levels = vec![Level::L1];
    q.buckets = vec!["2026-11-24".into()];
    let hits = store.search(&q).await.unwrap();
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].item.id, "day-1");
    q.buckets = vec!["2026-11-25".into()];
    assert!(store.search(&q).await.unwrap().is_empty());

    let mut q = query("");
    q.entities = vec!["ada   LOVELACE".into()];
    q.levels = vec![Level::L0];
    assert_eq!(store.search(&q).await.unwrap().len(), 1);
    q.owner.user = Some("u2".into());
    assert!(store.search(&q).await.unwrap().is_empty());
    q.owner.user = Some("u1".into());
    q.entities = vec!["Grace Hopper".into()];
    assert!(store.search(&q).await.unwrap().is_empty());

    // A chunk cannot come in as a context item.
    let error = store
        .upsert_items(TENANT, vec![chunk("d", 0, "x")])
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Invalid(_)), "{error}");
}

/// Vector search: cosine ranking among items that have an embedding, the
/// filters still filtering, items without one left out, and a stored
/// embedding never handed back in a hit.
pub(crate) async fn vectors(store: &dyn Store) {
    let mut items = Vec::new();
    for (id, vector, collection) in [
        ("near", vec![1.0, 0.1, 0.0], "ds"),
        ("middle", vec![0.6, 0.8, 0.0], "ds"),
        ("far", vec![0.0, 0.0, 1.0], "ds"),
        ("elsewhere", vec![1.0, 0.0, 0.0], "other"),
        // Neither compares with a 3-dimensional query: left out.
        ("longer", vec![1.0, 0.0, 0.0, 0.0], "ds"),
        ("zero", vec![0.0, 0.0, 0.0], "ds"),
    ] {
        let mut item = chunk("v", 0, "vector item");
        item.id = id.into();
        item.kind = ItemKind::Knowledge;
        item.document_id = None;
        item.chunk = None;
        item.collection = collection.into();
        item.embedding = Some(vector);
        items.push(item);
    }
    let mut plain = chunk("v", 0, "no vector");
    plain.id = "plain".into();
    plain.kind = ItemKind::Knowledge;
    plain.document_id = None;
    plain.chunk = None;
    items.push(plain);
    store.upsert_items(TENANT, items).await.unwrap();
    let query = Query {
        tenant: TENANT.into(),
        vector: Some(vec![1.0, 0.0, 0.0]),
        collections: vec!["ds".into()],
        top_k: 10,
        ..Query::default()
    };
    let hits = store.search(&query).await.unwrap();
    let ids: Vec<&str> = hits.iter().map(|h| h.item.id.as_str()).collect();
    assert_eq!(
        ids,
        ["near", "middle", "far"],
        "{} backend",
        store.backend()
    );
    assert!((hits[0].score - 0.995).abs() < 0.01, "{}", hits[0].score);
    assert!(hits.iter().all(|h| h.item.embedding.is_none()));
    let top = store
        .search(&Query {
            top_k: 1,
            ..query.clone()
        })
        .await
        .unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!(top[0].item.id, "near");
    // A query of another dimension finds only its own kind; a zero query
    // has no direction and finds nothing.
    let longer = store
        .search(&Query {
            vector: Some(vec![1.0, 0.0, 0.0, 0.0]),
            ..query.clone()
        })
        .await
        .unwrap();
    let ids: Vec<&str> = longer.iter().map(|h| h.item.id.as_str()).collect();
    assert_eq!(ids, ["longer"], "{} backend", store.backend());
    assert!((longer[0].score - 1.0).abs() < 1e-4, "{}", longer[0].score);
    for nothing in [vec![0.0, 0.0, 0.0], vec![]] {
        let hits = store
            .search(&Query {
                vector: Some(nothing),
                ..query.clone()
            })
            .await
            .unwrap();
        assert!(hits.is_empty(), "{} backend", store.backend());
    }

    later_of_the_same_id_wins(store).await;
}

/// The same id twice in one batch: the later one wins.
async fn later_of_the_same_id_wins(store: &dyn Store) {
    let mut first = chunk("v", 0, "first version");
    first.id = "twice".into();
    first.kind = ItemKind::Knowledge;
    first.document_id = None;
    first.chunk = None;
    first.entities = vec!["Zoë".into()];
    let mut second = first.clone();
    second.text = "second version".into();
    store
        .upsert_items(TENANT, vec![first, second])
        .await
        .unwrap();
    let hits = store
        .search(&Query {
            tenant: TENANT.into(),
            ids: vec!["twice".into()],
            entities: vec!["zoe".into()],
            top_k: 5,
            ..Query::default()
        })
        .await
        .unwrap();
    assert_eq!(hits.len(), 1, "{} backend", store.backend());
    assert_eq!(hits[0].item.text, "second version");
}

/// Tenants: two tenants with the same ids (a data source, a document, a
/// user's knowledge, an entity, vectors) never see, replace or delete each
/// other's, whatever the query's other filters name; a read or write
/// without a valid tenant is refused, never widened.
pub(crate) async fn tenants(store: &dyn Store) {
    seed_two_tenants(store).await;
    let texts = |hits: Vec<crate::search::Hit>| -> Vec<String> {
        hits.into_iter().map(|h| h.item.text).collect()
    };
    // acme names globex's data source, document, user and words: its own
    // alone, never the canary.
    let mut q = query("vault code");
    q.collections = vec!["kb".into()];
    q.documents = vec!["kb:secret.md".into()];
    assert_eq!(
        texts(store.search(&q).await.unwrap()),
        ["The vault code acmeword."],
        "{} backend",
        store.backend()
    );
    let mut bob = query("");
    bob.owner.user = Some("bob".into());
    bob.kinds = vec![ItemKind::Knowledge];
    bob.ids = vec!["bob-1".into()];
    assert_eq!(
        texts(store.search(&bob).await.unwrap()),
        ["Bob likes acmeword tea."]
    );
    bob.vector = Some(vec![1.0, 0.0]);
    assert_eq!(
        texts(store.search(&bob).await.unwrap()),
        ["Bob likes acmeword tea."],
        "{} backend: vectors",
        store.backend()
    );
    let mut as_globex = query(CANARY);
    as_globex.tenant = "globex".into();
    let mut theirs = texts(store.search(&as_globex).await.unwrap());
    theirs.sort();
    assert_eq!(
        theirs,
        [
            format!("Bob likes {CANARY} tea."),
            format!("The new vault code {CANARY}.")
        ]
    );
    let listed = store
        .list_documents("acme", &["kb".into()], &["kb:secret.md".into()], 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    let found = store
        .document("acme", "kb:secret.md")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, "kb:secret.md");
    assert!(
        store
            .document("initech", "kb:secret.md")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .list_documents("initech", &[], &[], 10)
            .await
            .unwrap()
            .is_empty()
    );
    let mut none = query(CANARY);
    none.tenant = "initech".into();
    assert!(store.search(&none).await.unwrap().is_empty());
    let tenants = store.tenants().await.unwrap();
    assert!(
        tenants.contains(&"acme".to_owned()) && tenants.contains(&"globex".to_owned()),
        "{tenants:?}"
    );

    refuses_a_missing_or_malformed_tenant(store).await;
}

/// The canary of tenant globex in [`tenants`].
const CANARY: &str = "globexcanary";

/// globex and acme store a document, a user's knowledge and vectors under
/// the same ids; then globex re-ingests its document.
async fn seed_two_tenants(store: &dyn Store) {
    let in_kb = |mut chunk: Item| {
        chunk.collection = "kb".into();
        chunk
    };
    for (tenant, word) in [("globex", CANARY), ("acme", "acmeword")] {
        store
            .replace_document(
                tenant,
                record("kb:secret.md", "kb"),
                vec![in_kb(chunk(
                    "kb:secret.md",
                    0,
                    &format!("The vault code {word}."),
                ))],
            )
            .await
            .unwrap();
        let mut knowledge = chunk("k", 0, &format!("Bob likes {word} tea."));
        knowledge.id = "bob-1".into();
        knowledge.kind = ItemKind::Knowledge;
        knowledge.document_id = None;
        knowledge.chunk = None;
        knowledge.owner.user = Some("bob".into());
        knowledge.embedding = Some(vec![1.0, 0.0]);
        store.upsert_items(tenant, vec![knowledge]).await.unwrap();
    }
    // globex re-ingests its document: acme's of the same id stays.
    store
        .replace_document(
            "globex",
            record("kb:secret.md", "kb"),
            vec![chunk(
                "kb:secret.md",
                0,
                &format!("The new vault code {CANARY}."),
            )],
        )
        .await
        .unwrap();
}

/// No tenant, or a malformed one: refused, never "every tenant".
async fn refuses_a_missing_or_malformed_tenant(store: &dyn Store) {
    for bad in ["", "a b", "x\n"] {
        let mut q = query(CANARY);
        q.tenant = bad.into();
        let error = store.search(&q).await.unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{bad:?}: {error}");
        let error = store.list_documents(bad, &[], &[], 10).await.unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{error}");
        let error = store.document(bad, "kb:secret.md").await.unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{error}");
        let error = store
            .replace_document(bad, record("kb:x.md", "kb"), vec![])
            .await
            .unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{error}");
        let error = store.upsert_items(bad, vec![]).await.unwrap_err();
        assert!(matches!(error, StoreError::Invalid(_)), "{error}");
    }
}
