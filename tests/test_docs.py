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
EXTERNAL = ("http://", "https://", "mailto:")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def documents() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "bench" / "results").glob("*.md"))
    return [p for p in pages if p.is_file()]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks): lower case, punctuation
    but - and _ dropped, spaces as -, a repeated heading suffixed -1, -2, ..."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    out, count = set(), {}
    for heading in HEADING.findall(text):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = count.get(slug, 0)
        count[slug] = n + 1
        out.add(f"{slug}-{n}" if n else slug)
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `page` that name no file or folder inside `root`, or no heading of
    the Markdown page they name."""
    bad = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(EXTERNAL):
            continue
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.is_relative_to(root) or not path.exists():
            bad.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
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
    (tmp_path / "docs" / "there.md").write_text("# Top\n\n## `moerl bench rollout --partial-ab`\n\n## Top\n")
    page.write_text("# Page\n[ok](there.md) [anchor](there.md#moerl-bench-rollout---partial-ab) [again](there.md#top-1) "
                    "[web](https://x.org) [gone](missing.md) [outside](../../etc/passwd) [self](#page) "
                    "[no heading](there.md#nowhere) [no self](#nothing)")
    assert broken_links(page, tmp_path) == ["missing.md", "../../etc/passwd", "there.md#nowhere", "#nothing"]


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


def test_every_raw_result_file_is_linked():
    results = ROOT / "bench" / "results"
    linked = {t for page in results.glob("*.md") for t in LINK.findall(page.read_text())}
    raw = [p.name for p in results.iterdir() if p.suffix in (".json", ".txt")]
    assert raw and not [name for name in raw if name not in linked]
