"""Bytes of an image in a buildah storage, from the storage's own records.

Why: the image tests and scripts/bench_image.sh both report image footprints; one reader of
containers/storage's ``<driver>-images``/``<driver>-layers`` records keeps their figures the
same. Standard library only (bench_image.sh imports it outside pytest).
"""

from __future__ import annotations

import json
from pathlib import Path


def layer_chain(root: Path, driver: str, tag: str) -> list[dict]:
    """The layer records of the image named ``...tag``, its top layer first."""
    images = json.loads((root / f"{driver}-images" / "images.json").read_text())
    records = json.loads((root / f"{driver}-layers" / "layers.json").read_text())
    layers = {x["id"]: x for x in records}
    entry = next(i for i in images if any(n.endswith(tag) for n in i.get("names") or []))
    chain, layer = [], entry["layer"]
    while layer:
        chain.append(layers[layer])
        layer = layers[layer].get("parent")
    return chain


def image_bytes(root: Path, driver: str, tag: str) -> int:
    """Sum of ``diff-size`` along the layer chain of the image named ``...tag`` (uncompressed,
    each layer once): what the image adds up to, not what ``du`` of one container shows."""
    return sum(layer.get("diff-size") or 0 for layer in layer_chain(root, driver, tag))
