//! The runtime's Markdown rendered to Telegram's HTML subset.
//!
//! Telegram understands `<b> <i> <u> <s> <code> <pre> <a href> <blockquote>`
//! and nothing else; everything that is not one of those is escaped, so a
//! rendered message never fails to parse because of what the model wrote.
//! (When Telegram rejects the entities anyway, the sender falls back to the
//! plain text.) Headings become bold lines, list items get bullets or
//! numbers, raw HTML in the Markdown is shown as text.

use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};

/// Escape text for Telegram HTML.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// Render Markdown as Telegram HTML.
pub fn to_html(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len() + 16);
    // (ordered?, next number) per open list.
    let mut lists: Vec<Option<u64>> = Vec::new();
    let options = Options::ENABLE_STRIKETHROUGH;
    for event in Parser::new_ext(markdown, options) {
        match event {
            Event::Start(tag) => match tag {
                Tag::Paragraph => {}
                Tag::Heading { .. } => out.push_str("<b>"),
                Tag::BlockQuote(_) => out.push_str("<blockquote>"),
                Tag::CodeBlock(CodeBlockKind::Fenced(lang)) if !lang.is_empty() => {
                    let lang = lang.split_whitespace().next().unwrap_or_default();
                    out.push_str(&format!("<pre><code class=\"language-{}\">", escape(lang)));
                }
                Tag::CodeBlock(_) => out.push_str("<pre><code>"),
                Tag::List(start) => {
                    if !out.is_empty() && !out.ends_with('\n') {
                        out.push('\n');
                    }
                    lists.push(start);
                }
                Tag::Item => {
                    let depth = lists.len().saturating_sub(1);
                    out.push_str(&"  ".repeat(depth));
                    match lists.last_mut() {
                        Some(Some(n)) => {
                            out.push_str(&format!("{n}. "));
                            *n += 1;
                        }
                        _ => out.push_str("• "),
                    }
                }
                Tag::Emphasis => out.push_str("<i>"),
                Tag::Strong => out.push_str("<b>"),
                Tag::Strikethrough => out.push_str("<s>"),
                Tag::Link { dest_url, .. } => {
                    out.push_str(&format!("<a href=\"{}\">", escape(&dest_url)))
                }
                Tag::Image { dest_url, .. } => {
                    out.push_str(&format!("<a href=\"{}\">", escape(&dest_url)))
                }
                _ => {}
            },
            Event::End(tag) => match tag {
                TagEnd::Paragraph => out.push_str("\n\n"),
                TagEnd::Heading(_) => out.push_str("</b>\n\n"),
                TagEnd::BlockQuote(_) => {
                    trim_newlines(&mut out);
                    out.push_str("</blockquote>\n\n");
                }
                TagEnd::CodeBlock => {
                    trim_newlines(&mut out);
                    out.push_str("</code></pre>\n\n");
                }
                TagEnd::List(_) => {
                    lists.pop();
                    if lists.is_empty() {
                        trim_newlines(&mut out);
                        out.push_str("\n\n");
                    }
                }
                TagEnd::Item => {
                    trim_newlines(&mut out);
                    out.push('\n');
                }
                TagEnd::Emphasis => out.push_str("</i>"),
                TagEnd::Strong => out.push_str("</b>"),
                TagEnd::Strikethrough => out.push_str("</s>"),
                TagEnd::Link | TagEnd::Image => out.push_str("</a>"),
                _ => {}
            },
            Event::Text(text) => out.push_str(&escape(&text)),
            Event::Code(code) => out.push_str(&format!("<code>{}</code>", escape(&code))),
            // Raw HTML from the model is shown, not interpreted.
            Event::Html(html) | Event::InlineHtml(html) => out.push_str(&escape(&html)),
            Event::SoftBreak | Event::HardBreak => out.push('\n'),
            Event::Rule => out.push_str("——————\n\n"),
            Event::TaskListMarker(done) => out.push_str(if done { "☑ " } else { "☐ " }),
            Event::FootnoteReference(name) => out.push_str(&format!("[{}]", escape(&name))),
            _ => {}
        }
    }
    trim_newlines(&mut out);
    out
}

fn trim_newlines(out: &mut String) {
    while out.ends_with('\n') {
        out.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emphasis_code_links_and_escaping() {
        assert_eq!(
            to_html("**bold** and _it_ and ~~gone~~"),
            "<b>bold</b> and <i>it</i> and <s>gone</s>"
        );
        assert_eq!(
            to_html("use `a < b && c`"),
            "use <code>a &lt; b &amp;&amp; c</code>"
        );
        assert_eq!(
            to_html("[docs](https://example.com/?a=1&b=\"2\")"),
            "<a href=\"https://example.com/?a=1&amp;b=&quot;2&quot;\">docs</a>"
        );
        assert_eq!(
            to_html("1 < 2 & <script>x</script>"),
            "1 &lt; 2 &amp; &lt;script&gt;x&lt;/script&gt;"
        );
    }

    #[test]
    fn blocks_become_telegram_shapes() {
        assert_eq!(to_html("# Title\n\nbody"), "<b>Title</b>\n\nbody");
        assert_eq!(
            to_html("```rust\nfn main() {}\n```"),
            "<pre><code class=\"language-rust\">fn main() {}</code></pre>"
        );
        assert_eq!(to_html("- a\n- b\n\nafter"), "• a\n• b\n\nafter");
        assert_eq!(to_html("3. x\n4. y"), "3. x\n4. y");
        assert_eq!(to_html("> quoted"), "<blockquote>quoted</blockquote>");
        assert_eq!(to_html("one\ntwo"), "one\ntwo");
    }
}
