"""Faults injected into real processes at exact moments, through a preloaded C shim.

Why: dedup.py's hazards happen between two system calls of another program (util-linux
hardlink): a file deleted after the walk saw it, a kill between the temporary link and the
rename. A sleep-and-hope test would pass or fail by luck, and a mock would test nothing. The
shim wraps libc's open and rename family in every process that inherits ``LD_PRELOAD``
(Python and hardlink alike) and acts on the exact call:

- ``EP_FAULT_UNLINK_ON_OPEN=SUFFIX:VICTIM``: the first open of a path ending in SUFFIX first
  unlinks VICTIM (as if another process deleted it at that moment);
- ``EP_FAULT_KILL_AT_RENAME=N``: the process kills itself with SIGKILL at its (N+1)th rename,
  before the rename happens (after hardlink made ``X.hardlink-temporary``, before it replaced X).

Built with gcc on first use (gcc is on the CI machines; the test skips, naming it, where not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void fault_on_open(const char *path) {
    static int done = 0;
    const char *spec = getenv("EP_FAULT_UNLINK_ON_OPEN");
    const char *colon = spec ? strchr(spec, ':') : NULL;
    if (done || !colon || !path) return;
    size_t want = (size_t)(colon - spec), have = strlen(path);
    if (have >= want && memcmp(path + have - want, spec, want) == 0) {
        done = 1;
        unlink(colon + 1);
    }
}

static void fault_on_rename(void) {
    static long seen = 0;
    const char *spec = getenv("EP_FAULT_KILL_AT_RENAME");
    if (spec && seen++ == atol(spec)) raise(SIGKILL);
}

#define MODE_ARG(flags) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { \
        va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); \
    }

#define WRAP_OPEN(name) \
    int name(const char *path, int flags, ...) { \
        static int (*real)(const char *, int, ...); \
        MODE_ARG(flags) \
        if (!real) real = dlsym(RTLD_NEXT, #name); \
        fault_on_open(path); \
        return real(path, flags, mode); \
    }

#define WRAP_OPENAT(name) \
    int name(int dirfd, const char *path, int flags, ...) { \
        static int (*real)(int, const char *, int, ...); \
        MODE_ARG(flags) \
        if (!real) real = dlsym(RTLD_NEXT, #name); \
        fault_on_open(path); \
        return real(dirfd, path, flags, mode); \
    }

WRAP_OPEN(open)
WRAP_OPEN(open64)
WRAP_OPENAT(openat)
WRAP_OPENAT(openat64)

int rename(const char *from, const char *to) {
    static int (*real)(const char *, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "rename");
    fault_on_rename();
    return real(from, to);
}

int renameat(int fd1, const char *from, int fd2, const char *to) {
    static int (*real)(int, const char *, int, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "renameat");
    fault_on_rename();
    return real(fd1, from, fd2, to);
}

int renameat2(int fd1, const char *from, int fd2, const char *to, unsigned int flags) {
    static int (*real)(int, const char *, int, const char *, unsigned int);
    if (!real) real = dlsym(RTLD_NEXT, "renameat2");
    fault_on_rename();
    return real(fd1, from, fd2, to, flags);
}
"""


def build_shim(directory: Path) -> Path | None:
    """Compile the shim into ``directory``; None where no C compiler is found."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    source = directory / "fault_shim.c"
    library = directory / "fault_shim.so"
    source.write_text(SHIM_SOURCE)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source), "-ldl"],
        check=True,
        capture_output=True,
    )
    return library


def faulty_env(shim: Path, **faults: str) -> dict[str, str]:
    """os.environ with the shim preloaded and the given EP_FAULT_* settings."""
    return {**os.environ, "LD_PRELOAD": str(shim), **faults}
