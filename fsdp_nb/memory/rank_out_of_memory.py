"""A rank that ran out of memory: what it holds, by what it is, and freeing what the
failure left behind (engine side of ``fsdp_nb.memory.out_of_memory``).

After a failed allocation the failing frames stay alive in ``sys.last_traceback`` (for
``sess.debug``), and with them the step's activations; FSDP2 keeps the units it had
gathered unsharded. :func:`held` reads what the rank holds at that moment (a
:class:`~fsdp_nb.memory.wire_memory_sample.MemorySample`, as the live view gets them);
:func:`release` drops those frames' locals, reshards every FSDP2 unit (the cut-short
iteration is dropped), collects and empties CUDA's cache, so the next cell runs. Engine
globals (models, optimizers, variables) are untouched.
"""

from __future__ import annotations

import gc
import os
import sys

from ..engine.health import reset_fsdp_iterations
from ..engine.namespace import rank_device
from . import rank_memory_sample as memory_sample
from .rank_memory_kinds import by_kind
from .wire_memory_sample import MemorySample

__all__ = ["held", "release"]


def held(rank: int) -> MemorySample:
    """What rank ``rank`` (this one) holds now, its wrapped models' parameters, gradients
    and optimizer state read afresh (this is the main thread)."""
    return memory_sample.read(rank, by_kind())


def release() -> int:
    """Drop the failing frames' locals (the last failure's traceback), put FSDP2 models
    back between iterations (their gathered units resharded), collect, and empty CUDA's
    cache; the bytes this gave back (CUDA reserved, or resident on CPU)."""
    import psutil

    device = rank_device()
    cuda = memory_sample.cuda_in_use(device)

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
