"""Every dated run under evidence/ says whether it reruns, and its scripts run as committed.

Why: a figure in docs/ is worth what its run is; a reader must be able to run the run again, or
be told at once that it is a record and why. A script that sources a file that moved, changes
to a directory above the repository, or stops processes by name (``pkill -f`` ends whatever
else matches on a shared machine) does not run as committed. This holds every dated page to a
first paragraph that says which it is, and every script beside it to paths that exist inside
the repository, no process ended by name, and shellcheck.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "evidence"
#: The two first paragraphs a dated page may have.
VERDICT = re.compile(
    r"^\*\*(?:Reruns from the repository\b|A record: it does not rerun from the repository\b)"
)
#: A repository path a script runs or reads, relative to the repository root.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:scripts|probes|tests|evidence|docker|ep_image)/[\w./-]+)")
#: ``cd`` to a directory named from the script's own place.
CD_FROM_HERE = re.compile(r'\bcd\s+"(?:\$\(dirname "\$0"\)|\$here)([^"]*)"')
SOURCED = re.compile(r"^\s*(?:\.|source|bash)\s+([^\s$/\"'][^\s;&|]*)", re.M)
SHELLCHECK_SOURCE = re.compile(r"#\s*shellcheck\s+source=(\S+)")
FROM_HERE = re.compile(r'"\$here/([^"$]+)"')


def dated() -> list[Path]:
    return sorted(p for p in EVIDENCE.iterdir() if p.is_dir())


def scripts() -> list[Path]:
    return sorted(p for p in EVIDENCE.rglob("*") if p.suffix in (".sh", ".py") and p.is_file())


def first_paragraph(page: Path) -> str:
    """The first paragraph after the page's title."""
    body = page.read_text().split("\n", 1)[1].lstrip("\n")
    return body.split("\n\n", 1)[0]


def _without_comments(shell: str) -> str:
    """A shell script's text without its comments (a ``#`` that starts a word)."""
    return "\n".join(re.sub(r"(?:^|\s)#.*", "", line) for line in shell.splitlines())


def script_problems(script: Path, root: Path = ROOT) -> list[str]:
    """What keeps ``script`` from running as committed, one line each."""
    text = script.read_text()
    name = script.relative_to(root)
    problems = []
    if re.search(r"\b(?:pkill|killall)\b", text):
        problems.append(f"{name}: ends processes by name (pkill/killall): end them by their id")
    for rel in CD_FROM_HERE.findall(text):
        target = (script.parent / rel.lstrip("/")).resolve()
        if not target.is_relative_to(root):
            problems.append(f"{name}: cd {rel!r} leaves the repository ({target})")
    code = text if script.suffix == ".py" else _without_comments(text)
    named = {*SOURCED.findall(code), *SHELLCHECK_SOURCE.findall(text)}
    named |= {m for m in REPO_PATH.findall(code) if "*" not in m}
    for rel in sorted(named):
        rel = rel.rstrip(".,:;)")
        if rel.startswith("/dev/") or rel == "/dev/null":
            continue
        if not ((root / rel).exists() or (script.parent / rel).exists()):
            problems.append(f"{name}: names {rel}, which is not in the repository")
    for rel in FROM_HERE.findall(text):
        if not (script.parent / rel).exists():
            problems.append(f"{name}: names $here/{rel}, which is not beside it")
    return problems


def test_every_dated_page_says_first_whether_its_run_reruns() -> None:
    assert len(dated()) >= 6
    missing = [
        f"{folder.name}: {first_paragraph(folder / 'README.md')[:80]!r}"
        for folder in dated()
        if not VERDICT.match(first_paragraph(folder / "README.md"))
    ]
    assert not missing, (
        "dated pages that do not open with **Reruns from the repository** or **A record: it "
        "does not rerun from the repository** (and why):\n" + "\n".join(missing)
    )


def test_the_scripts_of_the_dated_runs_run_as_committed() -> None:
    found = scripts()
    assert any(p.suffix == ".sh" for p in found) and any(p.suffix == ".py" for p in found)
    problems = [problem for script in found for problem in script_problems(script)]
    assert not problems, "\n".join(problems)


def test_the_shell_scripts_of_the_dated_runs_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: run the tests with `uv run --frozen --group dev`"
    shell = [str(p.relative_to(ROOT)) for p in scripts() if p.suffix == ".sh"]
    proc = subprocess.run(
        [shellcheck, "-x", *shell], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_finds_what_does_not_rerun(tmp_path: Path) -> None:
    """A moved source, a cd above the root, a pkill and a missing file beside it are each
    named; a script that stays inside and names what exists passes."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "make_venv.py").write_text("")
    run = tmp_path / "evidence" / "2026-01-01"
    run.mkdir(parents=True)
    (run / "common.sh").write_text("R=/tmp/r\n")
    good = run / "good.sh"
    good.write_text(
        '#!/bin/bash\ncd "$(dirname "$0")/../.." || exit 2\n'
        "# shellcheck source=evidence/2026-01-01/common.sh\n. evidence/2026-01-01/common.sh\n"
        'here=$(cd "$(dirname "$0")" && pwd)\nbash "$here/common.sh"\n'
        "python3 scripts/make_venv.py --prefix /tmp/venvs\n"
    )
    assert script_problems(good, tmp_path) == []
    bad = run / "bad.sh"
    bad.write_text(
        '#!/bin/bash\ncd "$(dirname "$0")/../../.." || exit 2\n'
        ". docs/results/2026-01-01/common.sh\npkill -f check_te.py\n"
        'here=$(cd "$(dirname "$0")" && pwd)\n"$here/gone.sh"\n'
    )
    problems = script_problems(bad, tmp_path)
    assert len(problems) == 4, problems
    assert "by name" in problems[0] and "leaves the repository" in problems[1]
    assert "docs/results/2026-01-01/common.sh" in problems[2] and "gone.sh" in problems[3]
