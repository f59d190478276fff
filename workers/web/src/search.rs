//! Web search backends: DuckDuckGo's HTML endpoint, a SearXNG instance's
//! JSON API and the Brave Search API, each turned into the same
//! [`SearchHit`]s. A backend that refuses, rate-limits, answers in the
//! wrong format or finds nothing gives a clear [`SearchError`] or an empty
//! list — never a hang (every request runs under the fetcher's deadline).

use hyper::header::{ACCEPT, HeaderName, HeaderValue};
use scraper::{Html, Selector};
use serde::Deserialize;
use toolfleet_worker::Secret;
use url::Url;

use crate::html::{fragment_text, one_line};
use crate::net::{FetchError, Fetched, Fetcher, Limits, Request};

/// One result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchHit {
    pub title: String,
    pub url: String,
    pub snippet: String,
}

/// What a search asks for.
#[derive(Debug, Clone, Default)]
pub struct SearchQuery {
    pub query: String,
    pub max_results: usize,
    /// An ISO 639-1 language (`en`).
    pub language: Option<String>,
    /// A region: a country code (`us`) or DuckDuckGo's `us-en`.
    pub region: Option<String>,
}

/// Why a search failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SearchError {
    /// The backend limits our rate; try again later.
    #[error("{message}")]
    RateLimited {
        message: String,
        retry_after: Option<u64>,
    },
    /// The backend is misconfigured or refused us (a key, a format).
    #[error("{0}")]
    Refused(String),
    /// The request itself failed.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The backend answered something we cannot read.
    #[error("{0}")]
    Unreadable(String),
}

/// The configured backend.
#[derive(Debug, Clone)]
pub enum Backend {
    DuckDuckGo { url: Url },
    Searxng { url: Url },
    Brave { url: Url, key: Secret },
}

impl Backend {
    /// The backend's name, for references and metrics.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Backend::DuckDuckGo { .. } => "duckduckgo",
            Backend::Searxng { .. } => "searxng",
            Backend::Brave { .. } => "brave",
        }
    }

    /// The endpoint, whose host the operator chose (and so may be
    /// private: a SearXNG on the internal network).
    #[must_use]
    pub fn endpoint(&self) -> &Url {
        match self {
            Backend::DuckDuckGo { url } | Backend::Searxng { url } | Backend::Brave { url, .. } => {
                url
            }
        }
    }

    /// Runs `query`.
    ///
    /// # Errors
    ///
    /// [`SearchError`].
    pub async fn search(
        &self,
        fetcher: &Fetcher,
        query: &SearchQuery,
        limits: &Limits,
    ) -> Result<Vec<SearchHit>, SearchError> {
        let mut hits = match self {
            Backend::DuckDuckGo { url } => duckduckgo(fetcher, url, query, limits).await?,
            Backend::Searxng { url } => searxng(fetcher, url, query, limits).await?,
            Backend::Brave { url, key } => brave(fetcher, url, key, query, limits).await?,
        };
        hits.retain(|h| {
            !h.title.is_empty()
                && Url::parse(&h.url).is_ok_and(|u| matches!(u.scheme(), "http" | "https"))
        });
        let mut seen = std::collections::HashSet::new();
        hits.retain(|h| seen.insert(h.url.clone()));
        hits.truncate(query.max_results);
        Ok(hits)
    }
}

/// The status checks every backend shares: 429 (or 503 with
/// `Retry-After`) is a rate limit, 401/403 a refusal, other non-2xx a
/// failure.
fn check_status(backend: &str, fetched: &Fetched) -> Result<(), SearchError> {
    match fetched.status {
        200..=299 => Ok(()),
        429 => Err(SearchError::RateLimited {
            message: format!(
                "{backend} is limiting the rate of searches{}",
                fetched
                    .retry_after
                    .map_or_else(String::new, |s| format!("; try again in {s} s"))
            ),
            retry_after: fetched.retry_after,
        }),
        503 if fetched.retry_after.is_some() => Err(SearchError::RateLimited {
            message: format!("{backend} is overloaded; try again later"),
            retry_after: fetched.retry_after,
        }),
        401 | 403 => Err(SearchError::Refused(format!(
            "{backend} refused the request (HTTP {}): check the backend's key and settings",
            fetched.status
        ))),
        status => Err(SearchError::Fetch(FetchError::Failed {
            message: format!("{backend} answered HTTP {status}"),
            retryable: status >= 500,
        })),
    }
}

fn with_query(base: &Url, pairs: &[(&str, &str)]) -> Url {
    let mut url = base.clone();
    {
        let mut q = url.query_pairs_mut();
        for (k, v) in pairs {
            q.append_pair(k, v);
        }
    }
    url
}

fn json_body<T: for<'de> Deserialize<'de>>(
    backend: &str,
    fetched: &Fetched,
) -> Result<T, SearchError> {
    let is_json = fetched
        .content_type
        .as_deref()
        .is_some_and(|t| t == "application/json" || t.ends_with("+json"));
    if !is_json {
        return Err(SearchError::Unreadable(format!(
            "{backend} answered {} instead of JSON{}",
            fetched
                .content_type
                .as_deref()
                .unwrap_or("an undeclared type"),
            if backend == "searxng" {
                " (is the json format enabled in its settings.yml, search.formats?)"
            } else {
                ""
            }
        )));
    }
    serde_json::from_slice(&fetched.body).map_err(|e| {
        SearchError::Unreadable(format!("{backend} answered JSON we cannot read: {e}"))
    })
}

async fn duckduckgo(
    fetcher: &Fetcher,
    base: &Url,
    query: &SearchQuery,
    limits: &Limits,
) -> Result<Vec<SearchHit>, SearchError> {
    let mut pairs = vec![("q", query.query.as_str())];
    if let Some(region) = &query.region {
        pairs.push(("kl", region));
    }
    let url = with_query(base, &pairs);
    let fetched = fetcher
        .fetch(
            &Request::get(url.as_str()).header(ACCEPT, HeaderValue::from_static("text/html")),
            limits,
        )
        .await?;
    // DuckDuckGo answers 202 with a challenge page when it suspects a bot.
    if fetched.status == 202 {
        return Err(SearchError::RateLimited {
            message:
                "duckduckgo is refusing automated searches for now (it answered with a challenge)"
                    .into(),
            retry_after: None,
        });
    }
    check_status("duckduckgo", &fetched)?;
    Ok(parse_duckduckgo(&fetched.text()))
}

/// The results of DuckDuckGo's HTML page, ads left out.
#[must_use]
pub fn parse_duckduckgo(html: &str) -> Vec<SearchHit> {
    let document = Html::parse_document(html);
    let result = Selector::parse(".result").expect("selector");
    let title = Selector::parse("a.result__a").expect("selector");
    let snippet = Selector::parse(".result__snippet").expect("selector");
    let mut hits = Vec::new();
    for block in document.select(&result) {
        let classes = block.value().attr("class").unwrap_or_default();
        if classes.contains("result--ad") {
            continue;
        }
        let Some(a) = block.select(&title).next() else {
            continue;
        };
        let Some(href) = a.value().attr("href") else {
            continue;
        };
        hits.push(SearchHit {
            title: one_line(&a.text().collect::<String>()),
            url: duckduckgo_target(href),
            snippet: block
                .select(&snippet)
                .next()
                .map(|s| one_line(&s.text().collect::<String>()))
                .unwrap_or_default(),
        });
    }
    hits
}

/// DuckDuckGo links go through `//duckduckgo.com/l/?uddg=<target>`.
fn duckduckgo_target(href: &str) -> String {
    let absolute = if href.starts_with("//") {
        format!("https:{href}")
    } else {
        href.to_owned()
    };
    if let Ok(url) = Url::parse(&absolute)
        && url.path() == "/l/"
        && let Some((_, target)) = url.query_pairs().find(|(k, _)| k == "uddg")
    {
        return target.into_owned();
    }
    absolute
}

#[derive(Deserialize)]
struct SearxngAnswer {
    #[serde(default)]
    results: Vec<SearxngResult>,
}

#[derive(Deserialize)]
struct SearxngResult {
    #[serde(default)]
    title: String,
    #[serde(default)]
    url: String,
    #[serde(default)]
    content: String,
}

async fn searxng(
    fetcher: &Fetcher,
    base: &Url,
    query: &SearchQuery,
    limits: &Limits,
) -> Result<Vec<SearchHit>, SearchError> {
    let search = base
        .join("search")
        .map_err(|e| SearchError::Refused(format!("searxngUrl cannot take /search: {e}")))?;
    let mut pairs = vec![("q", query.query.as_str()), ("format", "json")];
    if let Some(language) = &query.language {
        pairs.push(("language", language));
    }
    let url = with_query(&search, &pairs);
    let fetched = fetcher
        .fetch(
            &Request::get(url.as_str())
                .header(ACCEPT, HeaderValue::from_static("application/json")),
            limits,
        )
        .await?;
    check_status("searxng", &fetched)?;
    let answer: SearxngAnswer = json_body("searxng", &fetched)?;
    Ok(answer
        .results
        .into_iter()
        .map(|r| SearchHit {
            title: fragment_text(&r.title),
            url: r.url,
            snippet: fragment_text(&r.content),
        })
        .collect())
}

#[derive(Deserialize)]
struct BraveAnswer {
    #[serde(default)]
    web: Option<BraveWeb>,
}

#[derive(Deserialize)]
struct BraveWeb {
    #[serde(default)]
    results: Vec<BraveResult>,
}

#[derive(Deserialize)]
struct BraveResult {
    #[serde(default)]
    title: String,
    #[serde(default)]
    url: String,
    #[serde(default)]
    description: String,
}

async fn brave(
    fetcher: &Fetcher,
    base: &Url,
    key: &Secret,
    query: &SearchQuery,
    limits: &Limits,
) -> Result<Vec<SearchHit>, SearchError> {
    let count = query.max_results.clamp(1, 20).to_string();
    let mut pairs = vec![("q", query.query.as_str()), ("count", count.as_str())];
    if let Some(language) = &query.language {
        pairs.push(("search_lang", language));
    }
    if let Some(region) = &query.region {
        pairs.push(("country", region));
    }
    let url = with_query(base, &pairs);
    let mut token = HeaderValue::from_str(key.expose())
        .map_err(|_| SearchError::Refused("the Brave API key cannot be sent as a header".into()))?;
    token.set_sensitive(true);
    let fetched = fetcher
        .fetch(
            &Request::get(url.as_str())
                .header(ACCEPT, HeaderValue::from_static("application/json"))
                .header(HeaderName::from_static("x-subscription-token"), token),
            limits,
        )
        .await?;
    check_status("brave", &fetched)?;
    let answer: BraveAnswer = json_body("brave", &fetched)?;
    Ok(answer
        .web
        .map(|w| w.results)
        .unwrap_or_default()
        .into_iter()
        .map(|r| SearchHit {
            title: fragment_text(&r.title),
            url: r.url,
            snippet: fragment_text(&r.description),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duckduckgo_results_without_ads_and_with_real_targets() {
        let html = r##"<html><body>
          <div class="result results_links result--ad"><a class="result__a" href="https://ads.example/">Ad</a></div>
          <div class="result results_links"><h2><a class="result__a"
             href="//duckduckgo.com/l/?uddg=https%3A%2F%2Fbees.example%2Fnav%3Fa%3D1&amp;rut=x">How <b>bees</b> navigate</a></h2>
             <a class="result__snippet" href="#">Bees use the <b>sun</b> &amp; polarised light.</a></div>
          <div class="result"><a class="result__a" href="https://direct.example/">Direct</a></div>
        </body></html>"##;
        let hits = parse_duckduckgo(html);
        assert_eq!(
            hits,
            [
                SearchHit {
                    title: "How bees navigate".into(),
                    url: "https://bees.example/nav?a=1".into(),
                    snippet: "Bees use the sun & polarised light.".into(),
                },
                SearchHit {
                    title: "Direct".into(),
                    url: "https://direct.example/".into(),
                    snippet: String::new(),
                },
            ]
        );
        assert!(parse_duckduckgo("<html>no results</html>").is_empty());
    }
}
