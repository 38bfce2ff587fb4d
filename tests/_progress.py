"""Progress lines from long tests, shown while pytest captures everything else.

Why: a buildah build or a venv sync takes minutes; a CI log that says nothing for that long
cannot be told from a hung job. A test wraps its long step in ``Progress``: the step's own
milestones are printed as they happen, and a background thread repeats the latest one at least
every 50 seconds. The lines go to the terminal even under pytest's output capture.
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
            line = f"  [{self.label}] {self.last_print - self.started:5.0f}s: {text}"
            if self.capture is None:
                print(line, file=sys.stderr, flush=True)
                return
            with self.capture.global_and_fixture_disabled():
                print(line, file=sys.stderr, flush=True)

    def _beat(self) -> None:
        while not self.stop.wait(5.0):
            if time.monotonic() - self.last_print >= HEARTBEAT_SECONDS:
                self.say(f"still running; last: {self.last_text}", remember=False)
