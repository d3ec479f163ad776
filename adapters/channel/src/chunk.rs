//! Splitting a long answer into messages that fit a platform's limit.
//!
//! Text is split at paragraph breaks, else line breaks, else spaces, else
//! (a word longer than the limit) at a character boundary; never inside a
//! code fence: a fence open at a cut is closed at the end of the chunk and
//! reopened, with its language, at the start of the next. Lengths are counted
//! the way the platform counts ([`LengthUnit`]). The pieces, joined back,
//! hold the same words in the same order.

use crate::LengthUnit;

/// The length of `text` as the platform counts it.
pub fn measure(text: &str, unit: LengthUnit) -> usize {
    match unit {
        LengthUnit::Chars => text.chars().count(),
        LengthUnit::Utf16 => text.encode_utf16().count(),
    }
}

const FENCE: &str = "```";
/// What closing an open fence at the end of a chunk adds.
const FENCE_CLOSE: &str = "\n```";

/// Split `text` into chunks of at most `max` (in `unit`). `max` must leave
/// room for a fence line (at least 32).
pub fn split(text: &str, max: usize, unit: LengthUnit) -> Vec<String> {
    let max = max.max(32);
    if measure(text, unit) <= max {
        return vec![text.to_owned()];
    }
    let mut chunks = Vec::new();
    let mut rest = text;
    // The fence line (e.g. "```rust") to reopen at the start of the next chunk.
    let mut reopen: Option<String> = None;
    while !rest.is_empty() {
        let prefix = reopen
            .as_ref()
            .map(|h| format!("{h}\n"))
            .unwrap_or_default();
        let room = max - measure(&prefix, unit).min(max / 2);
        if measure(rest, unit) <= room {
            chunks.push(format!("{prefix}{rest}"));
            break;
        }
        // First try the whole room; if the cut leaves a fence open, make
        // room for closing it and cut again.
        let mut cut = best_cut(rest, room, unit);
        let mut open = open_fence(reopen.as_deref(), &rest[..cut]);
        if open.is_some() {
            let closing = measure(FENCE_CLOSE, unit);
            cut = best_cut(rest, room.saturating_sub(closing).max(1), unit);
            open = open_fence(reopen.as_deref(), &rest[..cut]);
        }
        let body = rest[..cut].trim_end();
        let chunk = match &open {
            Some(_) => format!("{prefix}{body}{FENCE_CLOSE}"),
            None => format!("{prefix}{body}"),
        };
        chunks.push(chunk);
        rest = skip_separator(&rest[cut..]);
        reopen = open;
    }
    chunks.retain(|c| !c.trim().is_empty());
    chunks
}

/// The byte index to cut `text` at so that `text[..i]` fits `room`:
/// preferably at a paragraph break, else a line break, else a space, in the
/// second half of the room; else at the last character that fits.
fn best_cut(text: &str, room: usize, unit: LengthUnit) -> usize {
    // The longest prefix that fits, at a character boundary.
    let mut fit = 0;
    let mut used = 0;
    for (i, c) in text.char_indices() {
        let w = match unit {
            LengthUnit::Chars => 1,
            LengthUnit::Utf16 => c.len_utf16(),
        };
        if used + w > room {
            break;
        }
        used += w;
        fit = i + c.len_utf8();
    }
    if fit >= text.len() {
        return text.len();
    }
    let window = &text[..fit];
    let floor = fit / 2;
    for sep in ["\n\n", "\n", " "] {
        if let Some(at) = window.rfind(sep).filter(|&at| at > floor) {
            return at;
        }
    }
    // A word longer than half a message: cut it.
    fit.max(text.chars().next().map_or(1, char::len_utf8))
}

/// After a cut, drop the separator the cut was made at (one paragraph
/// break, line break or space), keeping any further indentation.
fn skip_separator(rest: &str) -> &str {
    if let Some(r) = rest.strip_prefix("\n\n") {
        r
    } else if let Some(r) = rest.strip_prefix('\n') {
        r
    } else if let Some(r) = rest.strip_prefix(' ') {
        r
    } else {
        rest
    }
}

/// The fence line still open at the end of `text`, given the fence open at
/// its start.
fn open_fence(start: Option<&str>, text: &str) -> Option<String> {
    let mut open = start.map(str::to_owned);
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with(FENCE) {
            open = match open {
                Some(_) => None,
                None => Some(trimmed.trim_end().to_owned()),
            };
        }
    }
    open
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_fits(chunks: &[String], max: usize, unit: LengthUnit) {
        for c in chunks {
            assert!(
                measure(c, unit) <= max,
                "chunk of {} > {max}: {c:?}",
                measure(c, unit)
            );
            assert!(!c.is_empty());
        }
    }

    /// The words, in order, ignoring fence lines added by the split.
    fn words(text: &str) -> Vec<String> {
        text.split_whitespace()
            .filter(|w| !w.starts_with(FENCE))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn short_text_is_one_chunk() {
        assert_eq!(split("hello", 4096, LengthUnit::Utf16), ["hello"]);
        let exact = "x".repeat(2000);
        assert_eq!(
            split(&exact, 2000, LengthUnit::Chars),
            std::slice::from_ref(&exact)
        );
        assert_eq!(
            split(&format!("{exact}y"), 2000, LengthUnit::Chars).len(),
            2
        );
    }

    #[test]
    fn paragraphs_then_lines_then_words() {
        let para = "word ".repeat(150).trim_end().to_owned(); // 749 chars
        let text = format!("{para}\n\n{para}\n\n{para}");
        let chunks = split(&text, 1600, LengthUnit::Chars);
        assert_eq!(
            chunks,
            [format!("{para}\n\n{para}"), para.clone()],
            "cut at the paragraph break"
        );
        let lines = format!("{para}\n{para}\n{para}");
        let chunks = split(&lines, 1600, LengthUnit::Chars);
        assert_eq!(
            chunks,
            [format!("{para}\n{para}"), para.clone()],
            "else at a line break"
        );
        let chunks = split(&para, 100, LengthUnit::Chars);
        check_fits(&chunks, 100, LengthUnit::Chars);
        assert!(
            chunks
                .iter()
                .all(|c| !c.starts_with(' ') && !c.ends_with(' '))
        );
        assert_eq!(
            words(&chunks.join(" ")),
            words(&para),
            "else at spaces, no word lost"
        );
    }

    #[test]
    fn a_word_longer_than_the_limit_is_cut() {
        let long = "a".repeat(5000);
        let chunks = split(&long, 2000, LengthUnit::Chars);
        assert_eq!(
            chunks.iter().map(String::len).collect::<Vec<_>>(),
            [2000, 2000, 1000]
        );
        assert_eq!(chunks.concat(), long);
    }

    #[test]
    fn multi_byte_text_is_counted_the_platforms_way_and_never_broken() {
        // 3000 emoji: 3000 chars, 6000 UTF-16 units.
        let emoji = "😀".repeat(3000);
        let discord = split(&emoji, 2000, LengthUnit::Chars);
        check_fits(&discord, 2000, LengthUnit::Chars);
        assert_eq!(discord.len(), 2);
        let telegram = split(&emoji, 4096, LengthUnit::Utf16);
        check_fits(&telegram, 4096, LengthUnit::Utf16);
        assert_eq!(telegram.len(), 2);
        assert_eq!(telegram.concat(), emoji, "no emoji split in half");
        let cyrillic = "привет мир ".repeat(500);
        let chunks = split(&cyrillic, 4096, LengthUnit::Utf16);
        check_fits(&chunks, 4096, LengthUnit::Utf16);
        assert_eq!(words(&chunks.join(" ")), words(&cyrillic));
    }

    #[test]
    fn code_fences_are_closed_and_reopened_across_chunks() {
        let code: String = (0..300).map(|i| format!("    let x{i} = {i};\n")).collect();
        let text = format!("Here is the code:\n\n```rust\n{code}```\n\nThat is all.");
        for (max, unit) in [(2000, LengthUnit::Chars), (4096, LengthUnit::Utf16)] {
            let chunks = split(&text, max, unit);
            check_fits(&chunks, max, unit);
            assert!(chunks.len() >= 2, "{}", chunks.len());
            for c in &chunks {
                let fences = c
                    .lines()
                    .filter(|l| l.trim_start().starts_with(FENCE))
                    .count();
                assert_eq!(fences % 2, 0, "a chunk with an unbalanced fence:\n{c}");
            }
            for c in &chunks[1..chunks.len() - 1] {
                assert!(
                    c.starts_with("```rust\n"),
                    "reopened with its language: {:?}",
                    &c[..20]
                );
            }
            assert!(chunks.last().unwrap().ends_with("That is all."));
            assert_eq!(
                words(&chunks.join("\n")),
                words(&text),
                "nothing lost or reordered"
            );
        }
    }
}
