"""Shared result model of the probes: step statuses, exit codes, the table and the JSON report.

check_ep, check_te and check_env must mean the same by each status and exit code, so the mapping
lives here once (docs/probes.md, section "Exit codes"). Merging several processes' codes ranks
bad usage (2) above all, since nothing was checked then.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ep_image.cli import EXIT_USAGE
from ep_image.files.records import write_json

EXIT_OK = 0
EXIT_FAILED = 1
# EXIT_USAGE (2) is ep_image.cli's: bad usage means the same for every command.
EXIT_UNUSABLE = 3
EXIT_MISSING = 4
EXIT_SKIPPED = 5

#: One word per exit code, for the table's last line and the JSON ``result`` field.
RESULT_WORDS = {
    EXIT_OK: "passed",
    EXIT_FAILED: "failed",
    EXIT_USAGE: "usage error",
    EXIT_UNUSABLE: "unusable",
    EXIT_MISSING: "missing",
    EXIT_SKIPPED: "skipped",
}

#: Version of the JSON layout written by ``--json``; bump it when a field changes meaning.
SCHEMA_VERSION = 1


class Status(enum.StrEnum):
    """How one step ended. ``NOT_RUN`` marks steps after a gate that did not pass."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    MISSING = "missing"
    SKIP = "skip"
    INFO = "info"
    NOT_RUN = "not run"

    @property
    def exit_code(self) -> int:
        return _STATUS_EXIT[self]

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_STATUS_EXIT = {
    Status.PASS: EXIT_OK,
    Status.INFO: EXIT_OK,
    Status.NOT_RUN: EXIT_OK,
    Status.FAIL: EXIT_FAILED,
    Status.ERROR: EXIT_UNUSABLE,
    Status.MISSING: EXIT_MISSING,
    Status.SKIP: EXIT_SKIPPED,
}

# Higher wins when statuses are merged (across ranks or across steps).
_SEVERITY = {
    Status.PASS: 0,
    Status.INFO: 0,
    Status.NOT_RUN: 0,
    Status.SKIP: 1,
    Status.FAIL: 2,
    Status.ERROR: 3,
    Status.MISSING: 4,
}


#: Exit codes from least to most severe, for merging the codes of several ranks.
_CODE_ORDER = (EXIT_OK, EXIT_SKIPPED, EXIT_FAILED, EXIT_UNUSABLE, EXIT_MISSING, EXIT_USAGE)


def merge_exit_codes(codes: Iterable[int]) -> int:
    """The most severe of several processes' exit codes; a crash (signal, unknown code) is 3."""
    merged = EXIT_OK
    for code in codes:
        code = code if code in _CODE_ORDER else EXIT_UNUSABLE
        if _CODE_ORDER.index(code) > _CODE_ORDER.index(merged):
            merged = code
    return merged


def worst(statuses: Iterable[Status]) -> Status:
    """The most severe status of ``statuses`` (PASS for none)."""
    result = Status.PASS
    for status in statuses:
        if status.severity > result.severity:
            result = status
    return result


@dataclasses.dataclass
class Step:
    """One probe step as reported: what ran, how it ended, how long it took, and why.

    ``detail`` is one line for the table; ``hint`` names the fix when the step did not pass;
    ``data`` holds the numbers (counts, differences, GB/s) for the JSON report.
    """

    name: str
    status: Status = Status.PASS
    seconds: float = 0.0
    detail: str = ""
    hint: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "seconds": round(self.seconds, 6),
            "detail": self.detail,
            "hint": self.hint,
            "data": self.data,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Step:
        return cls(
            name=obj["name"],
            status=Status(obj["status"]),
            seconds=float(obj.get("seconds", 0.0)),
            detail=obj.get("detail", ""),
            hint=obj.get("hint", ""),
            data=dict(obj.get("data", {})),
        )


class StepFailed(Exception):
    """Raised inside a step body to end it with a status other than PASS.

    The probes raise it where a check finds a problem, so a step body reads top to bottom
    and the runner records status, detail and hint in one place.
    """

    def __init__(
        self, status: Status, detail: str, hint: str = "", data: dict | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.hint = hint
        self.data = data or {}


@contextmanager
def timed_step(name: str) -> Iterator[Step]:
    """Run a step body, timing it; StepFailed sets the status, anything else is an ERROR.

    Usage: ``with timed_step("import") as step: step.detail = ...``. Unexpected exceptions
    become ERROR with the exception's type and message, never a traceback on the terminal:
    an exception from a backend is exactly the "imports but fails at run time" case.
    """
    step = Step(name)
    start = time.perf_counter()
    try:
        yield step
    except StepFailed as exc:
        step.status = exc.status
        step.detail = exc.detail
        step.hint = exc.hint or step.hint
        step.data.update(exc.data)
    except Exception as exc:  # the probe reports; it never crashes on a backend's error
        step.status = Status.ERROR
        step.detail = one_line(f"{type(exc).__name__}: {exc}")
    finally:
        step.seconds = time.perf_counter() - start


def one_line(text: str, limit: int = 400) -> str:
    """Collapse whitespace so a message fits one table row; cut very long ones."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def exit_code_of(steps: Iterable[Step], require: bool = False, judged: Collection[str] = ()) -> int:
    """The probe's exit code from its steps; ``require`` turns a skip into a failure.

    ``judged`` names the steps whose failure means the backend returned wrong numbers: once one
    has failed (or, as an ERROR, says it did before it stopped: ``data["wrong_data"]``), an
    error after it (the backend then raised or crashed) leaves the code at 1. A backend shown to
    be wrong stays "failed"; the steps keep their own statuses.
    """
    statuses = []
    wrong = False
    for step in steps:
        status = step.status
        judging = step.name in judged
        if status == Status.ERROR and (wrong or (judging and step.data.get("wrong_data"))):
            status = Status.FAIL
        wrong = wrong or (judging and status == Status.FAIL)
        statuses.append(status)
    code = worst(statuses).exit_code
    if require and code == EXIT_SKIPPED:
        return EXIT_FAILED
    return code


def write_json_atomic(path: str | os.PathLike[str], obj: Any, fsync: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` atomically, world-readable and (``fsync``) on disk
    (ep_image/files/records.py): a reader (CI, a dashboard) never sees a half-written report,
    even if the probe is killed."""
    write_json(Path(path), obj, sort_keys=False, default=str, fsync=fsync)


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """The probe's JSON report, written atomically, and one line saying where it went."""
    write_json_atomic(path, report)
    print(f"report: {os.path.abspath(path)}", flush=True)


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < 100 else f"{seconds:.0f}s"


def render_table(
    title: str,
    header_lines: Iterable[str],
    steps: Iterable[Step],
    exit_code: int,
    note: str = "",
) -> str:
    """A compact table in the spirit of DeepEP's test output: one row per step, hints below.

    ``header_lines`` carry the configuration (backend, world size, shape) so a pasted table
    is self-describing; ``note`` follows the verdict on its line (a precondition the backend
    stated, which a user of the verdict must know).
    """
    steps = list(steps)
    lines = [title, *(f"  {line}" for line in header_lines)]
    width = max([len(step.name) for step in steps] + [4])
    lines.append(f"  {'step'.ljust(width)}  {'status':7}  {'time':>7}  detail")
    for step in steps:
        lines.append(
            f"  {step.name.ljust(width)}  {step.status.value:7}  "
            f"{format_seconds(step.seconds):>7}  {step.detail}"
        )
        if step.hint and step.status not in (Status.PASS, Status.INFO, Status.NOT_RUN):
            lines.append(f"  {''.ljust(width)}  {'':7}  {'':>7}  fix: {step.hint}")
    result = f"  result: {RESULT_WORDS.get(exit_code, 'unknown')} (exit {exit_code})"
    lines.append(result + (f"; {note}" if note else ""))
    return "\n".join(lines)


def build_report(
    probe: str,
    steps: Iterable[Step],
    exit_code: int,
    **sections: Any,
) -> dict[str, Any]:
    """The JSON report every probe writes: schema, probe name, sections, steps, verdict."""
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "probe": probe}
    report.update(sections)
    report["steps"] = [step.to_json() for step in steps]
    report["exit_code"] = exit_code
    report["result"] = RESULT_WORDS.get(exit_code, "unknown")
    return report
