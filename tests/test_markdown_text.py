"""A book's or a model's text in Markdown renders as its own characters (unlimisum/visible.py ``markdown_text``):
rendered by a CommonMark renderer with GitHub's tables and strikethrough (markdown-it-py, which Rich brings), it
makes no element but paragraphs and line breaks, and its text is the text given."""

from __future__ import annotations

import html
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from unlimisum.visible import markdown_line, markdown_text, visible

RENDERER = MarkdownIt("commonmark").enable(["table", "strikethrough"])
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
TAG = re.compile(r"<(/?)([a-z0-9]+)[^>]*>")

# what a book or a summary may hold that Markdown would read: each line is one hostile case
HOSTILE = [
    '<img src="https://evil.example/pixel.png"> and <script>alert(1)</script>',
    "[click me](https://evil.example) ![a picture](https://evil.example/p.png) <https://evil.example>",
    "Before a comment <!-- everything after this would be hidden",
    "_Call me Ishmael._ Some *stars*, **bold**, `code`, ~~struck~~ and &amp; &#65; &copy;",
    "# Not a heading\n> not a quote\n- not a list\n+ nor this\n* nor this\n1984. not a number list\n3) nor this",
    "a line\n===\nanother\n---\n***\n```\nnot code\n```\n~~~",
    "| not | a table |\n|---|---|\n| x | y |",
    "A footnote of the book's own[^1] and a reference [x][y]\n\n[^1]: not ours\n[y]: https://evil.example",
    "    four spaces would be code\n\tand a tab",
    "C:\\path\\*.txt, a trailing backslash \\",
    "$5 and $6, 50% off",
]


def rendered_text(markdown: str) -> tuple[set[str], str]:
    """(the elements a renderer makes of ``markdown``, its text with every run of whitespace one space)."""
    page = RENDERER.render(markdown)
    elements = {match.group(2) for match in TAG.finditer(page)}
    return elements, " ".join(html.unescape(TAG.sub(" ", page)).split())


def shown(text: str) -> str:
    return " ".join(visible(text).split())


def test_hostile_markdown_renders_as_its_characters():
    for text in HOSTILE:
        elements, rendered = rendered_text(markdown_text(text))
        assert elements <= {"p", "br"}, (text, elements)
        assert rendered == shown(text), text


def test_plain_prose_is_left_alone():
    prose = "It was the best of times, it was the worst of times; (a) 3.5 x 2 = 7! Isn't it? \"Yes.\""
    assert markdown_text(prose) == prose


def test_a_piece_from_the_middle_of_a_line_begins_nothing_but_its_later_lines_are_checked():
    assert markdown_text("# x\n# y", line_start=False) == "# x\n\\# y"
    assert markdown_text("  - a", line_start=False) == "  - a"  # the middle of a line keeps its spaces
    assert markdown_text("  - a") == "\\- a"


def test_a_heading_or_a_cell_is_one_line_with_its_hashes_escaped():
    line = markdown_line("Chapter #3:\n  <b>The</b> | End ##")
    assert "\n" not in line
    elements, rendered = rendered_text("# " + line)
    assert elements == {"h1"} and rendered == "Chapter #3: <b>The</b> | End ##"
    table = RENDERER.render(f"| a | b |\n|---|---|\n| {markdown_line('x | y')} | z |")
    assert table.count("<td>") == 2 and "x | y" in html.unescape(table)


def test_control_characters_are_shown_as_symbols():
    assert markdown_text("\x1b]0;title\x07 [x]") == "\u241b\\]0;title\u2407 \\[x\\]"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab1 \n\t" + PUNCTUATION + "é😀")), max_size=40))
def test_any_text_renders_as_itself(text):
    elements, rendered = rendered_text(markdown_text(text))
    assert elements <= {"p", "br"}, elements
    assert rendered == shown(text)


def test_a_summary_file_renders_the_books_markup_as_text():
    """The Markdown of a summary whose titles, sentences and passages hold HTML (tests/test_html_page.py's
    hostile book): its own headings, table and footnote marks are elements, nothing of the book's is."""
    from tests.test_html_page import hostile_book, hostile_summary
    from unlimisum.runs.output import coverage_table, render_markdown

    document = hostile_book()
    summary = hostile_summary(document, support=(1.8, 0.02))
    page = RENDERER.render(render_markdown(summary, document, heading=True, evidence=True, coverage=True))
    elements = {match.group(2) for match in TAG.finditer(page)}
    assert elements <= {"h1", "p", "br", "table", "thead", "tbody", "tr", "th", "td", "a", "sup", "section",
                        "ol", "li", "hr"}, elements
    assert "<script" not in page and "<img" not in page and "<b>" not in page and "<i " not in page
    assert "&lt;script&gt;window.pwned" in page  # the sentence's markup, as its characters
    table = RENDERER.render(coverage_table(summary))
    assert table.count("<tr>") == 1 + len(summary.coverage)
    assert all(row.count("<td") == 3 for row in table.split("<tr>")[2:])
    assert "Loomings &lt;script&gt;alert(1)&lt;/script&gt;" in table
