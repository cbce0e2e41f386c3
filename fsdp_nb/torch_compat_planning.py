"""torch's private API for planning memory without allocating it (``sess.plan``): a fake
process group, fake tensors, and FSDP2's memory tracker told where each peak fell.

The rules are ``torch_compat``'s: every use of a private torch name for planning is here,
behind a small function that says what it is for; ``tests/unit/test_torch_compat.py``
calls each one on the supported range's ends; nothing imports torch at import time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["fake_process_group", "fake_tensor_mode", "fsdp_memory_tracker"]


def fake_process_group(rank: int, world_size: int) -> None:
    """Make the default process group a fake one (``"fake"`` backend over torch's
    ``FakeStore``): this process plays ``rank`` of ``world_size`` and collectives return
    at once, moving no data. For a planner process of its own, never an engine."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors made in it have shapes, dtypes and devices, no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@functools.cache
def _peak_tracker() -> type:
    """``FSDPMemTracker`` telling a callback where each new peak fell (its own update of the
    peak, ``_update_peak_stats``, runs after every allocation it counts); made once."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakTracker(FSDPMemTracker):
        def __init__(self, model: Any, optimizer: Any, on_peak: Callable[[set[str], bool], None]) -> None:
            super().__init__(model, optimizer)
            self.on_peak = on_peak

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                self.on_peak(set(self._mod_tracker.parents), bool(self._mod_tracker.is_bw))

    return PeakTracker


def fsdp_memory_tracker(model: Any, optimizer: Any, on_peak: Callable[[set[str], bool], None]) -> Any:
    """torch's ``FSDPMemTracker`` over ``model`` and ``optimizer`` (a context manager):
    bytes by category (``get_tracker_snapshot("peak")``, keyed by ``_FSDPRefType``) of
    every tensor made inside it, fake or real. ``on_peak(modules, backward)`` is told,
    each time the peak rises, the names of the modules running then (the tracker's
    ``"Root.sub.unit"`` names) and whether it was in the backward."""
    return _peak_tracker()(model, optimizer, on_peak)

