"""The temporary links util-linux hardlink leaves when it is killed: recorded before it runs,
removed after it, and nothing else.

Why a module of its own: hardlink links the kept file to ``<duplicate>.hardlink-temporary`` and
renames that over the duplicate; killed in between, it leaves that second name. A file of the
same name may just as well be a user's, so dedup removes one only where its own record of the
run says hardlink made it: the name was not there when the run began, it links an inode the
run could link (one the walk found), it has two or more links, and its bytes are the duplicate's
beside it. The record is each ROOT's ``.dedup-run.json``, written before hardlink runs and
removed when the run ends; a run killed in between leaves it for the next. docs/host-mode.md,
"Deduplicating venvs".
"""

from __future__ import annotations

import filecmp
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ep_image import cli
from ep_image.build_steps.dedup.report import Report
from ep_image.build_steps.dedup.tree import (
    RUN_JOURNAL,
    TEMP_SUFFIX,
    DedupError,
    Tree,
    read_own_journal,
    write_own_journal,
)


@dataclass
class RunRecord:
    """What one run's record says: the file system, the names like hardlink's temporaries that
    were there before it (users' files), and the inodes it could link."""

    device: int
    names_before: set[str]  # absolute paths
    inodes: set[int]

    @classmethod
    def of(cls, before: Tree, device: int) -> RunRecord:
        inodes = {ino for (dev, ino), inode in before.files.items() if dev == device}
        return cls(device, set(before.temp_like), inodes)


def write(roots: list[Path], record: RunRecord) -> None:
    """Each ROOT's record of the run, on disk before hardlink runs (DedupError: nothing was
    changed yet)."""
    inodes = sorted(record.inodes)
    for root in roots:
        names = sorted(
            os.path.relpath(p, root) for p in record.names_before if p.startswith(f"{root}/")
        )
        journal = root / RUN_JOURNAL
        try:
            write_own_journal(
                journal,
                {
                    "written_by": "python3 -m ep_image.build_steps.dedup",
                    "meaning": "a dedup run on this ROOT is under way; if it was killed, the "
                    "next run removes the temporary links util-linux hardlink left (names "
                    "ending .hardlink-temporary that are not listed here, of these inodes) "
                    "and this file",
                    "device": record.device,
                    "names_before": names,
                    "inodes": inodes,
                },
            )
        except OSError as exc:
            raise DedupError(
                f"cannot write {journal}, where dedup records a run so that a killed one can "
                f"be finished ({exc}). Nothing was changed.",
                cli.os_error_fix(exc, root, "run dedup as the owner of the trees"),
            ) from None


def read(roots: list[Path], report: Report) -> dict[Path, RunRecord]:
    """The records killed runs left, by ROOT (only those this user wrote and nobody else can
    write; another is reported as possibly planted and left alone)."""
    found: dict[Path, RunRecord] = {}
    for root in roots:
        journal = root / RUN_JOURNAL
        try:
            why, text = read_own_journal(journal)
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.failures.append(f"{journal}: cannot read this record of a killed run ({exc})")
            continue
        if why is not None:
            report.failures.append(
                f"{journal}: refused, {why}: dedup writes its record owner-only, so this one "
                "may have been planted; nothing was removed. Fix: remove it if you did not "
                "write it, or run dedup as its owner"
            )
            continue
        try:
            data = json.loads(text)
            found[root] = RunRecord(
                device=int(data["device"]),
                names_before={str(root / n) for n in data["names_before"]},
                inodes={int(i) for i in data["inodes"]},
            )
        except (ValueError, KeyError, TypeError) as exc:
            report.failures.append(
                f"{journal}: cannot read this record of a killed run ({exc}): nothing was "
                "removed; a leftover '*.hardlink-temporary' link stays (remove it by hand after "
                "checking it equals the file beside it), then remove this file"
            )
    return found


def _temp_like(root: Path, device: int) -> dict[str, tuple[int, int, int]]:
    """Every regular file under ``root`` (on ``device``) named like hardlink's temporary."""
    found: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if _kind_on(os.path.join(dirpath, d), device) == "dir"]
        for name in filenames:
            if name.endswith(TEMP_SUFFIX):
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found[path] = (st.st_dev, st.st_ino, st.st_nlink)
    return found


def _kind_on(path: str, device: int) -> str | None:
    """ "dir" or "file" for a directory or regular file on ``device`` (None otherwise)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_dev != device:
        return None
    return "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else None


def left_by(record: RunRecord, candidates: dict[str, tuple[int, int, int]]) -> list[str]:
    """The temporary links of ``candidates`` that the run ``record`` describes made: new since
    it began, a second name of an inode it could link, equal to the duplicate beside it."""
    found = []
    for path, (dev, ino, nlink) in sorted(candidates.items()):
        if path in record.names_before or dev != record.device or ino not in record.inodes:
            continue
        twin = path[: -len(TEMP_SUFFIX)]
        if nlink < 2 or _kind_on(twin, dev) != "file":
            continue
        try:
            if filecmp.cmp(path, twin, shallow=False):
                found.append(path)
        except OSError:
            continue
    return found


def clean(
    roots: list[Path], records: dict[Path, RunRecord], report: Report, *, dry_run: bool
) -> None:
    """Remove (``dry_run``: count) the temporary links each ROOT's run record accounts for."""
    for root in roots:
        record = records.get(root)
        if record is None:
            continue
        for path in left_by(record, _temp_like(root, record.device)):
            if dry_run:
                reason = "temporary links of a killed run (removed on a real run)"
                report.skipped[reason] = report.skipped.get(reason, 0) + 1
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                report.failures.append(f"{path}: cannot remove this leftover link: {exc}")
            else:
                report.stale_temps_removed += 1


def drop(roots: list[Path]) -> None:
    """The run is over: nothing left for a record to account for."""
    for root in roots:
        (root / RUN_JOURNAL).unlink(missing_ok=True)
        (root / (RUN_JOURNAL + ".tmp")).unlink(missing_ok=True)
