"""One routing dispatched twice through a real backend, another routing in between (activation
checkpointing's recompute), compared row by row: what a second dispatch changes.

Why: check_train reported DeepEP v2's recompute as "the rows of its forward in another order"
(H100) and "other rows" (H200, its default shape). Whether that is legal depends on what moved:
whole rows (a new order), the top-k slots inside a row, the weights' bits, or the tokens
themselves. Each token's id is written exactly into its first two columns, so every received row
names its token. One rank, on the GPU; prints one JSON object.

    python recompute_order.py BACKEND [TOKENS HIDDEN EXPERTS TOPK]   (check_train's GPU shape)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes._adapters.base import Shape
from ep_image.probes._adapters.plugins import BUILTIN


def routing(tokens: int, experts: int, topk: int, seed: int, device: Any) -> tuple[Any, Any]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, idx = scores.topk(topk, dim=1)
    return idx.to(device), (weights / weights.sum(1, keepdim=True)).float().to(device)


def payload(tokens: int, hidden: int, device: Any) -> torch.Tensor:
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
    ids = torch.arange(tokens)
    x[:, 0] = (ids % 256).bfloat16()  # integers below 256 are exact in bf16
    x[:, 1] = (ids // 256).bfloat16()
    return x.to(device)


def rows_of(d: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(token id, top-k local indices, weights' bits) of every received row, in order."""
    ids = (d.recv_x[:, 0].float() + 256 * d.recv_x[:, 1].float()).long().tolist()
    idx = d.recv_topk_idx.long().tolist()
    bits = d.recv_topk_weights.float().contiguous().view(torch.int32).tolist()
    return [(t, tuple(i), tuple(w)) for t, i, w in zip(ids, idx, bits, strict=True)]


def compare(first: list, again: list) -> dict[str, Any]:
    by_token = {r[0]: r for r in first}
    same_position = sum(a == b for a, b in zip(first, again, strict=False))
    tokens_equal = Counter(r[0] for r in first) == Counter(r[0] for r in again)
    slots_reordered = weights_changed = experts_changed = 0
    for token, idx, bits in again:
        was = by_token.get(token)
        if was is None:
            continue
        if was[1] != idx or was[2] != bits:
            if sorted(zip(was[1], was[2], strict=True)) == sorted(zip(idx, bits, strict=True)):
                slots_reordered += 1
            elif sorted(was[1]) != sorted(idx):
                experts_changed += 1
            else:
                weights_changed += 1
    return {
        "rows": [len(first), len(again)],
        "same_tokens": tokens_equal,
        "rows_in_the_same_position": same_position,
        "rows_with_slots_reordered": slots_reordered,
        "rows_with_other_experts": experts_changed,
        "rows_with_other_weight_bits": weights_changed,
        "identical": first == again,
    }


def main() -> int:
    name = sys.argv[1]
    tokens, hidden, experts, topk = (int(a) for a in (sys.argv[2:6] or (4096, 1024, 32, 4)))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1, device_id=device
    )
    backend = BUILTIN[name]()
    backend.load()
    shape = Shape(tokens, hidden, experts, topk, torch.bfloat16, device)
    backend.create(dist.group.WORLD, shape)
    x = payload(tokens, hidden, device)
    results = []
    for trial in range(3):
        idx_a, w_a = routing(tokens, experts, topk, 100 + trial, device)
        idx_b, w_b = routing(tokens, experts, topk, 200 + trial, device)
        first = rows_of(backend.dispatch(x, idx_a, w_a))
        backend.dispatch(x, idx_b, w_b)  # a later layer's routing through the same buffer
        again = rows_of(backend.dispatch(x, idx_a, w_a))
        immediately = rows_of(backend.dispatch(x, idx_a, w_a))
        after = compare(first, again)
        results.append(
            {"after_another_routing": after, "twice_in_a_row": compare(again, immediately)}
        )
    backend.destroy()
    dist.destroy_process_group()
    print(json.dumps({"backend": name, "shape": [tokens, hidden, experts, topk],
                      "trials": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
