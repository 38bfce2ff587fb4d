"""What dispatch and combine *should* produce, computed in plain torch from the global routing.

Derived from every rank's inputs alone, never from a backend, so one set of expectations judges
every backend; inputs are chosen so the right answer is exact in bf16. ``inputs`` makes what
each rank sends, ``expected`` what each must get, ``compare`` holds outputs against it, and
``precision`` gives inputs whose answers are not exact, with DeepEP's bounds; the checks read
them all through this package (``reference as ref``). See docs/probes.md, section
"Steps" (the identity columns and "Exact expectations").
"""

from __future__ import annotations

from ep_image.probes.check_ep.reference.compare import (
    DispatchCheck,
    TokenCompare,
    check_dispatch,
    compare_rows,
    compare_tokens,
    describe_tokens,
    dispatch_contract,
    dispatch_wrong,
    per_token_rel_diff,
    rel_diff,
    same_values,
    tensor_contract,
)
from ep_image.probes.check_ep.reference.expected import (
    Expected,
    GlobalRouting,
    decode_ids,
    dense_routing,
    expected_combine,
    expected_for_rank,
    expert_output,
    gather_global,
    gather_uneven,
    name_row,
    row_factor,
    token_scale,
)
from ep_image.probes.check_ep.reference.inputs import (
    TOLERANCE,
    Inputs,
    Router,
    call_factor,
    exact,
    expert_scales,
    id_mask,
    make_inputs,
    mix_seed,
    output_grad,
    payload,
    scale_payload,
    tolerance_for,
    uniform_routing,
    weight_steps,
)
from ep_image.probes.check_ep.reference.precision import (
    COMBINE_BOUND,
    WEIGHTS_BOUND,
    calc_diff,
    contribution,
    expected_sum,
    make_random_inputs,
    random_grad,
)

__all__ = [
    "COMBINE_BOUND",
    "TOLERANCE",
    "WEIGHTS_BOUND",
    "DispatchCheck",
    "Expected",
    "GlobalRouting",
    "Inputs",
    "Router",
    "TokenCompare",
    "calc_diff",
    "call_factor",
    "check_dispatch",
    "compare_rows",
    "compare_tokens",
    "contribution",
    "decode_ids",
    "dense_routing",
    "describe_tokens",
    "dispatch_contract",
    "dispatch_wrong",
    "exact",
    "expected_combine",
    "expected_for_rank",
    "expected_sum",
    "expert_output",
    "expert_scales",
    "gather_global",
    "gather_uneven",
    "id_mask",
    "make_inputs",
    "make_random_inputs",
    "mix_seed",
    "name_row",
    "output_grad",
    "payload",
    "per_token_rel_diff",
    "random_grad",
    "rel_diff",
    "row_factor",
    "same_values",
    "scale_payload",
    "tensor_contract",
    "token_scale",
    "tolerance_for",
    "uniform_routing",
    "weight_steps",
]
