"""What this rank holds, read: the one producer of
:class:`~fsdp_nb.memory.wire_memory_sample.MemorySample`, and the rule for what a rank may hold.

:func:`read` is called from the memory sampler's thread once per interval and, after an
allocation failed, on the main thread: the process's resident set and its peak, CUDA's
allocator (only where this process already uses CUDA: never initialising it from here),
and what the wrapped models and the optimizers hold by kind, as the caller has it
(``memory_kinds``: read on the main thread only). :func:`device_budget` is the one rule
for what a rank may hold, which the samples, the plans (``sess.plan``, ``fsdp_nb.plan``)
and the out-of-memory errors all measure against.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time
from typing import Any

from ..engine.namespace import rank_device, ranks_on_host
from .wire_memory_sample import MemorySample

__all__ = ["cuda_in_use", "device_budget", "peak_resident", "rank_budget", "read", "reset_peak_resident"]


def cuda_in_use(device: Any = None) -> Any:
    """torch, if this process uses CUDA already (never initialising it from here) and
    ``device`` (if given) is a CUDA device; else None."""
    torch = sys.modules.get("torch")
    if torch is None or (device is not None and torch.device(device).type != "cuda"):
        return None
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def device_budget(device: str, ranks: int) -> int | None:
    """Bytes one rank may hold on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``): the
    GPU's total memory (None where this process sees no GPU), or on CPU this host's RAM
    shared by the ``ranks`` on it, and no more than the address-space limit
    (``RLIMIT_AS``) where one is set on this process."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.device(device).index
        return int(torch.cuda.get_device_properties(0 if index is None else index).total_memory)
    share = _host_ram() // max(1, ranks)
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return share if soft == resource.RLIM_INFINITY else min(share, int(soft))


def rank_budget() -> tuple[str, int | None]:
    """(device type, bytes this rank may hold): :func:`device_budget` of this rank's device
    and the ranks on its host."""
    device = rank_device()
    return device.split(":")[0], device_budget(device, ranks_on_host())


@functools.cache
def _host_ram() -> int:
    """This host's RAM, in bytes (read once: a sampler asks at every sample)."""
    import psutil

    return int(psutil.virtual_memory().total)


def peak_resident() -> int:
    """This process's peak resident set, in bytes: ``VmHWM`` (which
    :func:`reset_peak_resident` restarts), or ``ru_maxrss`` off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_resident() -> None:
    """Start the peak resident set afresh: first hand the allocator's free pages back
    (glibc's ``malloc_trim``; a process that freed memory keeps it resident, and a step
    would reuse it unseen), then ``5`` to ``clear_refs`` (Linux; elsewhere nothing)."""
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def read(rank: int, kinds: tuple[int, int, int] | None, *, seq: int = 0, process: Any = None,
         copies: int | None = None) -> MemorySample:
    """What this rank holds now.

    Args:
        rank: the rank, written in the sample.
        kinds: (parameters and buffers, gradients, optimizer state) bytes, as
            ``memory_kinds`` read them on the main thread; None before a model is wrapped.
        seq: the sample's number within its sampler.
        process: this process's ``psutil.Process`` (a sampler keeps one; default: a new one).
        copies: host bytes the in-memory autosave's copies hold here (None: none).
    """
    import psutil

    device = rank_device()
    proc = process or psutil.Process(os.getpid())
    rss = int(proc.memory_info().rss)
    allocated = reserved = peak = None
    torch = cuda_in_use(device)
    if torch is not None:
        dev = torch.device(device)
        allocated, reserved = int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev))
        peak = int(torch.cuda.max_memory_allocated(dev))
    # measured against what it is measured in: the GPU's memory once this rank uses CUDA (asked
    # only then: the device's properties would initialise CUDA), else its share of the host's RAM
    budget = device_budget(device if torch is not None else "cpu", ranks_on_host())
    params, grads, state = kinds if kinds is not None else (None, None, None)
    return MemorySample(rank=rank, t=time.time(), device=device, resident=rss,
                        resident_peak=max(peak_resident(), rss), budget=budget,
                        device_allocated=allocated, device_reserved=reserved, device_peak=peak,
                        parameters=params, gradients=grads, optimizer=state, seq=seq, copies=copies)
