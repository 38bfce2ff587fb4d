"""Every relative link in README.md, docs/**/*.md and evidence/ (the index and every dated
page) resolves: the file or folder exists, and an anchor names a heading of the page it points
at, as GitHub renders it.

Why: product pages quote measured figures briefly and link to the dated run's page or straight
to its data file (evidence/<date>/README.md and the reports beside it, indexed by
evidence/README.md); a dated page links each figure to its report or log. A page moved, a
heading renamed or a data file renamed must not leave a reader at a dead link. External links
(http, https, mailto) are not checked: the tests run offline.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Targets that are written elsewhere, with their data, and may not exist yet. A link to one
#: passes while the target is absent; once it exists it is checked like any other.
PENDING: dict[str, str] = {}

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def pages() -> list[Path]:
    evidence = ROOT / "evidence"
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        evidence / "README.md",
        *sorted(evidence.glob("*/README.md")),
    ]


def lines_outside_fences(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in lines_outside_fences(page.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def prose(page: Path) -> str:
    """The page with fenced blocks blanked and code spans removed (line numbers kept)."""
    kept = dict(lines_outside_fences(page.read_text()))
    lines = page.read_text().splitlines()
    return "\n".join(CODE_SPAN.sub("", kept.get(n, "")) for n in range(1, len(lines) + 1))


def links(page: Path) -> list[tuple[int, str]]:
    """Every link target of ``page`` outside code, with its line (link text may wrap)."""
    text = prose(page)
    return [(text.count("\n", 0, m.start(1)) + 1, m[1]) for m in LINK.finditer(text)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link of ``page`` that does not resolve."""
    problems = []
    for number, target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(root):
            problems.append(f"{where} (outside the repository)")
        elif not resolved.exists():
            if resolved.relative_to(root).as_posix() not in PENDING:
                problems.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} (no heading #{anchor} in {resolved.relative_to(root)})")
    return problems


def test_every_relative_link_resolves() -> None:
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_pages_checked_are_the_product_pages_and_every_evidence_page() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in pages()}
    assert {"README.md", "docs/architecture.md", "docs/ci.md", "evidence/README.md"} <= names
    assert all(page.is_file() for page in pages())
    dated = {p.relative_to(ROOT).as_posix() for p in (ROOT / "evidence").glob("*/README.md")}
    assert dated and dated <= names


def test_every_figure_page_links_its_data() -> None:
    """docs/benchmarks.md is figures: each of its sections with a table of them links a dated
    run or a data file under evidence/ (the links themselves are checked above)."""
    page = ROOT / "docs" / "benchmarks.md"
    sections = re.split(r"\n(?=#{1,2} )", page.read_text())
    assert len([s for s in sections if "| --- |" in s]) >= 2
    for section in (s for s in sections if "| --- |" in s):
        title = section.splitlines()[0]
        targets = [t for t in LINK.findall(CODE_SPAN.sub("", section)) if "evidence/" in t]
        assert targets, f"benchmarks.md, {title!r}: no link to its data under evidence/"


def test_the_evidence_index_links_every_dated_folder() -> None:
    """Each dated folder under evidence/ has its page, and the index links it."""
    index = ROOT / "evidence" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    for folder in sorted(p for p in index.parent.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), f"{folder.name} has no page"
        assert (folder / "README.md").resolve() in linked, f"the index does not link {folder.name}"


def test_readme_links_name_the_evidence_folder() -> None:
    stale = [
        f"README.md:{n}: {t}" for n, t in links(ROOT / "README.md") if t.startswith("docs/results")
    ]
    assert not stale, "links to the old location:\n" + "\n".join(stale)


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    """The check itself: good links pass; a missing file and a missing heading are reported;
    links in code are not links."""
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "other.md").write_text("# Other\n\n## DeepEP v1: why a source build\n## Other\n")
    page = docs / "page.md"
    page.write_text(
        "# A `code` heading: here\n\n"
        "[ok](#a-code-heading-here) [ok](other.md#deepep-v1-why-a-source-build) [ok](results/)\n"
        "[ok](other.md#other-1) [ok](https://example.com/x.md) [wrapped\nok](other.md)\n"
        "[bad](no-such-page.md) [bad](other.md#no-such-heading) `[code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].endswith("no-such-page.md (no such file)")
    assert problems[1].endswith("(no heading #no-such-heading in docs/other.md)")
