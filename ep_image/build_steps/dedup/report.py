"""What a dedup run did, in ``du``'s terms: the report, its figures, how it is printed and written.

Why a module of its own: hardlink's own summary counts an inode still linked from outside the
ROOTs as freed and a file another process deleted as linked; these figures are read back from
the trees (a real run) or predicted from hardlink's records (``--dry-run``), so that
``saved_bytes`` is what the filesystem got back. docs/host-mode.md, "Deduplicating venvs".
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ep_image.build_steps.dedup.tree import Tree
from ep_image.files.records import write_json


@dataclass
class Report:
    """What a run did, printed and optionally written as JSON (``--json``)."""

    roots: list[str]
    device: int
    dry_run: bool
    read_only: bool
    tool: str = ""
    commands: list[list[str]] = field(default_factory=list)
    timestamp_pyc: str | None = None  # set: the bytecode rule's .py pass ran (first such .pyc)
    files_scanned: int = 0
    inodes_before: int = 0
    bytes_before: int = 0  # apparent size under the ROOTs, each inode once
    bytes_after: int = 0
    du_bytes_before: int = 0  # `du -sxcB1 ROOT...`
    du_bytes_after: int = 0
    saved_bytes: int = 0  # what the filesystem got back
    shared_not_freed_bytes: int = 0  # merged here, alive through links outside the ROOTs
    files_linked: int = 0  # paths that now hold another inode's data (read back after the run)
    inodes_merged: int = 0
    files_made_read_only: int = 0
    modes_restored: int = 0  # write bits a killed --read-only run had cleared, given back
    stale_temps_removed: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)  # not linked, and why
    left_writable: dict[str, int] = field(default_factory=dict)  # --read-only: not applied, why
    failures: list[str] = field(default_factory=list)
    #: On overlayfs: the mount, its upper directory (None: not visible here), what the layer
    #: held before and after; saved_bytes is then what the layer gained (overlay.py).
    overlay: dict[str, object] | None = None

    def book_before(self, before: Tree) -> None:
        """The figures of the walk before anything was linked."""
        self.files_scanned = before.files_scanned
        self.inodes_before = len(before.files)
        self.bytes_before = before.apparent_bytes()
        self.du_bytes_before = before.du_bytes()
        self.timestamp_pyc = before.timestamp_pyc


# --------------------------------------------------------------------------- figures


def predict(before: Tree, pairs: Iterable[tuple[str, str]]) -> Tree:
    """--dry-run: the trees as they would be after hardlink made the links it printed."""
    here = {key: inode.here for key, inode in before.files.items()}
    for kept, replaced in pairs:
        k, r = before.index.get(kept), before.index.get(replaced)
        if k is None or r is None:
            continue
        here[r] -= 1
        here[k] += 1
    after = Tree(other_blocks=before.other_blocks, files_scanned=before.files_scanned)
    for key, inode in before.files.items():
        if here[key] > 0:
            after.files[key] = replace(inode, here=here[key])
    return after


def account(before: Tree, after: Tree, replaced: set[tuple[int, int]], report: Report) -> None:
    """The report's figures: apparent and du bytes, what was freed, what is only shared.

    An inode that is gone counts as merged only if one of its paths was replaced by a link;
    one that is gone otherwise was removed by someone else while dedup ran.
    """
    report.bytes_after = after.apparent_bytes()
    report.du_bytes_after = after.du_bytes()
    for key, inode in before.files.items():
        if key in after.files:
            continue
        if key not in replaced:
            reason = "removed by another process while dedup ran (not counted as saved)"
            report.skipped[reason] = report.skipped.get(reason, 0) + inode.here
            continue
        report.inodes_merged += 1
        if inode.linked_outside:
            report.shared_not_freed_bytes += inode.blocks
        else:
            report.saved_bytes += inode.blocks


# --------------------------------------------------------------------------- output


def human(n: int) -> str:
    """Bytes as GiB/MiB/KiB with two decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def print_report(report: Report) -> None:
    """The report as ``dedup:`` lines; failures on stderr, ending with the fix."""
    verb = "would link" if report.dry_run else "linked"
    print(f"dedup: roots {' '.join(report.roots)} (device {report.device}), {report.tool}")
    print(f"dedup: {report.files_scanned} regular files, {report.inodes_before} inodes")
    print(f"dedup: {verb} {report.files_linked} files, {report.inodes_merged} inodes merged")
    print(
        f"dedup: du before {report.du_bytes_before} ({human(report.du_bytes_before)}), "
        f"after {report.du_bytes_after} ({human(report.du_bytes_after)}); freed on the "
        f"filesystem {report.saved_bytes} ({human(report.saved_bytes)})"
    )
    if report.overlay is not None:
        _print_overlay(report)
    if report.shared_not_freed_bytes:
        print(
            f"dedup: {human(report.shared_not_freed_bytes)} merged here freed nothing: those "
            "inodes are also linked from outside the ROOTs (e.g. uv's cache) and stay on disk"
        )
    if report.timestamp_pyc:
        print(
            "dedup: timestamp-validated bytecode (e.g. "
            f"{report.timestamp_pyc}): .py files linked only to ones of equal mtime"
        )
    if report.read_only:
        print(f"dedup: made read-only: {report.files_made_read_only} paths")
    if report.modes_restored:
        verb = "would give back" if report.dry_run else "gave back"
        print(
            f"dedup: {verb} the write bits of {report.modes_restored} files that a killed "
            "--read-only run had cleared"
        )
    if report.stale_temps_removed:
        print(
            f"dedup: removed {report.stale_temps_removed} temporary links a killed hardlink "
            "left (recorded by dedup as its run's)"
        )
    for reason, count in sorted(report.skipped.items()):
        print(f"dedup: not linked: {reason}: {count}")
    for reason, count in sorted(report.left_writable.items()):
        print(f"dedup: left writable (--read-only): {reason}: {count}")
    for failure in report.failures:
        print(f"dedup: FAILED: {failure}", file=sys.stderr)
    print(f"dedup: {report.seconds:.1f} s")
    if report.failures:
        crashed = any("meets the same crash" in failure for failure in report.failures)
        then = "report the crash" if crashed else "then run dedup again to finish"
        print(f"dedup: fix: see the FAILED lines; {then}", file=sys.stderr)


def _print_overlay(report: Report) -> None:
    """On overlayfs: what the layer gained, and how that was measured."""
    layer = report.overlay or {}
    gained = f"{report.saved_bytes} ({human(report.saved_bytes)})"
    if layer.get("upper"):
        print(
            f"dedup: overlayfs at {layer['mount_point']}: `du` above counts every layer; this "
            f"layer ({layer['upper']}) held {layer['layer_bytes_before']}, now "
            f"{layer['layer_bytes_after']}: freed in the layer {gained}. Files of lower layers "
            "are left alone (linking one copies it up into this layer)"
        )
    else:
        print(
            f"dedup: overlayfs at {layer['mount_point']}: its upper directory is not visible "
            "here (inside a container build it is the host's), so which files lie in a lower "
            "layer, where linking one copies it up into this layer, cannot be told; `du` above "
            "counts every layer. Measured by the free space of the file system under the layer "
            f"(other writers there count too): it got back {gained}"
        )
    if report.saved_bytes <= 0 and not report.dry_run:
        print("dedup: linking saved no space in this layer")


def write_report(path: Path, report: Report) -> None:
    """The JSON report, atomically (records.write_json: never over anything but a file)."""
    write_json(path, asdict(report), sort_keys=False)
