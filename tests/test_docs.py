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
