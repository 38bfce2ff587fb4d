"""What the programs a test run starts write to the temporary directory stays in one directory,
removed when the run ends.

Why: the tests start torchrun, uv, make_venv and the probes as subprocesses; each leaves files
in the temporary directory it inherits (torchrun a ``torchelastic_*`` directory per launch, uv
its ``uv-*.lock`` files): a run of the suite from a plain shell left about 110 of them in /tmp.
``.ci/run`` points TMPDIR at a directory it removes; this does the same for any pytest run
(README's test line included): at the start, a fresh ``ep-image-tests-*`` directory in the
temporary directory becomes every child's TMPDIR, and the end of the run removes it, passing
or failing. pytest's own temporary directories (``tmp_path``, kept after a failure for
debugging, see _tmp_retention.py) stay where pytest puts them. Loaded by conftest.py (and by
``-p`` in its own test).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

#: Set while a run holds its directory: (the directory, TMPDIR as it was).
_HELD: list[tuple[str, str | None]] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None or _HELD:
        return  # a worker of a distributed run, or already held
    # pytest's own base directory, and this process's tempfile, keep the machine's directory.
    tempfile.gettempdir()
    run_dir = tempfile.mkdtemp(prefix="ep-image-tests-")
    _HELD.append((run_dir, os.environ.get("TMPDIR")))
    os.environ["TMPDIR"] = run_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _HELD:
        return
    run_dir, before = _HELD.pop()
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(run_dir, ignore_errors=True)
