"""What one rank holds at one moment: :class:`MemorySample`.

One type for one concept, whoever reads it: the live memory view gets one from each rank
every interval (``fsdp_nb.runtime.side_channel``), an out-of-memory error reads one
from each rank that failed (``fsdp_nb.memory.out_of_memory``), and a rank the kernel
killed is reported with the last one the view got (``fsdp_nb.recovery.engine_deaths``).
One producer fills it on the ranks: ``fsdp_nb.memory.rank_memory_sample.read``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MemorySample"]


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One rank's memory at one moment, in bytes (the ``device_`` fields None on CPU ranks)."""

    rank: int
    """Rank that read it."""
    t: float
    """Engine wall-clock time of the reading (``time.time()``)."""
    device: str
    """The rank's device (``"cpu"``, ``"cuda:0"``)."""
    resident: int
    """Resident set size of the engine process."""
    resident_peak: int
    """Peak resident set size of the engine process (``VmHWM``)."""
    budget: int | None
    """What this rank may hold of what ``used`` counts (``fsdp_nb.memory.rank_memory_sample.
    device_budget``, the rule a plan's budget follows too): the GPU's memory once the rank
    uses CUDA, else the host's RAM shared by the ranks on it, no more than an address-space
    limit set on the process. None: unknown."""
    device_allocated: int | None = None
    """Bytes held by tensors on the rank's GPU."""
    device_reserved: int | None = None
    """Bytes reserved by the CUDA caching allocator."""
    device_peak: int | None = None
    """Peak allocated bytes on the GPU since the start (or the last reset)."""
    parameters: int | None = None
    """Bytes of the wrapped models' parameters and buffers on this rank (None: no model)."""
    gradients: int | None = None
    """Bytes of their gradients."""
    optimizer: int | None = None
    """Bytes of the engine globals' optimizer state."""
    seq: int = 0
    """Sequence number within its sampler (0 for a single reading)."""
    copies: int | None = None
    """Host bytes the in-memory autosave's copies hold on this rank: two generations of its
    own state and of its ward's (the rank whose copies it keeps; None: none). On a CPU rank part of ``resident``; on a GPU
    rank beside ``used``, which counts the GPU."""
    received: float = field(default=0.0, compare=False)
    """Notebook wall-clock time the sample arrived (set by the notebook; 0 when it was not
    received over the side channel)."""

    @property
    def on_device(self) -> bool:
        """Whether this rank computes on a GPU (its CUDA readings are there)."""
        return self.device_allocated is not None

    @property
    def used(self) -> int:
        """The headline number: CUDA allocated on GPU ranks, the resident set on CPU ranks."""
        return self.device_allocated if self.device_allocated is not None else self.resident

    @property
    def peak(self) -> int:
        """The peak of ``used``: CUDA's peak allocation, or the peak resident set."""
        return self.device_peak if self.device_peak is not None else self.resident_peak

    @property
    def rest(self) -> int:
        """Everything but parameters, gradients and optimizer state: activations,
        temporaries (and on CPU the process itself)."""
        held = (self.copies or 0) if not self.on_device else 0
        return max(0, self.used - (self.parameters or 0) - (self.gradients or 0) - (self.optimizer or 0) - held)

    @property
    def kinds(self) -> dict[str, int] | None:
        """``used`` split into parameters, gradients, optimizer state, on a CPU rank the
        in-memory autosave's copies, and the rest (None before a model is wrapped)."""
        if self.parameters is None:
            return None
        copies = {"copies": self.copies} if self.copies and not self.on_device else {}
        return {"parameters": self.parameters, "gradients": self.gradients or 0,
                "optimizer": self.optimizer or 0, **copies, "rest": self.rest}
