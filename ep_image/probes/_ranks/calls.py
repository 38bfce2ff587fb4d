"""Each call into the backend leaves a breadcrumb: which call, and how many came before it.

Why this module exists: a rank that hangs or stalls is reported with the step it was in; inside
a step, the backend call it never returned from is what its user needs to look at (and what
a stack from native code does not say in the backend's own words). Every rank makes the same
calls in the same order, so the numbers also tell a rank waiting in a call from peers that
returned from it without it (``stall.stalled_in_call``).
"""

from __future__ import annotations

import functools
from typing import Any

from ep_image.probes import _supervise

#: The EPBackend methods that reach the backend (``_adapters/base.py``).
CALLS = (
    "create",
    "dispatch",
    "combine",
    "dispatch_cached",
    "dispatch_backward",
    "combine_backward",
    "dispatch_backward_with_weights",
    "destroy",
)


def track_calls(backend: Any) -> Any:
    """Wrap ``backend``'s calls (on the instance) so that each leaves ``call`` ("dispatch, call
    #12": its 12th call into the backend) in the breadcrumb while it runs, and the count of
    calls returned after it; a call made inside another (an adapter whose backward is its
    combine) keeps the outer one's name. Returns ``backend``."""
    depth = [0]
    count = [0]

    def wrap(name: str, method: Any) -> Any:
        @functools.wraps(method)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            outer = depth[0] == 0
            if outer:
                count[0] += 1
                number = count[0]
                _supervise.progress.mark_call(name, number)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if outer:
                    _supervise.progress.mark_return(number)

        return tracked

    for name in CALLS:
        method = getattr(backend, name, None)
        if callable(method):
            setattr(backend, name, wrap(name, method))
    return backend
