//! Readable text of a web page, through a real HTML parser (html5ever, by
//! way of `scraper`): the title, the main text — the page's `<main>` or
//! `<article>` when it has one, else its body without navigation, headers,
//! footers, asides and forms — and its links. Scripts, styles and other
//! non-text never reach the model; block elements become line breaks and
//! whitespace runs one space.

use scraper::{ElementRef, Html, Node, Selector};
use url::Url;

/// A page as the model reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    pub title: Option<String>,
    pub text: String,
    /// `(anchor text, absolute URL)`, http(s) only, each URL once, in page
    /// order.
    pub links: Vec<(String, String)>,
}

/// The deepest element whose text is read.
pub const MAX_DEPTH: usize = 256;

/// The most links kept from one page.
pub const MAX_LINKS: usize = 50;

/// Never text for a reader, wherever they are.
const HIDDEN: &[&str] = &[
    "script", "style", "noscript", "template", "svg", "iframe", "object", "embed", "canvas",
    "head", "select", "button",
];
/// Page furniture, left out when the whole body is read.
const FURNITURE: &[&str] = &["nav", "header", "footer", "aside", "form", "dialog"];
/// Elements that end a line.
const BLOCKS: &[&str] = &[
    "address",
    "article",
    "blockquote",
    "dd",
    "details",
    "div",
    "dl",
    "dt",
    "fieldset",
    "figcaption",
    "figure",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "hr",
    "li",
    "main",
    "ol",
    "p",
    "pre",
    "section",
    "summary",
    "table",
    "tr",
    "ul",
    "br",
    "body",
    "caption",
];

fn selector(css: &str) -> Selector {
    Selector::parse(css).expect("a valid built-in selector")
}

/// Whitespace runs to one space, trimmed.
#[must_use]
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The text of an HTML fragment (a search snippet with `<b>` in it),
/// entities decoded, on one line.
#[must_use]
pub fn fragment_text(html: &str) -> String {
    let fragment = Html::parse_fragment(html);
    one_line(&fragment.root_element().text().collect::<String>())
}

/// The readable text of `html`, links resolved against `base`.
#[must_use]
pub fn readable(html: &str, base: &Url) -> Page {
    let document = Html::parse_document(html);
    let title = document
        .select(&selector("title"))
        .next()
        .map(|t| one_line(&t.text().collect::<String>()))
        .filter(|t| !t.is_empty())
        .or_else(|| {
            document
                .select(&selector("h1"))
                .next()
                .map(|h| one_line(&h.text().collect::<String>()))
                .filter(|t| !t.is_empty())
        });
    let main = ["main", "article", "[role=main]"]
        .iter()
        .find_map(|css| document.select(&selector(css)).next());
    let (root, skip_furniture) = match main {
        Some(main) => (main, false),
        None => (
            document
                .select(&selector("body"))
                .next()
                .unwrap_or_else(|| document.root_element()),
            true,
        ),
    };
    let mut walker = Walker {
        lines: Vec::new(),
        line: String::new(),
        skip_furniture,
        links: Vec::new(),
        base,
    };
    walker.walk(root, 0);
    walker.end_line();
    let mut text = String::new();
    let mut blank = false;
    for line in walker.lines {
        if line.is_empty() {
            blank = !text.is_empty();
            continue;
        }
        if !text.is_empty() {
            text.push_str(if blank { "\n\n" } else { "\n" });
        }
        blank = false;
        text.push_str(&line);
    }
    Page {
        title,
        text,
        links: walker.links,
    }
}

struct Walker<'a> {
    lines: Vec<String>,
    line: String,
    skip_furniture: bool,
    links: Vec<(String, String)>,
    base: &'a Url,
}

impl Walker<'_> {
    fn end_line(&mut self) {
        let line = one_line(&self.line);
        self.line.clear();
        if !line.is_empty() {
            self.lines.push(line);
        }
    }

    fn walk(&mut self, element: ElementRef<'_>, depth: usize) {
        // A hostile page nests without end: past this depth its text is
        // not read (no real page nests so deep; the stack stays bounded).
        if depth > MAX_DEPTH {
            return;
        }
        for child in element.children() {
            match child.value() {
                Node::Text(text) => self.line.push_str(text),
                Node::Element(e) => {
                    let name = e.name();
                    if HIDDEN.contains(&name)
                        || (self.skip_furniture && FURNITURE.contains(&name))
                        || e.attr("hidden").is_some()
                        || e.attr("aria-hidden") == Some("true")
                    {
                        continue;
                    }
                    let Some(child) = ElementRef::wrap(child) else {
                        continue;
                    };
                    let block = BLOCKS.contains(&name);
                    if block {
                        self.end_line();
                    }
                    if matches!(name, "td" | "th") {
                        self.line.push(' ');
                    }
                    if name == "a" {
                        self.link(child);
                    }
                    self.walk(child, depth + 1);
                    if block {
                        self.end_line();
                        if matches!(
                            name,
                            "p" | "h1"
                                | "h2"
                                | "h3"
                                | "h4"
                                | "h5"
                                | "h6"
                                | "table"
                                | "ul"
                                | "ol"
                                | "pre"
                                | "blockquote"
                        ) {
                            self.lines.push(String::new());
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn link(&mut self, a: ElementRef<'_>) {
        if self.links.len() >= MAX_LINKS {
            return;
        }
        let Some(href) = a.value().attr("href") else {
            return;
        };
        let Ok(url) = self.base.join(href.trim()) else {
            return;
        };
        if !matches!(url.scheme(), "http" | "https") {
            return;
        }
        let url = url.to_string();
        if self.links.iter().any(|(_, u)| *u == url) {
            return;
        }
        let text = one_line(&a.text().collect::<String>());
        self.links.push((text, url));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Url {
        Url::parse("https://example.com/docs/page.html").unwrap()
    }

    #[test]
    fn the_main_text_without_furniture_scripts_or_styles() {
        let html = r#"<!doctype html><html><head><title> Bees &amp; fog </title>
            <style>body{color:red}</style><script>var secret = "x";</script></head>
            <body><nav><a href="/">Home</a> | <a href="/about">About</a></nav>
            <header>Site header</header>
            <h1>Navigation</h1><p>Bees use the <b>sun</b>
            as a compass.</p><p>Fog&nbsp;hides it.<br>Then they use polarised light.</p>
            <ul><li>one</li><li>two</li></ul>
            <noscript>Enable JS</noscript><div hidden>invisible</div>
            <footer>Copyright</footer></body></html>"#;
        let page = readable(html, &base());
        assert_eq!(page.title.as_deref(), Some("Bees & fog"));
        assert_eq!(
            page.text,
            "Navigation\n\nBees use the sun as a compass.\n\nFog hides it.\nThen they use polarised light.\n\none\ntwo"
        );
        for absent in [
            "secret",
            "color",
            "Home",
            "Site header",
            "Copyright",
            "Enable JS",
            "invisible",
        ] {
            assert!(!page.text.contains(absent), "{absent}: {}", page.text);
        }
    }

    #[test]
    fn main_or_article_is_preferred_and_links_are_absolute() {
        let html = r#"<body><div>sidebar <a href="/side">side</a></div>
            <main><h2>Title</h2><p>See <a href="other.html#x">the other page</a>,
            <a href="mailto:a@b">mail</a>, <a href="https://x.org/">x</a> and
            <a href="other.html#x">again</a>.</p></main></body>"#;
        let page = readable(html, &base());
        assert_eq!(page.title.as_deref(), None);
        assert_eq!(page.text, "Title\n\nSee the other page, mail, x and again.");
        assert_eq!(
            page.links,
            [
                (
                    "the other page".to_owned(),
                    "https://example.com/docs/other.html#x".to_owned()
                ),
                ("x".to_owned(), "https://x.org/".to_owned()),
            ]
        );
        let article = readable("<body>menu<article><p>Story</p></article></body>", &base());
        assert_eq!(article.text, "Story");
    }

    #[test]
    fn a_page_nested_without_end_is_read_without_overflowing_the_stack() {
        let depth = 20_000;
        let html = format!(
            "<p>top</p>{}deep{}",
            "<div>".repeat(depth),
            "</div>".repeat(depth)
        );
        // On a small stack, as a worker thread has.
        let page = std::thread::Builder::new()
            .stack_size(1024 * 1024)
            .spawn(move || readable(&html, &Url::parse("https://x.example/").unwrap()))
            .unwrap()
            .join()
            .expect("no stack overflow");
        assert_eq!(page.text, "top");
    }

    #[test]
    fn fragments_and_malformed_html() {
        assert_eq!(
            fragment_text("The <b>bee</b> &amp; the  <i>sun</i>"),
            "The bee & the sun"
        );
        let page = readable("<p>unclosed <b>bold <p>next", &base());
        assert_eq!(page.text, "unclosed bold\n\nnext");
        assert_eq!(readable("", &base()).text, "");
    }
}
