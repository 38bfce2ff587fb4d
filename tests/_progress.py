"""Progress lines from long tests, shown while pytest captures everything else, and each
failure named when it happens.

Why: a buildah build or a venv sync takes minutes; a CI log that says nothing for that long
cannot be told from a hung job. A test wraps its long step in ``Progress``: the step's own
milestones are printed as they happen, and a background thread repeats the latest one at least
every 50 seconds. The lines go to the terminal even under pytest's output capture, each on a
line of its own (a worker's line would otherwise land inside the controller's line of dots, its
F marks after it). A failed test is named on a line of its own as it fails, not only in the
summary at the end of a 25-minute run. Loaded by conftest.py (the hook).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

import pytest

HEARTBEAT_SECONDS = 50.0


class Progress:
    """``with Progress(config, "label") as p: ... p.say("milestone")``."""

    def __init__(self, config: pytest.Config, label: str) -> None:
        self.capture = config.pluginmanager.get_plugin("capturemanager")
        self.label = label
        self.started = time.monotonic()
        self.last_print = self.started
        self.last_text = "started"
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> Progress:
        self.say("started")
        self.thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop.set()
        self.thread.join()
        self.say("failed" if kind else "done")

    def note(self, text: str) -> None:
        """Remember ``text`` as the latest state; the heartbeat prints it when due."""
        with self.lock:
            self.last_text = text

    def say(self, text: str, remember: bool = True) -> None:
        """Print ``text`` now (and remember it as the latest state)."""
        with self.lock:
            if remember:
                self.last_text = text
            self.last_print = time.monotonic()
            # The leading newline ends whatever line of dots the terminal is in.
            line = f"\n  [{self.label}] {self.last_print - self.started:5.0f}s: {text}"
            if self.capture is None:
                print(line, file=sys.stderr, flush=True)
                return
            with self.capture.global_and_fixture_disabled():
                print(line, file=sys.stderr, flush=True)

    def _beat(self) -> None:
        while not self.stop.wait(5.0):
            if time.monotonic() - self.last_print >= HEARTBEAT_SECONDS:
                self.say(f"still running; last: {self.last_text}", remember=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the process that prints the dots (xdist's controller, or pytest alone): a failure's
    name on a line of its own, as it happens; its traceback stays in the summary."""
    config = _CONFIG.get("config")
    if not report.failed:
        return
    if config is None or getattr(config, "workerinput", None) is not None:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    where = "" if report.when == "call" else f" (in its {report.when})"
    if reporter._tw.width_of_current_line:  # inside a line of dots (xdist's too)
        reporter._tw.line()
    reporter.write_line(f"FAILED {report.nodeid}{where}: its traceback follows at the end")


_CONFIG: dict[str, pytest.Config] = {}


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG["config"] = config
