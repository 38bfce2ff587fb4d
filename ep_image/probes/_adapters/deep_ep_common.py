"""What the DeepEP adapters share: importing ``deep_ep``, the facts of the module, and a handle
that remembers how many received rows are real.

Written against DeepEP's public Python APIs:
  v1: deep_ep/buffer.py at 567632dd (tokenspeed-deepep 1.2.1 ships the same file)
  v2: deep_ep/buffers/elastic.py at af9a0403 and sgl-deep-ep 0.1.2.post1
  HybridEP: deep_ep/hybrid_ep_buffer.py at e0a5b1d9 (hybrid-ep branch)
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch


def import_deep_ep() -> Any:
    return importlib.import_module("deep_ep")


def module_facts(deep_ep: Any) -> dict[str, Any]:
    return {
        "module_path": getattr(deep_ep, "__file__", None),
        "module_version": getattr(deep_ep, "__version__", None),
    }


@dataclasses.dataclass
class RowsHandle:
    """A backend handle plus the number of valid received rows and the padded row count."""

    raw: Any
    rows: int
    padded_rows: int


def pad_rows(y: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if y.shape[0] == padded_rows:
        return y
    full = y.new_zeros((padded_rows, *y.shape[1:]))
    full[: y.shape[0]] = y
    return full
