"""check_te's numeric checks: TE's fused attention and ``te.Linear``, forward and backward,
against plain torch in fp32 on the GPU.

Why its own module: only these steps need a GPU and TE loaded, and only they show at run time
what a cuDNN other than TE's build breaks (fused attention, its backward above all).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ep_image.probes._report import Status, Step, StepFailed, one_line, timed_step

#: Only TE's fused (cuDNN) attention backend may run: the one the cuDNN mismatch breaks.
FUSED_ONLY_ENV = {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
#: Relative difference (||out - ref|| / ||ref||) accepted against fp32 torch.
ATTN_FWD_TOL = 2e-2
ATTN_BWD_TOL = 5e-2
LINEAR_TOL = 2e-2


def _need_gpu(name: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise StepFailed(Status.SKIP, f"{name} needs a GPU", "no GPU visible: run on a GPU node")


@contextmanager
def _te_call(what: str) -> Iterator[None]:
    """Run a TE call; an exception is "unusable" (3), naming the call and, for cuDNN, the fix."""
    try:
        yield
    except StepFailed:
        raise
    except Exception as exc:
        text = one_line(f"{type(exc).__name__}: {exc}")
        hint = ""
        if "cudnn" in text.lower():
            hint = (
                "TE failed inside cuDNN: make the cudnn step pass (one libcudnn loaded, the one "
                "TE was built against; its sub-libraries come from the same directory), or "
                "rebuild TE against the loaded cuDNN with python3 scripts/build_te.py"
            )
        raise StepFailed(Status.ERROR, f"{what} raised {text}", hint) from None


def _rel(out: Any, ref: Any) -> float:
    out, ref = out.detach(), ref.detach()
    ref64 = ref.double()
    denom = float(ref64.norm())
    num = float((out.double() - ref64).norm())
    return num / denom if denom > 0 else num


def step_fused_attention(te: Any, args: argparse.Namespace) -> Step:
    """Fused (cuDNN) attention, causal, bf16: forward and backward against fp32 SDPA."""
    with timed_step("fused_attention") as step:
        _need_gpu("fused attention")
        import torch
        import torch.nn.functional as F

        torch.manual_seed(args.seed)
        b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
        dev = torch.device("cuda")
        q, k, v = (
            torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)
        )
        attn = te.DotProductAttention(
            num_attention_heads=h,
            kv_channels=d,
            attn_mask_type="causal",
            qkv_format="bshd",
            attention_dropout=0.0,
        )
        with _te_call("fused attention forward"):
            out = attn(q, k, v)  # [b, s, h*d]
            torch.cuda.synchronize()
        grad = torch.randn_like(out)
        with _te_call("fused attention backward"):
            out.backward(grad)
            torch.cuda.synchronize()

        qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)  # [b, h, s, d]
        ref = ref.transpose(1, 2).reshape(b, s, h * d)
        ref.backward(grad.float())
        diffs = {
            "out": _rel(out.float(), ref),
            "dq": _rel(q.grad.float(), qf.grad.transpose(1, 2)),
            "dk": _rel(k.grad.float(), kf.grad.transpose(1, 2)),
            "dv": _rel(v.grad.float(), vf.grad.transpose(1, 2)),
        }
        step.data = {
            "shape_bshd": [b, s, h, d],
            "rel_diff": diffs,
            "tolerance": {"forward": ATTN_FWD_TOL, "backward": ATTN_BWD_TOL},
            "backend_env": FUSED_ONLY_ENV,
        }
        bad = [
            f"{name} {value:.3g}"
            for name, value in diffs.items()
            if not value <= (ATTN_FWD_TOL if name == "out" else ATTN_BWD_TOL)
        ]
        if bad:
            raise StepFailed(
                Status.FAIL,
                f"fused attention differs from fp32 SDPA: {', '.join(bad)} (limits "
                f"{ATTN_FWD_TOL:g} forward, {ATTN_BWD_TOL:g} backward)",
                "TE's fused attention computes wrong values with this cuDNN: rebuild TE "
                "against the loaded cuDNN (python3 scripts/build_te.py)",
                step.data,
            )
        step.detail = (
            f"bf16 causal {b}x{s}x{h}x{d}, fused backend only: rel diff out "
            f"{diffs['out']:.2g}, dq {diffs['dq']:.2g}, dk {diffs['dk']:.2g}, dv {diffs['dv']:.2g}"
        )
    return step


def step_linear(te: Any, args: argparse.Namespace) -> Step:
    """te.Linear in bf16, forward and backward, against F.linear in fp32."""
    with timed_step("linear") as step:
        _need_gpu("TE Linear")
        import torch
        import torch.nn.functional as F

        torch.manual_seed(args.seed + 1)
        n = args.features
        layer = te.Linear(n, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(args.seq, n, device="cuda", dtype=torch.bfloat16).requires_grad_()
        with _te_call("te.Linear forward"):
            y = layer(x)
            torch.cuda.synchronize()
        grad = torch.randn_like(y)
        with _te_call("te.Linear backward"):
            y.backward(grad)
            torch.cuda.synchronize()

        w = layer.weight.detach().float().requires_grad_()
        bias = layer.bias.detach().float().requires_grad_()
        xf = x.detach().float().requires_grad_()
        ref = F.linear(xf, w, bias)
        ref.backward(grad.float())
        diffs = {
            "out": _rel(y.float(), ref),
            "dx": _rel(x.grad.float(), xf.grad),
            "dw": _rel(layer.weight.grad.float(), w.grad),
            "db": _rel(layer.bias.grad.float(), bias.grad),
        }
        step.data = {"features": n, "tokens": args.seq, "rel_diff": diffs, "tolerance": LINEAR_TOL}
        bad = [f"{k} {v:.3g}" for k, v in diffs.items() if not v <= LINEAR_TOL]
        if bad:
            raise StepFailed(
                Status.FAIL,
                f"te.Linear differs from fp32 F.linear: {', '.join(bad)} (limit {LINEAR_TOL:g})",
                "TE's GEMM path is broken in this environment (cuBLAS/TE build mismatch)",
                step.data,
            )
        step.detail = (
            "bf16 {n}x{n}: rel diff out {out:.2g}, dx {dx:.2g}, dw {dw:.2g}, db {db:.2g}".format(
                n=n, **diffs
            )
        )
    return step
