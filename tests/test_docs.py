"""The documents a newcomer reads: every relative link resolves to a file of the repository, the
README stays short and reaches install, first run, own environment, cluster deploy and the config
reference in one click, and nothing points at the BENCHMARKS.md that bench/results/ replaced."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Markdown inline links, [text](target): the target up to a space or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:", "#")


def documents() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "bench" / "results").glob("*.md"))
    return [p for p in pages if p.is_file()]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `page` that name no file or folder inside `root`."""
    bad = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(EXTERNAL):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(root) or not path.exists():
            bad.append(target)
    return bad


def test_every_relative_link_resolves():
    pages = documents()
    assert ROOT / "README.md" in pages and len(pages) > 10
    bad = {str(p.relative_to(ROOT)): broken_links(p) for p in pages}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](there.md) [anchor](there.md#a) [web](https://x.org) [gone](missing.md) "
                    "[outside](../../etc/passwd) [self](#top)")
    assert broken_links(page, tmp_path) == ["missing.md", "../../etc/passwd"]


def test_readme_is_short_and_one_click_from_each_task():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make run" in text and "make test" in text
    links = set(LINK.findall(text))
    for page in ("docs/local-run.md", "docs/environments.md", "docs/deploy-aws.md", "docs/cluster.md",
                 "docs/config.md", "bench/README.md"):
        assert page in links, page


def test_nothing_points_at_benchmarks_md():
    assert not (ROOT / "BENCHMARKS.md").exists()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    hits = [f for f in files if f != "tests/test_docs.py" and (ROOT / f).is_file()
            and "BENCHMARKS" in (ROOT / f).read_text(errors="replace")]
    assert not hits, hits
