"""The documentation builds without a broken link, and the README's links into it lead somewhere."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT

DOCS = REPO_ROOT / "docs"


def _nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _config_over(tmp_path: Path, docs_dir: Path) -> Path:
    """mkdocs.yml as it is, with ``docs_dir`` moved."""
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {REPO_ROOT / 'mkdocs.yml'}\ndocs_dir: {docs_dir}\n")
    return config


def test_every_nav_page_exists():
    nav = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"]
    missing = [page for page in _nav_pages(nav) if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml names pages that do not exist: {missing}"


def test_every_page_is_in_the_nav():
    nav = set(_nav_pages(yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"]))
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert pages <= nav, f"pages missing from the nav of mkdocs.yml: {sorted(pages - nav)}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    result = _mkdocs_build(_config_over(tmp_path, DOCS), tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "guide" / "precision" / "index.html").is_file()


@pytest.mark.parametrize(
    "link",
    ["[gone](guide/no-such-page.md)", "[gone](benchmarks.md#no-such-section)"],
    ids=["page", "anchor"],
)
def test_mkdocs_build_strict_fails_on_a_broken_link(tmp_path, link):
    pytest.importorskip("mkdocs")
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + f"\n{link}\n")
    result = _mkdocs_build(_config_over(tmp_path, docs), tmp_path / "site")
    assert result.returncode != 0
    assert link.split("(")[1].rstrip(")").split("#")[-1] in result.stdout + result.stderr


def _headings_slugs(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify  # what mkdocs' toc uses for anchors

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_links_lead_to_existing_files_and_sections():
    readme = (REPO_ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        target = REPO_ROOT / path
        assert target.is_file(), f"README links to {link}: no such file"
        if anchor and target.suffix == ".md":
            pytest.importorskip("markdown")
            assert anchor in _headings_slugs(target), f"README links to {link}: no such section"


def test_the_iresnet_parameter_table_matches_the_presets():
    """The one figure table of the docs that comes from no benchmark CSV: counted here from the presets."""
    import torch

    from lightning_memopt import create_model

    page = (DOCS / "guide" / "models-and-presets.md").read_text()
    rows = re.findall(r"^\| (r\d+) \| ([\d, ]+) \| ([\d.]+) M \|$", page, flags=re.M)
    assert [name for name, _, _ in rows] == ["r18", "r34", "r50", "r100", "r200"]
    for name, blocks, millions in rows:
        with torch.device("meta"):
            model = create_model(name)
        assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [int(b) for b in blocks.split(",")]
        assert f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}" == millions, name


# prose that is not a sentence: fenced code, generated blocks, comments
_FENCED = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
_GENERATED = re.compile(r"<!-- (table|figures): .*?<!-- /\1 -->", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_ABBREVIATION = re.compile(r"\b(e\.g|i\.e|vs|cf|etc)\.", re.I)
_RUN_IN_HEAD = re.compile(r"^\*\*[^*]+[.:](\*\*)?\s*")  # "**Tried.** The candidates …": a heading, not a sentence
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')*_]*\s+(?=[\"'(*_]*[A-Z0-9`])")
MOST_WORDS_ON_AVERAGE, MOST_WORDS = 25, 60


def sentences(markdown: str) -> list[list[str]]:
    """The words of each prose sentence of a Markdown page. Code blocks, generated blocks, tables and headings are
    not prose; a paragraph, a list item or an admonition line ends a sentence; inline code and a link are one word."""
    text = _COMMENT.sub("\n\n", _FENCED.sub("\n\n", _GENERATED.sub("\n\n", markdown)))
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"`[^`\n]+`", "CODE", text))
    paragraphs: list[list[str]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        item = re.match(r"(?:[-*+]|\d+[.)])\s+(.*)", line)
        if not line or line.startswith(("#", "|", "!!!", "???")) or re.fullmatch(r"-{3,}|\*{3,}", line):
            paragraphs.append([])
        elif item:
            paragraphs.append([item[1]])
        else:
            paragraphs[-1].append(line)
    found = []
    for paragraph in paragraphs:
        prose = _ABBREVIATION.sub(lambda m: m[0].replace(".", "\0"), " ".join(paragraph))
        for sentence in _SENTENCE_END.split(prose):
            words = [word for word in _RUN_IN_HEAD.sub("", sentence).split() if re.search(r"\w", word)]
            if words:
                found.append(words)
    return found


def sentence_lengths(page: Path) -> tuple[float, int, str]:
    """The words a sentence of ``page`` has on average, the most one has, and the start of that one."""
    lengths = [(len(words), " ".join(words)) for words in sentences(page.read_text())]
    longest = max(lengths)
    return sum(n for n, _ in lengths) / len(lengths), longest[0], longest[1][:80]


def test_sentences_are_split_at_ends_lists_and_paragraphs_not_in_code_or_tables():
    page = (
        "# A heading of words\n\nThe plan fits, e.g. on `a100_80gb` with `memopt-plan model=r50`. It\n"
        "runs [the guide](x.md#y) now!\n**Tried.** Then:\n\n- one item\n- another (item).\n\n"
        "```python\nx = 1. Not. A. Sentence.\n```\n\n| a table. | row. |\n\n"
        "<!-- figures: fake_vs_real.csv summary -->\n\nGenerated. Prose.\n\n<!-- /figures -->\n"
    )
    assert [" ".join(words) for words in sentences(page)] == [
        "The plan fits, e\0g\0 on CODE with CODE.",
        "It runs the guide now!",
        "Then:",
        "one item",
        "another (item).",
    ]


def test_the_sentence_limits_fail_a_long_sentence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Short one. Word " + "word " * 60 + "ends here.\n")
    average, most, _ = sentence_lengths(page)
    assert most == 63 > MOST_WORDS and average == 32.5 > MOST_WORDS_ON_AVERAGE


@pytest.mark.parametrize("page", [*sorted((DOCS / "guide").glob("*.md")), DOCS / "index.md"], ids=lambda p: p.name)
def test_guide_sentences_are_short(page):
    average, most, start = sentence_lengths(page)
    assert average <= MOST_WORDS_ON_AVERAGE, f"{page.name}: {average:.1f} words a sentence on average"
    assert most <= MOST_WORDS, f"{page.name}: a sentence of {most} words: {start}…"
