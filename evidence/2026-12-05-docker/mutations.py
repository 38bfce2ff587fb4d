"""Each Docker test fails when the behaviour it guards is broken.

Copies the repository's files (git ls-files) into a temporary directory, breaks one behaviour
for each test of tests/test_image_docker.py there (every break aims at a different test, so
one run shows them all), runs that module on the copy, and prints each test's outcome beside
the break aimed at it. Exit 0 when every test aimed at failed and every other test passed.

As root, from the repository root, after `uv sync --group dev` (about as long as one run of
the module):

    uv run --frozen --group dev python3 evidence/2026-12-05-docker/mutations.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Placeholders, read from the Dockerfile when the breaks are made: the legacy-builder stage
#: (its comment to the next stage's), and the line above `final` that lists the EP values.
LEGACY_STAGE = "<legacy-builder stage>"
VALUES_LINE = "<valid EP values line>"
#: (file, text, replacement, count, the test it must make fail, what the break is)
BREAKS = [
    (".dockerignore", "\nvenvs\n", "\n", 1,
     "test_the_dockerignore_keeps_what_jobs_write_out_of_the_context",
     ".dockerignore lets the main job's venvs/ into the build context"),
    ("docker/Dockerfile", LEGACY_STAGE, "", 1,
     "test_the_legacy_builder_stage_comes_first_and_nothing_needs_it",
     "no legacy-builder stage"),
    ("docker/Dockerfile", VALUES_LINE, "# EP: one backend or all\n", 1,
     "test_the_ep_values_above_final_are_the_registrys",
     "the line above `final` no longer lists the EP values"),
    ("docker/Dockerfile", "FROM venvs-common AS ep-deepep_v2\nARG VENV_SKIP_PACKAGES\n",
     "FROM venvs-common AS ep-deepep_v2\nARG VENV_SKIP_PACKAGES EP\n", 1,
     "test_switching_ep_rebuilds_no_backend_venv",
     "the ep-deepep_v2 stage depends on EP"),
    ("docker/Dockerfile", " --prebuilt-wheels /opt/prebuilt-wheels\n", "\n", 2,
     "test_prebuilt_wheels_from_the_context_and_from_a_named_context",
     "the source-built stages ignore the prebuilt wheels"),
    ("docker/Dockerfile", "WORKDIR /opt/ep-image\n", "", 1,
     "test_probe_passes_inside_the_image",
     "no WORKDIR: `probes/...` is not found from the image's working directory"),
    ("docker/Dockerfile", "from=prebuilt-wheels,target=/opt/prebuilt-wheels",
     "source=${PREBUILT_WHEELS},target=/opt/prebuilt-wheels", 3,
     "test_no_mount_source_needs_a_build_arg",
     "the wheels mounted from ${PREBUILT_WHEELS} again (Docker 20.10 cannot expand it)"),
    ("docker/ep-entrypoint", 'if [ -n "${EP_BACKEND:-}" ]; then', "if false; then", 1,
     "test_all_holds_every_backend_and_ep_backend_switches",
     "the entrypoint ignores EP_BACKEND"),
    ("docker/with-secrets", '    export CURL_CA_BUNDLE="$bundle"\n',
     '    export CURL_CA_BUNDLE="$bundle"\n    cp "$bundle" /etc/ep-image-ca.pem || true\n', 1,
     "test_no_secret_in_any_layer_history_or_config",
     "with-secrets leaves the CA bundle in the layer of every RUN it serves"),
]  # fmt: skip
#: Tests no break aims at, and why they fail too: the legacy builder's test and the unknown EP's
#: guard the same stage and line as two static tests above.
ALSO_BROKEN = {
    "test_a_builder_without_buildkit_stops_first_with_the_fix": "no legacy-builder stage",
    "test_unknown_ep_fails_at_once_listing_the_valid_values": "the EP values line",
}


def copy_repository(target: Path) -> None:
    """The repository's files (tracked and untracked, not ignored) as a git work tree."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode()  # fmt: skip
    for name in filter(None, names.split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    subprocess.run(["git", "init", "-q", "."], cwd=target, check=True)
    subprocess.run(["git", "add", "-A"], cwd=target, check=True)  # the tests list files with git


def legacy_stage(dockerfile: str) -> str:
    start = dockerfile.index("# ---- legacy-builder")
    return dockerfile[start : dockerfile.index("# ---- prebuilt-wheels", start)]


def apply_breaks(copy: Path) -> None:
    for name, old, new, count, _test, what in BREAKS:
        path = copy / name
        text = path.read_text()
        if old == LEGACY_STAGE:
            old = legacy_stage(text)
        elif old == VALUES_LINE:
            old = next(ln for ln in text.splitlines(True) if ln.startswith("# valid EP values: "))
        if text.count(old) != count:
            sys.exit(f"mutations: {name} holds {text.count(old)} of {old!r}, not {count}: {what}")
        path.write_text(text.replace(old, new))


def outcomes(junit: Path) -> dict[str, str]:
    """test name (parameters dropped) -> passed/failed/error/skipped, the worst of its cases."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        tags = {child.tag for child in case}
        state = next((s for s in ("error", "failure", "skipped") if s in tags), "passed")
        state = {"failure": "failed"}.get(state, state)
        if rank[state] > rank.get(found.get(name, "passed"), 0) or name not in found:
            found[name] = state
    return found


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(copy)
        apply_breaks(copy)
        junit = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "tests/test_image_docker.py", "-q",
                        "-p", "no:cacheprovider", f"--basetemp={tmp}/pytest",
                        f"--junitxml={junit}"], cwd=copy, check=False)  # fmt: skip
        result = outcomes(junit)
    aimed = {test: what for _n, _o, _w, _c, test, what in BREAKS}
    wrong = []
    for test, state in sorted(result.items()):
        why = aimed.get(test) or ALSO_BROKEN.get(test)
        expected = "failed" if why else "passed"
        print(f"{test}: {state} (expected {expected}{': ' + why if why else ''})")
        if state not in ((expected, "error") if why else (expected,)):
            wrong.append(test)
    missing = sorted(set(aimed) - set(result))
    if wrong or missing:
        print(f"mutations: unexpected outcome: {wrong}; never ran: {missing}", file=sys.stderr)
        return 1
    print("mutations: every test aimed at failed, every other test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
