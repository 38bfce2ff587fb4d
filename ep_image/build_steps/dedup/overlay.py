"""dedup on overlayfs (container builds and their layers): which files lie in the layer being
written, which must be left alone, and what that layer gained.

Why a module of its own: ``du`` of an overlay's merged view counts every layer, while the layer
being built holds only its upper directory. Linking a file of a lower layer, or changing its
mode, copies it up whole: the layer grows by its size while ``du`` says it shrank. So where the
upper directory is visible, only files of this layer are linked and the layer is measured
there; where it is not (inside a container build it is a path of the host), the file system
under the layer is measured by its free space and the report says so. util-linux hardlink's
``--respect-xattrs`` aborts on copied-up files (overlayfs reports the size of attribute names
it then does not list), so on overlayfs dedup compares attributes itself.
docs/host-mode.md, "Deduplicating venvs".
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ep_image.build_steps.dedup.tree import DedupError, Tree, literal_regex, paths_regexes, scan
from ep_image.files import mounts

#: The --exclude regexes of what must be left alone may not pass this (a command line holds
#: about 2 MiB in all).
EXCLUDE_REGEX_LIMIT = 1 << 20
#: The reasons the report gives for what it left alone.
LOWER = "in a lower layer of the overlay (linking it copies it up: the layer would grow)"
XATTRS = "extended attributes on overlayfs (hardlink cannot compare them there)"


@dataclass
class Layer:
    """The overlay the ROOTs are on, and its upper directory where this process can see it."""

    mount_point: str
    upper: str | None
    figures: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "mount_point": self.mount_point,
            "upper": self.upper,
            "measured_by": "du of the upper directory" if self.upper else "free space",
            **self.figures,
        }

    def upper_path(self, path: str) -> str:
        """Where ``path`` of the merged view lies in the upper directory (visible only)."""
        assert self.upper is not None
        return os.path.join(self.upper, os.path.relpath(path, self.mount_point))


def layer_of(root: Path) -> Layer | None:
    """The overlay holding ``root`` (None: not overlayfs)."""
    mount = mounts.mount_of(root)
    if mount is None or mount.fstype != "overlay":
        return None
    return Layer(mount.mount_point, _visible_upper(mount, root))


def _visible_upper(mount: mounts.Mount, root: Path) -> str | None:
    """The mount's upper directory, if the path mountinfo names is that directory here: a file
    made in ``root`` (a new file always goes to the upper layer) must appear there, the same
    inode. Made and removed at once; ``root``'s times are put back."""
    upper = mount.option("upperdir")
    if not upper or not os.path.isdir(upper) or mount.root != "/":
        return None
    times = os.stat(root)
    try:
        fd, probe = tempfile.mkstemp(prefix=".dedup-overlay-probe-", dir=root)
    except OSError:
        return None
    try:
        inode = os.fstat(fd).st_ino
        there = os.path.join(upper, os.path.relpath(os.path.realpath(probe), mount.mount_point))
        seen = os.lstat(there)
        visible = stat.S_ISREG(seen.st_mode) and seen.st_ino == inode
    except OSError:
        visible = False
    finally:
        os.close(fd)
        os.unlink(probe)
        os.utime(root, ns=(times.st_atime_ns, times.st_mtime_ns))
    return upper if visible else None


def _in_upper(path: str) -> str | None:
    """ "file", "dir" or None: what the upper directory holds at ``path`` (a whiteout, a
    metacopy whose data is still in a lower layer, or nothing: None)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        os.getxattr(path, "trusted.overlay.metacopy", follow_symlinks=False)
    except OSError as exc:
        return "file" if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EPERM) else None
    return None  # metadata only: the bytes are a lower layer's


@dataclass
class LeftAlone:
    """What hardlink must not touch on overlayfs: its --exclude regexes and the report's counts."""

    regexes: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


def leave_alone(tree: Tree, layer: Layer, roots: list[Path]) -> LeftAlone:
    """Mark as no candidate (never linked, never made read-only) every file of a lower layer
    and every file with extended attributes, and return the regexes that keep hardlink off
    them: a directory only in lower layers as one regex, other files one by one."""
    left = LeftAlone()
    dirs: set[str] = set()
    files: list[str] = []
    top = {str(r) for r in roots}
    known: dict[str, str | None] = {}
    for path, key in list(tree.index.items()):
        reason = None
        if layer.upper is not None and _in_upper(layer.upper_path(path)) != "file":
            reason = LOWER
            below = _lowest_lower_dir(path, layer, top, known)
            if below is not None:
                dirs.add(below)
            else:
                files.append(path)
        elif _has_xattrs(path):
            reason = XATTRS
            files.append(path)
        if reason is not None:
            left.counts[reason] += 1
            tree.files[key].candidate = False
            del tree.index[path]
    for directory in sorted(dirs):
        if not any(directory.startswith(d + "/") for d in dirs):
            left.regexes.append(literal_regex(directory))
    left.regexes += paths_regexes(files)
    if sum(map(len, left.regexes)) > EXCLUDE_REGEX_LIMIT:
        raise DedupError(
            f"{len(files)} files of the ROOTs lie in lower layers of the overlay at "
            f"{layer.mount_point}, scattered among this layer's: too many to keep apart "
            "(hardlink takes them as --exclude arguments), and linking them would copy them "
            "into this layer. Nothing was changed.",
            "run dedup in the build step (layer) that writes the files, or on the trees "
            "outside the container",
        )
    return left


def _lowest_lower_dir(
    path: str, layer: Layer, top: set[str], known: dict[str, str | None]
) -> str | None:
    """The outermost directory above ``path`` (below its ROOT) that only lower layers hold,
    or None when its own directory is in the upper layer too (a merged directory)."""
    parents = []
    directory = os.path.dirname(path)
    while directory not in top and directory != os.path.dirname(directory):
        parents.append(directory)
        directory = os.path.dirname(directory)
    for directory in reversed(parents):  # outermost first
        if directory not in known:
            known[directory] = _in_upper(layer.upper_path(directory))
        if known[directory] != "dir":
            return directory
    return None


def _has_xattrs(path: str) -> bool:
    try:
        return bool(os.listxattr(path, follow_symlinks=False))
    except OSError:
        return False


def measure(layer: Layer, roots: list[Path]) -> int:
    """What the layer holds of the ROOTs: ``du`` of their part of the upper directory where it
    is visible, else the bytes used on the file system under the layer (free space: other
    writers there move it too)."""
    if layer.upper is None:
        st = os.statvfs(roots[0])
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    uppers = [Path(layer.upper_path(str(r))) for r in roots]
    device = os.stat(layer.upper).st_dev
    return scan(uppers, device, None, 0, Counter()).du_bytes()
