"""No committed page or dated run names the machine it was written on.

Why: evidence/ keeps each run's reports and logs so that a reader can check a figure and rerun
it; docs/ and README.md quote them. A checkout's directory, a home, pytest's or a tool's
temporary directory, a GPU's UUID or a kernel's build string identify a machine and mean
nothing on the next one. tests/machine_paths.py lists them (and replaces them in a new run's
data); this test holds the committed files free of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import machine_paths

ROOT = Path(__file__).resolve().parents[1]


def committed(*paths: str) -> list[Path]:
    """Tracked files (and new ones git does not ignore) under ``paths``."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard", "--", *paths],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [
        ROOT / name.decode()
        for name in out.split(b"\0")
        if name and (ROOT / name.decode()).is_file()
    ]


def test_no_page_or_dated_run_holds_a_path_of_its_machine() -> None:
    files = committed("README.md", "docs", "evidence")
    assert any(f.suffix == ".json" for f in files) and any(f.suffix == ".log" for f in files)
    found = [str(f) for path in files for f in machine_paths.find(path.relative_to(ROOT))]
    assert not found, (
        f"{len(found)} machine paths (replace them: python3 tests/machine_paths.py --fix DIR):\n"
        + "\n".join(found[:40])
    )


def test_each_kind_is_found_in_a_data_file(tmp_path: Path) -> None:
    lines = {
        "a checkout or work directory of the machine": 'File "/work/main/probes/x.py", line 3',
        "a user's home directory": "compiled into /root/.deepep/hybrid_ep/jit/proc-12",
        "pytest's temporary directory": "rootdir /tmp/pytest-of-root/pytest-7/test_a0",
        "a GPU's UUID": "GPU 0: NVIDIA H200 (UUID: GPU-3afc31ef-0bf8-ee6b-cb76-e8de3e311bb7)",
        "a kernel's build string": '"kernel": "6.18.44-fc-v1147-gpu",',
        "the machine's temporary directory": '"prefix": "/tmp/venvs/deepep_v1",',
    }
    for what, line in lines.items():
        report = tmp_path / "report.log"
        report.write_text(f"first line\n{line}\n")
        found = machine_paths.find(report)
        assert (2, what) in [(f.line, f.what) for f in found], (line, found)
        assert all(f.line == 2 for f in found), found


def test_what_is_not_a_machine_path(tmp_path: Path) -> None:
    """Paths inside an image or chosen by a run's own script are not the machine's: the image's
    uv cache, /var/tmp, /opt/venvs; a page or script may name the /tmp directory it works in;
    version strings are not a kernel's build."""
    data = tmp_path / "report.json"
    data.write_text(
        '{"env": "UV_CACHE_DIR=/root/.cache/uv", "cache": "/var/tmp/hybrid-ep-own",\n'
        ' "prefix": "/opt/venvs/deepep_v2", "placeholder": "<tmp>/venvs", "home": "~/.deepep",\n'
        ' "torch": "2.14.1+cu130", "kernel": "6.18.44-<build>", "uuid": "GPU-<uuid>"}\n'
    )
    assert machine_paths.find(data) == []
    script = tmp_path / "h200-run.sh"
    script.write_text("R=/tmp/r\nmkdir -p /tmp/venvs\n")
    assert machine_paths.find(script) == []
    page = tmp_path / "README.md"
    page.write_text("It unpacks into `/tmp/rootfs`; `cd /work/main` first.\n")
    assert [f.what for f in machine_paths.find(page)] == [machine_paths.MACHINE[0][0]]


def test_fix_keeps_the_data_valid_and_its_meaning(tmp_path: Path) -> None:
    """Each kind gets its placeholder; JSON stays JSON; the allowed path stays; a second pass
    changes nothing; what is left passes the check."""
    report = {
        "python": "/tmp/venvs/deepep_v1/bin/python",
        "detail": "Assertion (/work/main/csrc/x.cu:87) and /work/gpucache/uv/git-v2/y",
        "jit": "/root/.deepep/hybrid_ep/jit/proc-9",
        "uv": "UV_CACHE_DIR=/root/.cache/uv",
        "pytest": "/tmp/pytest-of-root/pytest-12/test_a0/report.json",
        "kernel": "6.18.44-fc-v1147-gpu",
        "smi": "GPU-3afc31ef-0bf8-ee6b-cb76-e8de3e311bb7",
        "git": "url.file:///tmp/gs/deepep.git.insteadOf",
        "var": "/var/tmp/hybrid-ep-own",
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "machine_paths.py"), "--fix", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fixed = json.loads(path.read_text())
    assert fixed == {
        "python": "<tmp>/venvs/deepep_v1/bin/python",
        "detail": "Assertion (<repo>/csrc/x.cu:87) and <work>/gpucache/uv/git-v2/y",
        "jit": "~/.deepep/hybrid_ep/jit/proc-9",
        "uv": "UV_CACHE_DIR=/root/.cache/uv",
        "pytest": "<pytest-tmp>/test_a0/report.json",
        "kernel": "6.18.44-<build>",
        "smi": "GPU-<uuid>",
        "git": "url.file://<tmp>/gs/deepep.git.insteadOf",
        "var": "/var/tmp/hybrid-ep-own",
    }
    assert machine_paths.neutral(path.read_text()) == path.read_text()
    assert machine_paths.find(path) == []


def test_fix_leaves_pages_and_scripts_to_their_author(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text("cd /work/main\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "machine_paths.py"), "--fix", str(page)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "README.md:1: a checkout" in proc.stdout
    assert page.read_text() == "cd /work/main\n"
