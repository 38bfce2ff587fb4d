"""What a set of directory trees holds, counted the way `du` counts it: the books of dedup.

hardlink's own "Saved" counts an inode still linked from outside the trees as freed; this walk
books each inode once (blocks, links, paths under the trees), so dedup reports what the disk
got back. It also holds what every dedup module shares: the names dedup and hardlink leave in a
tree, and the refusal. See docs/host-mode.md, section "Deduplicating venvs".
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import cli
from ep_image.files import mounts

#: util-linux hardlink links the kept file to "<duplicate>.hardlink-temporary", then renames it
#: over the duplicate (misc-utils/hardlink.c, file_link(), 2.38 to 2.41). A file of that name is
#: a user's like any other unless dedup's record of a run says hardlink made it
#: (leftovers.py).
TEMP_SUFFIX = ".hardlink-temporary"
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
#: dedup --read-only writes the modes it is about to clear here, in each ROOT, before it
#: clears them, and removes the file when the run is done: a run killed in between leaves it,
#: and the next run gives those modes back. Never linked, never counted.
MODES_JOURNAL = ".dedup-read-only-modes.json"
#: dedup writes its record of a run here, in each ROOT, before hardlink runs, and removes it
#: when the run ends: a run killed in between leaves it, and the next run removes the temporary
#: links hardlink left, and only those (leftovers.py). Never linked, never counted.
RUN_JOURNAL = ".dedup-run.json"
#: Every file dedup keeps in a ROOT while it runs (and a ".tmp" of each while it writes one).
JOURNALS = (MODES_JOURNAL, RUN_JOURNAL)
_ERE_SPECIAL = frozenset("\\.^$|?*+()[]{}")
#: dedup's exit code when it refuses before changing anything.
EXIT_REFUSED = 2


class DedupError(cli.FixableError):
    """A reason to refuse the whole run before anything changes (exit code 2); ``fix`` is
    what the user does about it, printed as the last line."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason, fix, EXIT_REFUSED)


@dataclass(slots=True)
class Inode:
    """One regular file's inode as the walk saw it."""

    size: int
    blocks: int  # bytes on disk, st_blocks * 512: what `du -B1` adds for it
    nlink: int  # links anywhere on the filesystem
    mode: int  # permission bits
    uid: int
    gid: int
    path: str  # one of its paths under the trees ("" unless the scan was asked to keep them)
    here: int = 1  # how many of its paths lie under the trees
    candidate: bool = False  # some path of it may be linked (not excluded, not too small)

    @property
    def linked_outside(self) -> bool:
        """True if a path outside the trees links it too (uv's cache, another prefix)."""
        return self.nlink > self.here


@dataclass
class Tree:
    """Everything a walk of the trees found."""

    files: dict[tuple[int, int], Inode] = field(default_factory=dict)
    other_blocks: int = 0  # directories, symlinks, devices: their own blocks, as du counts
    files_scanned: int = 0
    other_filesystems: list[str] = field(default_factory=list)
    timestamp_pyc: str | None = None  # first timestamp-validated .pyc seen, if looked for
    #: path -> (device, inode, links) of every regular file named like hardlink's temporary
    temp_like: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    vanished_roots: list[str] = field(default_factory=list)  # gone before the walk reached them
    #: path -> inode of every file hardlink may link (only when the scan was asked to index)
    index: dict[str, tuple[int, int]] = field(default_factory=dict)

    def apparent_bytes(self) -> int:
        """Sum of file sizes, each inode once."""
        return sum(inode.size for inode in self.files.values())

    def du_bytes(self) -> int:
        """What `du -sxcB1 ROOT...` prints as its total: blocks of every inode, once."""
        return self.other_blocks + sum(inode.blocks for inode in self.files.values())


def read_own_journal(journal: Path) -> tuple[str | None, str]:
    """Why a journal of dedup's may not be acted on (or None), and its text.

    It is opened once, without following a symbolic link, and checked and read through that one
    descriptor (a journal swapped for a link between a check by path and a read by path would
    get another file's entries read): it must be a regular file of the user running dedup that
    nobody else can write, as dedup writes it. Acting on one anyone could write (run as root,
    say) would let them have modes given back or files removed where they choose.
    FileNotFoundError when there is none.
    """
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            return "it is a symbolic link", ""
        raise
    with open(fd, encoding="utf-8") as handle:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "it is not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        elif st.st_mode & 0o022:
            why = f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
        return why, "" if why else handle.read()


def write_own_journal(journal: Path, record: dict[str, object]) -> None:
    """``journal`` on disk, owner-only and whole (a new temporary file, fsync, rename), as
    read_own_journal trusts it; OSError as it comes."""
    temp = journal.with_name(journal.name + ".tmp")
    try:
        temp.unlink(missing_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, journal)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def glob_to_regex(pattern: str) -> str:
    """A dedup exclude pattern (fnmatch) as a POSIX extended regex over an absolute path.

    A pattern without "/" matches the file name, one with "/" the path's last components:
    ``bin/activate*`` becomes ``/bin/activate[^/]*$``. The result means the same to Python's
    `re` and to hardlink's regcomp(REG_EXTENDED): only ``[^/]``, brackets and escapes are used.
    """
    out: list[str] = ["/"]
    i, body = 0, pattern.lstrip("/")
    while i < len(body):
        char = body[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in body[i + 2 :]:
            end = body.index("]", i + 2)
            inner = body[i + 1 : end]
            out.append("[" + ("^" + inner[1:] if inner.startswith("!") else inner) + "]")
            i = end
        else:
            out.append("\\" + char if char in _ERE_SPECIAL else char)
        i += 1
    return "".join(out) + "$"


def literal_regex(path: str) -> str:
    """A POSIX extended regex matching ``path`` and everything below it."""
    return "^" + _ere_literal(path) + "(/|$)"


def paths_regexes(paths: Iterable[str], chunk: int = 100_000) -> list[str]:
    """POSIX extended regexes that match exactly ``paths`` (absolute), each at most ``chunk``
    characters (an argument of a command line may hold 128 KiB).

    One regex per path would cost hardlink a regexec per file and per regex (1,000 of them
    over 40,000 files: 31 s); names grouped by directory into alternations cost next to
    nothing (20,000 paths: 1 s).
    """
    by_dir: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        directory, _, name = path.rpartition("/")
        by_dir.setdefault(directory, []).append(name)
    pieces: list[str] = []
    for directory, names in by_dir.items():
        head = "^" + _ere_literal(directory) + "/("
        group: list[str] = []
        for name in names:
            if group and len(head) + sum(len(g) + 1 for g in group) + len(name) + 3 > chunk:
                pieces.append(head + "|".join(group) + ")$")
                group = []
            group.append(_ere_literal(name))
        pieces.append(head + "|".join(group) + ")$")
    regexes: list[str] = []
    for piece in pieces:
        if regexes and len(regexes[-1]) + 1 + len(piece) <= chunk:
            regexes[-1] += "|" + piece
        else:
            regexes.append(piece)
    return regexes


def _ere_literal(text: str) -> str:
    return "".join("\\" + c if c in _ERE_SPECIAL else c for c in text)


def timestamp_validated(pyc: str) -> bool:
    """True if ``pyc`` is validated by its source's mtime (PEP 552 flags word 0).

    Such a .pyc is valid only while its source keeps the mtime it records; a hash-checked one
    (make_venv.py's, or anything compiled with SOURCE_DATE_EPOCH set) is valid whatever it is.
    """
    try:
        with open(pyc, "rb") as handle:
            header = handle.read(16)
    except OSError:
        return False
    return len(header) == 16 and int.from_bytes(header[4:8], "little") == 0


def scan(
    roots: Iterable[Path],
    device: int,
    exclude: re.Pattern[str] | None,
    min_size: int,
    skipped: Counter[str],
    *,
    find_timestamp_pyc: bool = False,
    keep_paths: bool = False,
    index_paths: bool = False,
) -> Tree:
    """Walk ``roots`` like ``find -xdev`` (lstat, no symlink followed) and book every inode.

    A path that vanishes while it is walked is counted in ``skipped`` and left out, never an
    error: the trees are not ours alone while we look at them. A root that is gone is listed
    in ``vanished_roots``. dedup's journal of modes (MODES_JOURNAL) in a root is skipped.
    """
    tree = Tree()
    table = mounts.mounts()
    for root in roots:
        try:
            tree.other_blocks += os.lstat(root).st_blocks * 512
        except FileNotFoundError:
            tree.vanished_roots.append(str(root))
            continue
        journals = {os.path.join(root, n + t) for n in JOURNALS for t in ("", ".tmp")}
        # Mount points inside a ROOT hold another tree (a bind mount of the same file system
        # has the same device): hardlink cannot link across them, like ``find -xdev``.
        mounted = set(mounts.inside(root, table))
        stack = [str(root)]
        while stack:
            directory = stack.pop()
            try:
                with os.scandir(directory) as entries:
                    listed = list(entries)
            except FileNotFoundError:
                skipped["vanished during the scan"] += 1
                continue
            except OSError:
                skipped["directories that cannot be listed"] += 1
                continue
            in_pycache = os.path.basename(directory) == "__pycache__"
            for entry in listed:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    skipped["vanished during the scan"] += 1
                    continue
                if stat.S_ISREG(st.st_mode):
                    if entry.path in journals:
                        continue
                    if entry.name.endswith(TEMP_SUFFIX):
                        tree.temp_like[entry.path] = (st.st_dev, st.st_ino, st.st_nlink)
                    booked = _book_file(
                        tree, entry.path, st, exclude, min_size, skipped, keep_paths
                    )
                    if index_paths and booked:
                        tree.index[entry.path] = (st.st_dev, st.st_ino)
                    if (
                        find_timestamp_pyc
                        and tree.timestamp_pyc is None
                        and in_pycache
                        and entry.name.endswith(".pyc")
                        and timestamp_validated(entry.path)
                    ):
                        tree.timestamp_pyc = entry.path
                    continue
                if stat.S_ISDIR(st.st_mode) and (st.st_dev != device or entry.path in mounted):
                    tree.other_filesystems.append(entry.path)
                    skipped["directories on another filesystem (not descended)"] += 1
                    continue
                tree.other_blocks += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif stat.S_ISLNK(st.st_mode):
                    skipped["symlinks"] += 1
                else:
                    skipped["devices, sockets, fifos"] += 1
    return tree


def _book_file(
    tree: Tree,
    path: str,
    st: os.stat_result,
    exclude: re.Pattern[str] | None,
    min_size: int,
    skipped: Counter[str],
    keep_path: bool,
) -> bool:
    """Book one regular file; True if hardlink may link this path (not excluded, not small)."""
    tree.files_scanned += 1
    if exclude is not None and exclude.search(path):
        skipped["excluded (rewritten in place by tools)"] += 1
        candidate = False
    elif st.st_size < min_size:
        skipped[f"smaller than --min-size {min_size}"] += 1
        candidate = False
    else:
        candidate = True
    key = (st.st_dev, st.st_ino)
    inode = tree.files.get(key)
    if inode is None:
        tree.files[key] = Inode(
            size=st.st_size,
            blocks=st.st_blocks * 512,
            nlink=st.st_nlink,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            path=path if keep_path else "",
            candidate=candidate,
        )
    else:
        inode.here += 1
        inode.candidate = inode.candidate or candidate
    return candidate
