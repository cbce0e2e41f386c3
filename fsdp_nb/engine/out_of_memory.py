"""A rank that ran out of memory: what it holds, by what it is, and freeing what the
failure left behind (engine side of ``fsdp_nb.recovery.out_of_memory``).

After a failed allocation the failing frames stay alive in ``sys.last_traceback`` (for
``sess.debug``), and with them the step's activations; FSDP2 keeps the units it had
gathered unsharded. :func:`held` reads what the rank holds at that moment;
:func:`release` drops those frames' locals, reshards every FSDP2 unit (the cut-short
iteration is dropped), collects and empties CUDA's cache, so the next cell runs. Engine
globals (models, optimizers, variables) are untouched.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from typing import Any

from ..wire.memory_plan import Held
from .health import reset_fsdp_iterations
from .memory_kinds import by_kind
from .namespace import user_ns

__all__ = ["cuda_in_use", "held", "release"]


def cuda_in_use(device: Any = None) -> Any:
    """torch, if this process uses CUDA already (never initialising it from here) and
    ``device`` (if given) is a CUDA device; else None."""
    torch = sys.modules.get("torch")
    if torch is None or (device is not None and device.type != "cuda"):
        return None
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def held() -> Held:
    """What this rank holds now: wrapped models' parameters and gradients, the engine
    globals' optimizer state, and the total (CUDA allocated, or resident on CPU)."""
    import psutil
    import torch

    device = torch.device(user_ns().get("device", "cpu"))
    params, grads, state = by_kind() or (0, 0, 0)
    cuda = cuda_in_use(device)
    if cuda is not None:
        total = int(cuda.cuda.memory_allocated(device))
        limit: int | None = int(cuda.cuda.get_device_properties(device).total_memory)
    else:
        total = int(psutil.Process(os.getpid()).memory_info().rss)
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit = None if soft == resource.RLIM_INFINITY else int(soft)
    return Held("cuda" if cuda is not None else "cpu", params, grads, state, total, limit)


def release() -> int:
    """Drop the failing frames' locals (the last failure's traceback), put FSDP2 models
    back between iterations (their gathered units resharded), collect, and empty CUDA's
    cache; the bytes this gave back (CUDA reserved, or resident on CPU)."""
    import psutil
    import torch

    device = torch.device(user_ns().get("device", "cpu"))
    cuda = cuda_in_use(device)

    def now() -> int:
        if cuda is not None:
            return int(cuda.cuda.memory_reserved(device))
        return int(psutil.Process(os.getpid()).memory_info().rss)

    before = now()
    tb = getattr(sys, "last_traceback", None)
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name != "<module>":  # a cell's module frame holds the user namespace
            try:
                frame.clear()
            except RuntimeError:  # still running (this very call): left alone
                pass
        tb = tb.tb_next
    sys.last_traceback = None
    reset_fsdp_iterations()
    gc.collect()
    if cuda is not None:
        cuda.cuda.empty_cache()
    return max(0, before - now())
