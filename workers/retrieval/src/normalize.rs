//! Turning a file into the plain text that is chunked and indexed.
//!
//! Every format ends in the same shape: paragraphs separated by one blank
//! line, runs of spaces and tabs collapsed to one space, never three
//! newlines in a row ([`collapse_whitespace`]). HTML goes through a real
//! HTML tokenizer (html5ever): `<br>` in any spelling and the end of a
//! block element become newlines, every other tag is dropped, entities are
//! decoded, and `<script>`/`<style>` contents never reach the text.
//! Markdown goes through pulldown-cmark. CSV is read with the `csv` crate
//! (ragged rows allowed and reported) and rendered one row per line with
//! its header names, so that a search finds the row.

use std::cell::RefCell;
use std::path::Path;

use html5ever::tendril::StrTendril;
use html5ever::tokenizer::states::RawKind;
use html5ever::tokenizer::{
    BufferQueue, CharacterTokens, EndTag, StartTag, Tag as HtmlTag, TagKind, TagToken, Token,
    TokenSink, TokenSinkResult, Tokenizer, TokenizerOpts,
};
use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};

/// How many bytes at the start of a file are inspected for binary content.
const SNIFF_BYTES: usize = 8192;

/// The formats ingestion understands, chosen by file extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `.md`, `.markdown`.
    Markdown,
    /// `.html`, `.htm`.
    Html,
    /// `.txt`, `.text`.
    Text,
    /// `.csv`.
    Csv,
}

impl Format {
    /// The format a path's extension names, if it is one of ours.
    pub fn of_path(path: &Path) -> Option<Self> {
        let extension = path.extension()?.to_str()?.to_ascii_lowercase();
        match extension.as_str() {
            "md" | "markdown" => Some(Self::Markdown),
            "html" | "htm" => Some(Self::Html),
            "txt" | "text" => Some(Self::Text),
            "csv" => Some(Self::Csv),
            _ => None,
        }
    }

    /// The name stored with the document (`markdown`, `html`, `text`, `csv`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Markdown => "markdown",
            Self::Html => "html",
            Self::Text => "text",
            Self::Csv => "csv",
        }
    }
}

/// A file turned into text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Normalized {
    /// The document's own title (HTML `<title>` or first `<h1>`, Markdown's
    /// first level-one heading), normalised like the text.
    pub title: Option<String>,
    /// The text to chunk and index.
    pub text: String,
    /// Things worth telling the person ingesting (ragged CSV rows).
    pub warnings: Vec<String>,
}

/// Why a file cannot be turned into text.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum NormalizeError {
    /// A NUL byte or bytes that are not UTF-8.
    #[error("binary content ({0}); only UTF-8 text is ingested")]
    Binary(&'static str),
    /// A CSV file the reader could not read.
    #[error("unreadable CSV: {0}")]
    Csv(String),
}

/// Whether `bytes` are not text: a NUL byte in the first 8 KiB, or bytes
/// that are not UTF-8 anywhere. Returns the reason.
pub fn binary_reason(bytes: &[u8]) -> Option<&'static str> {
    if bytes[..bytes.len().min(SNIFF_BYTES)].contains(&0) {
        return Some("a NUL byte");
    }
    if std::str::from_utf8(bytes).is_err() {
        return Some("not valid UTF-8");
    }
    None
}

/// Turns a file's bytes into text according to its format.
pub fn normalize(format: Format, bytes: &[u8]) -> Result<Normalized, NormalizeError> {
    if let Some(reason) = binary_reason(bytes) {
        return Err(NormalizeError::Binary(reason));
    }
    // Checked just above.
    let input = std::str::from_utf8(bytes).map_err(|_| NormalizeError::Binary("not UTF-8"))?;
    let input = input.strip_prefix('\u{feff}').unwrap_or(input);
    Ok(match format {
        Format::Html => html_to_text(input),
        Format::Markdown => markdown_to_text(input),
        Format::Text => Normalized {
            title: None,
            text: collapse_whitespace(input),
            warnings: Vec::new(),
        },
        Format::Csv => csv_to_text(input)?,
    })
}

/// Collapses runs of horizontal whitespace to one space, turns CRLF and CR
/// into LF, trims every line, and never lets more than one blank line stand
/// between paragraphs. Leading and trailing blank lines are dropped.
pub fn collapse_whitespace(input: &str) -> String {
    let mut out = String::with_capacity(input.len());
    let mut newlines = 0usize;
    let mut space = false;
    let mut chars = input.chars().peekable();
    while let Some(c) = chars.next() {
        let c = match c {
            '\r' => {
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
                '\n'
            }
            // Vertical tab, form feed, line and paragraph separators.
            '\u{b}' | '\u{c}' | '\u{2028}' | '\u{2029}' => '\n',
            c => c,
        };
        if c == '\n' {
            newlines += 1;
            space = false;
        } else if c.is_whitespace() {
            space = true;
        } else {
            if !out.is_empty() {
                if newlines > 0 {
                    out.push_str(if newlines >= 2 { "\n\n" } else { "\n" });
                } else if space {
                    out.push(' ');
                }
            }
            newlines = 0;
            space = false;
            out.push(c);
        }
    }
    out
}

/// One line of text: every whitespace run becomes one space.
pub fn one_line(input: &str) -> String {
    input.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Elements whose end (and start) is a line break in the text.
const BLOCK_ELEMENTS: &[&str] = &[
    "address",
    "article",
    "aside",
    "blockquote",
    "body",
    "caption",
    "dd",
    "details",
    "dialog",
    "div",
    "dl",
    "dt",
    "fieldset",
    "figcaption",
    "figure",
    "footer",
    "form",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "head",
    "header",
    "hr",
    "html",
    "legend",
    "li",
    "main",
    "nav",
    "ol",
    "p",
    "pre",
    "section",
    "summary",
    "table",
    "tbody",
    "tfoot",
    "thead",
    "title",
    "tr",
    "ul",
];

/// Elements whose contents are never text for a reader.
const HIDDEN_ELEMENTS: &[&str] = &["script", "style", "template", "noscript", "iframe", "svg"];

#[derive(Default)]
struct HtmlText {
    text: String,
    title: String,
    first_h1: String,
    /// The hidden element we are inside, if any (its contents are dropped).
    hidden: Option<String>,
    in_title: bool,
    /// Inside the first `<h1>`.
    in_h1: bool,
    /// Line breaks owed before the next text (1 or 2): tags ask for them,
    /// text pays them, so whitespace between tags never adds more.
    pending: u8,
    /// Inside `<pre>`: source line breaks are kept.
    in_pre: usize,
    h1_done: bool,
}

impl HtmlText {
    /// A start or end tag: what it opens or closes, and the line breaks it
    /// asks of the next text.
    fn tag(&mut self, tag: &HtmlTag) -> TokenSinkResult<()> {
        let name: &str = &tag.name;
        if let Some(hidden) = &self.hidden {
            if tag.kind == EndTag && hidden == name {
                self.hidden = None;
            }
            return TokenSinkResult::Continue;
        }
        match (tag.kind, name) {
            (StartTag, "br") | (EndTag, "br") => self.pending = (self.pending + 1).min(2),
            (StartTag, "pre") => self.in_pre += 1,
            (EndTag, "pre") => self.in_pre = self.in_pre.saturating_sub(1),
            (StartTag, "title") => self.in_title = true,
            (EndTag, "title") => {
                self.in_title = false;
                return TokenSinkResult::Continue;
            }
            (StartTag, "h1") if !self.h1_done => self.in_h1 = true,
            (EndTag, "h1") if self.in_h1 => {
                self.in_h1 = false;
                self.h1_done = true;
            }
            _ => {}
        }
        if tag.kind == StartTag
            && let Some(raw) = self.raw_contents(name, tag.self_closing)
        {
            return raw;
        }
        self.ask_for_break(tag.kind, name);
        TokenSinkResult::Continue
    }

    /// How the tokenizer must read what a start tag opens, when not as
    /// markup: hidden elements are entered (their contents dropped).
    fn raw_contents(&mut self, name: &str, self_closing: bool) -> Option<TokenSinkResult<()>> {
        if HIDDEN_ELEMENTS.contains(&name) && !self_closing {
            self.hidden = Some(name.to_owned());
            // The tokenizer alone does not know these hold raw text.
            return Some(match name {
                "script" => TokenSinkResult::RawData(RawKind::ScriptData),
                "style" | "iframe" | "noscript" => TokenSinkResult::RawData(RawKind::Rawtext),
                _ => TokenSinkResult::Continue,
            });
        }
        (name == "textarea").then_some(TokenSinkResult::RawData(RawKind::Rcdata))
    }

    /// A block element's edge owes the next text a line break; a cell's end
    /// a space.
    fn ask_for_break(&mut self, kind: TagKind, name: &str) {
        if BLOCK_ELEMENTS.contains(&name) {
            // A paragraph-like end is a blank line; a cell or item end
            // one line.
            let blank = matches!(
                name,
                "p" | "div"
                    | "section"
                    | "article"
                    | "table"
                    | "ul"
                    | "ol"
                    | "dl"
                    | "blockquote"
                    | "pre"
                    | "figure"
            ) || name.starts_with('h') && name.len() == 2;
            let want = if blank { 2 } else { 1 };
            self.pending = self.pending.max(want);
        } else if matches!(name, "td" | "th") && kind == EndTag {
            self.text.push(' ');
        }
    }

    /// Text: kept unless hidden, paying the line breaks owed before it.
    fn characters(&mut self, chars: &str) {
        if self.hidden.is_some() {
            return;
        }
        if self.in_title {
            self.title.push_str(chars);
            return;
        }
        if self.in_h1 {
            self.first_h1.push_str(chars);
        }
        // Outside <pre>, a line break in the source is a space.
        let text: String = if self.in_pre > 0 {
            chars.to_owned()
        } else {
            chars
                .chars()
                .map(|c| if c.is_whitespace() { ' ' } else { c })
                .collect()
        };
        if text.trim().is_empty() {
            if self.pending == 0 {
                self.text.push(' ');
            }
        } else if self.pending > 0 {
            self.pay_breaks();
            self.text.push_str(text.trim_start());
        } else {
            self.text.push_str(&text);
        }
    }

    /// Writes the line breaks owed.
    fn pay_breaks(&mut self) {
        if self.pending > 0 {
            let breaks = if self.pending >= 2 { "\n\n" } else { "\n" };
            self.text.push_str(breaks);
            self.pending = 0;
        }
    }
}

#[derive(Default)]
struct HtmlSink(RefCell<HtmlText>);

impl TokenSink for HtmlSink {
    type Handle = ();

    fn process_token(&self, token: Token, _line: u64) -> TokenSinkResult<()> {
        let mut state = self.0.borrow_mut();
        match token {
            TagToken(tag) => return state.tag(&tag),
            CharacterTokens(chars) => state.characters(&chars),
            // NUL characters, comments, doctypes, parse errors (malformed
            // HTML is read as browsers read it) and the end carry no text.
            _ => {}
        }
        TokenSinkResult::Continue
    }
}

/// HTML met inside Markdown, blocks and inline tags alike, read by the same
/// tokenizer as HTML files. One tokenizer lives from a Markdown block's
/// first HTML to the block's end, so an unclosed `<style>` in a paragraph
/// cannot hide the rest of the document.
#[derive(Default)]
struct EmbeddedHtml {
    tokenizer: Option<Tokenizer<HtmlSink>>,
    input: BufferQueue,
}

impl EmbeddedHtml {
    /// Reads one fragment, appending its text (and the line breaks its
    /// tags ask for) to `out`.
    fn feed(&mut self, html: &str, out: &mut String) {
        let tokenizer = self
            .tokenizer
            .get_or_insert_with(|| Tokenizer::new(HtmlSink::default(), TokenizerOpts::default()));
        self.input.push_back(StrTendril::from_slice(html));
        let _ = tokenizer.feed(&self.input);
        Self::drain(tokenizer, out);
    }

    /// Whether Markdown text here is inside `<script>`, `<style>` and the
    /// like (and so dropped).
    fn hidden(&self) -> bool {
        self.tokenizer
            .as_ref()
            .is_some_and(|t| t.sink.0.borrow().hidden.is_some())
    }

    /// The block ended: the rest of its HTML goes to `out`.
    fn finish(&mut self, out: &mut String) {
        if let Some(tokenizer) = self.tokenizer.take() {
            tokenizer.end();
            Self::drain(&tokenizer, out);
        }
    }

    fn drain(tokenizer: &Tokenizer<HtmlSink>, out: &mut String) {
        let mut state = tokenizer.sink.0.borrow_mut();
        // The Markdown text after a `<br>` is owed its break too.
        state.pay_breaks();
        out.push_str(&std::mem::take(&mut state.text));
    }
}

/// HTML to text; the title is `<title>`, else the first `<h1>`.
pub fn html_to_text(html: &str) -> Normalized {
    let sink = HtmlSink(RefCell::new(HtmlText::default()));
    let tokenizer = Tokenizer::new(sink, TokenizerOpts::default());
    let input = BufferQueue::default();
    input.push_back(StrTendril::from_slice(html));
    let _ = tokenizer.feed(&input);
    tokenizer.end();
    let state = tokenizer.sink.0.into_inner();
    let title = [one_line(&state.title), one_line(&state.first_h1)]
        .into_iter()
        .find(|t| !t.is_empty());
    Normalized {
        title,
        text: collapse_whitespace(&state.text),
        warnings: Vec::new(),
    }
}

/// Markdown to text: one paragraph per block, list items and table rows one
/// per line, headings kept as lines, front matter dropped. HTML in it is
/// read as in an HTML file (tags removed, `<br>` a newline, `<script>` and
/// `<style>` contents dropped), so its text is kept. The title is the first
/// level-one heading.
pub fn markdown_to_text(markdown: &str) -> Normalized {
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_YAML_STYLE_METADATA_BLOCKS;
    let mut text = String::with_capacity(markdown.len());
    let mut title: Option<String> = None;
    let mut heading: Option<(HeadingLevel, usize)> = None;
    let mut in_metadata = false;
    let mut html = EmbeddedHtml::default();
    for event in Parser::new_ext(markdown, options) {
        if let Event::End(end) = &event
            && ends_block(end)
        {
            html.finish(&mut text);
        }
        match event {
            Event::Start(Tag::MetadataBlock(_)) => in_metadata = true,
            Event::End(TagEnd::MetadataBlock(_)) => in_metadata = false,
            _ if in_metadata => {}
            Event::Start(Tag::Heading { level, .. }) => {
                text.push_str("\n\n");
                heading = Some((level, text.len()));
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some((HeadingLevel::H1, start)) = heading.take()
                    && title.is_none()
                {
                    title = Some(one_line(&text[start..])).filter(|t| !t.is_empty());
                }
                text.push_str("\n\n");
            }
            Event::Start(Tag::Item | Tag::TableRow | Tag::TableHead) => text.push('\n'),
            Event::End(TagEnd::TableCell) => text.push_str(" | "),
            Event::Start(Tag::CodeBlock(_) | Tag::HtmlBlock) => text.push_str("\n\n"),
            Event::End(
                TagEnd::Paragraph
                | TagEnd::HtmlBlock
                | TagEnd::BlockQuote(_)
                | TagEnd::CodeBlock
                | TagEnd::List(_)
                | TagEnd::Table
                | TagEnd::FootnoteDefinition
                | TagEnd::DefinitionList,
            ) => text.push_str("\n\n"),
            Event::Html(fragment) | Event::InlineHtml(fragment) => html.feed(&fragment, &mut text),
            // Inside an inline `<script>` or `<style>`.
            Event::Text(_) | Event::Code(_) if html.hidden() => {}
            Event::Text(t) | Event::Code(t) | Event::InlineMath(t) | Event::DisplayMath(t) => {
                text.push_str(&t)
            }
            Event::SoftBreak => text.push(' '),
            Event::HardBreak | Event::Rule => text.push('\n'),
            _ => {}
        }
    }
    html.finish(&mut text);
    // Table rows end in a dangling separator.
    let text = text.replace(" | \n", "\n");
    Normalized {
        title,
        text: collapse_whitespace(text.trim_end_matches(" | ")),
        warnings: Vec::new(),
    }
}

/// Whether a Markdown element that ends is a block (where embedded HTML's
/// tokenizer is reset), not an inline span such as emphasis or a link.
fn ends_block(end: &TagEnd) -> bool {
    !matches!(
        end,
        TagEnd::Emphasis
            | TagEnd::Strong
            | TagEnd::Strikethrough
            | TagEnd::Superscript
            | TagEnd::Subscript
            | TagEnd::Link
            | TagEnd::Image
    )
}

/// A parsed CSV file: the header and the rows, as read (ragged rows kept).
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// The first record.
    pub header: Vec<String>,
    /// Every later record, each as long as it was in the file.
    pub rows: Vec<Vec<String>>,
    /// How many rows have a different number of fields than the header.
    pub ragged_rows: usize,
}

/// Reads CSV text (comma-separated, first record is the header).
pub fn parse_csv(input: &str) -> Result<Table, NormalizeError> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(input.as_bytes());
    let mut records = reader.records();
    let header: Vec<String> = match records.next() {
        Some(record) => record
            .map_err(|e| NormalizeError::Csv(e.to_string()))?
            .iter()
            .map(one_line)
            .collect(),
        None => Vec::new(),
    };
    let mut rows = Vec::new();
    let mut ragged_rows = 0;
    for record in records {
        let record = record.map_err(|e| NormalizeError::Csv(e.to_string()))?;
        if record.len() != header.len() {
            ragged_rows += 1;
        }
        rows.push(record.iter().map(|v| v.trim().to_owned()).collect());
    }
    Ok(Table {
        header,
        rows,
        ragged_rows,
    })
}

/// The header name of column `index` (1-based `column N` past the header).
pub fn column_name(header: &[String], index: usize) -> String {
    match header.get(index) {
        Some(name) if !name.is_empty() => name.clone(),
        _ => format!("column {}", index + 1),
    }
}

/// CSV to text: one line per row, `name: value` pairs joined by `; `.
fn csv_to_text(input: &str) -> Result<Normalized, NormalizeError> {
    let table = parse_csv(input)?;
    let mut text = String::new();
    text.push_str(&table.header.join(", "));
    for row in &table.rows {
        text.push('\n');
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(i, v)| format!("{}: {}", column_name(&table.header, i), one_line(v)))
            .collect();
        text.push_str(&cells.join("; "));
    }
    let mut warnings = Vec::new();
    if table.ragged_rows > 0 {
        warnings.push(format!(
            "{} of {} rows do not have the header's {} fields; they are kept as they are",
            table.ragged_rows,
            table.rows.len(),
            table.header.len()
        ));
    }
    Ok(Normalized {
        title: None,
        text: collapse_whitespace(&text),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitespace_runs_collapse_and_blank_lines_are_at_most_one() {
        assert_eq!(
            collapse_whitespace("  a \t\u{a0} b\r\nc\r\rd\n\n\n\n\ne  \n \n"),
            "a b\nc\n\nd\n\ne"
        );
        assert_eq!(collapse_whitespace("\n\n  \t"), "");
        assert_eq!(collapse_whitespace("one\n \t \ntwo"), "one\n\ntwo");
    }

    #[test]
    fn html_breaks_and_block_ends_are_newlines_and_other_tags_vanish() {
        let html = "<p>First <b>bold</b> line<br>second<BR/>third<br />fourth</p>\
                    <div>block</div><ul><li>one</li><li>two</li></ul>\
                    <p>a&amp;b &lt;tag&gt; caf&eacute; &#169; &#x263A;</p>";
        let out = html_to_text(html);
        assert_eq!(
            out.text,
            "First bold line\nsecond\nthird\nfourth\n\nblock\n\none\ntwo\n\na&b <tag> café © ☺"
        );
    }

    #[test]
    fn html_scripts_styles_and_comments_never_reach_the_text() {
        let html = "<html><head><title> The  Title </title>\
                    <style>p { color: red } </p></style>\
                    <script>if (a < b && c > d) { document.write('<p>x</p>') }</script>\
                    </head><body><!-- hidden --><h1>Heading</h1><p>Body</p>\
                    <noscript><p>enable js</p></noscript></body></html>";
        let out = html_to_text(html);
        assert_eq!(out.title.as_deref(), Some("The Title"));
        assert_eq!(out.text, "Heading\n\nBody");
    }

    #[test]
    fn html_title_falls_back_to_the_first_h1() {
        let out = html_to_text("<h1>  Main\n heading </h1><h1>Second</h1><p>x</p>");
        assert_eq!(out.title.as_deref(), Some("Main heading"));
    }

    #[test]
    fn malformed_html_is_read_as_a_browser_reads_it() {
        let out = html_to_text(
            "<p>open <b>never closed <div attr='x>broken</p></i></table>tail &bogus; <",
        );
        assert!(out.text.starts_with("open never closed"), "{:?}", out.text);
        assert!(!out.text.contains("<p>"), "{:?}", out.text);
        let out = html_to_text("<p>open <b>never closed</p></i></table>tail &bogus; <");
        assert_eq!(out.text, "open never closed\n\ntail &bogus; <");
    }

    #[test]
    fn markdown_becomes_paragraphs_with_the_first_h1_as_title() {
        let md = "---\nauthor: x\n---\n# Refund  *policy*\n\nCustomers may \
                  return\nitems within **30 days**.\n\n## Exceptions\n\n- sale items\n- gift cards\n\n\
                  | a | b |\n|---|---|\n| 1 | 2 |\n\n<div>raw html</div>\n\n```\ncode  here\n```\n";
        let out = markdown_to_text(md);
        assert_eq!(out.title.as_deref(), Some("Refund policy"));
        assert_eq!(
            out.text,
            "Refund policy\n\nCustomers may return items within 30 days.\n\nExceptions\n\n\
             sale items\ngift cards\n\na | b\n1 | 2\n\nraw html\n\ncode here"
        );
    }

    #[test]
    fn html_in_markdown_keeps_its_text_with_breaks_and_without_scripts() {
        let md = "# Guide\n\n<div>Important text</div>\n\n\
                  <details>\n<summary>More</summary>\n\nHidden *details* here.\n\n</details>\n\n\
                  Line one<br>line two<br/>line three<BR />end &amp; <b>bold</b>.\n\n\
                  <script>\nalert('never');\n</script>\n\n\
                  <style>p { color: red }</style>\n\n\
                  Inline <script>tracking()</script>kept <!-- a note -->too.\n\n\
                  An unclosed <style> tag in prose.\n\nThe next paragraph stays.\n";
        let out = normalize(Format::Markdown, md.as_bytes()).unwrap();
        assert_eq!(out.title.as_deref(), Some("Guide"));
        assert_eq!(
            out.text,
            "Guide\n\nImportant text\n\nMore\n\nHidden details here.\n\n\
             Line one\nline two\nline three\nend & bold.\n\n\
             Inline kept too.\n\nAn unclosed\n\nThe next paragraph stays."
        );
    }

    #[test]
    fn csv_rows_become_lines_with_header_names_and_ragged_rows_are_reported() {
        let csv = "name,city,amount\nAda,London,10\nBob,\"New\nYork\",20,extra\nCyd\n";
        let out = normalize(Format::Csv, csv.as_bytes()).unwrap();
        assert_eq!(
            out.text,
            "name, city, amount\nname: Ada; city: London; amount: 10\n\
             name: Bob; city: New York; amount: 20; column 4: extra\nname: Cyd"
        );
        assert_eq!(out.warnings.len(), 1);
        assert!(
            out.warnings[0].starts_with("2 of 3 rows"),
            "{:?}",
            out.warnings
        );
    }

    #[test]
    fn binary_input_is_refused_with_the_reason() {
        assert_eq!(
            normalize(Format::Text, b"abc\0def"),
            Err(NormalizeError::Binary("a NUL byte"))
        );
        assert_eq!(
            normalize(Format::Markdown, &[0x66, 0xff, 0xfe, 0x41]),
            Err(NormalizeError::Binary("not valid UTF-8"))
        );
        let ok = normalize(Format::Text, "\u{feff}  hello\t world ".as_bytes()).unwrap();
        assert_eq!(ok.text, "hello world");
    }

    #[test]
    fn formats_come_from_extensions() {
        assert_eq!(Format::of_path(Path::new("a/b.MD")), Some(Format::Markdown));
        assert_eq!(Format::of_path(Path::new("x.htm")), Some(Format::Html));
        assert_eq!(Format::of_path(Path::new("x.csv")), Some(Format::Csv));
        assert_eq!(Format::of_path(Path::new("x.txt")), Some(Format::Text));
        assert_eq!(Format::of_path(Path::new("x.pdf")), None);
        assert_eq!(Format::of_path(Path::new("Makefile")), None);
    }
}
