"""``python -m ep_image.build_steps.dedup.books ROOT...``: the books dedup keeps, printed without
changing anything: what the trees hold, counted the way ``du -sxcB1`` counts it (each inode once,
with its blocks), how many inodes the trees share and how many are also linked from outside.

A command of its own in the dedup package: it reads the trees with dedup's walk
(``ep_image.build_steps.dedup.tree``) and links nothing. See docs/host-mode.md, section
"Deduplicating venvs".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps.dedup.tree import Tree, scan


def books(tree: Tree, skipped: Counter[str]) -> dict[str, object]:
    """The walk's figures as dedup's report names them."""
    return {
        "files_scanned": tree.files_scanned,
        "inodes": len(tree.files),
        "inodes_shared_here": sum(inode.here > 1 for inode in tree.files.values()),
        "inodes_linked_outside": sum(inode.linked_outside for inode in tree.files.values()),
        "bytes": tree.apparent_bytes(),
        "du_bytes": tree.du_bytes(),
        "skipped": dict(skipped),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="dedup.books",
        description=(
            "Print what the given trees hold, counted the way `du -sxcB1 ROOT...` counts it: "
            "each inode once, with its blocks; how many inodes are shared by several paths "
            "under the trees and how many are also linked from outside them (uv's cache, "
            "another prefix). These are the books dedup keeps before and after it "
            "links; this command only reads."
        ),
        epilog="Example: python3 -m ep_image.build_steps.dedup.books /opt/venvs/*/",
    )
    parser.add_argument("roots", nargs="+", metavar="ROOT", help="a tree to count")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    resolved = [Path(root).resolve() for root in args.roots]
    for root, path in zip(args.roots, resolved, strict=True):
        if not path.is_dir():
            raise cli.UsageError(f"{root} is not a directory: give existing trees")
    devices = {os.stat(path).st_dev for path in resolved}
    if len(devices) > 1:
        raise cli.UsageError("the ROOTs are on different filesystems: run it once per filesystem")
    roots = [p for p in sorted(set(resolved)) if not any(q in p.parents for q in resolved)]
    skipped: Counter[str] = Counter()
    tree = scan(roots, devices.pop(), None, 0, skipped)
    figures = books(tree, skipped)
    if tree.vanished_roots:
        print(f"dedup.books: gone while counted: {' '.join(tree.vanished_roots)}", file=sys.stderr)
        print("dedup.books: run it again on trees that exist", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    for name, value in figures.items():
        if name != "skipped":
            print(f"{name}: {value}")
    for reason, count in sorted(skipped.items()):
        print(f"not regular files or left out: {reason}: {count}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run("dedup.books", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
