"""Where a rank's recent optimizer steps' time went, as it measured it (``sess.steps()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankSteps"]


@dataclass(frozen=True, kw_only=True)
class RankSteps:
    """One rank's last optimizer steps, oldest first: each list has one entry per step."""

    rank: int
    """The rank that measured."""
    index: list[int]
    """Each step's number, counted from the view's start on this rank, or from the
    group's last formation (``epoch``)."""
    seconds: list[float]
    """Each step: from the end of the optimizer step before to the end of its own."""
    compute: list[float]
    """Its time computing: in a wrapped model's forward and backward, or the optimizer step."""
    collective: list[float]
    """Its time in a collective (transferring, or waiting for the other ranks to arrive)."""
    other: list[float]
    """The rest: data loading, Python between the steps, the host."""
    device: str
    """``"cpu"`` (host clocks are the truth) or ``"cuda"`` (host clocks are not: see the view)."""
    samples: list[int] = field(default_factory=list)
    """Each step's samples: the leading dimension of the batch its first wrapped model took
    (summed over micro-batches; 0 where no tensor showed it)."""
    tokens: list[int] = field(default_factory=list)
    """Each step's tokens: a batch of token ids' first two dimensions (0 where the batch is
    not integer ids)."""
    parameters: int = 0
    """Parameters of the model that took the batch (all of them, not this rank's shard)."""
    device_name: str = "cpu"
    """The GPU's name (``torch.cuda.get_device_name()``), or ``"cpu"``."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """What ``fsdp_nb.log`` kept on this rank: each name's newest values, oldest first."""
    logged_total: dict[str, int] = field(default_factory=dict)
    """Each name's count of values logged in this epoch: the last of ``logged[name]`` is
    value number ``logged_total[name] - 1`` (read with it; a writer skips what it wrote)."""
    seq: int = 0
    """Which of its sampler's messages this is (0: read through the task queue)."""
    device_index: list[int] = field(default_factory=list)
    """On a GPU rank, the steps the device has passed (their numbers), oldest first; their
    times below come from CUDA events (``steps.rank_step_events``). Empty on a CPU rank."""
    device_seconds: list[float] = field(default_factory=list)
    """Each of those steps on the device: from the step before's end to its own."""
    device_other: list[float] = field(default_factory=list)
    """Its device idle before its first forward (the host loading data, Python)."""
    device_model: list[float] = field(default_factory=list)
    """Its forward, backward, optimizer step and the collectives FSDP2 overlaps with them."""
    epoch: int = 0
    """Which formation of the group these steps belong to (every rank agrees on it): a
    restart, resize or recovery starts every rank's window afresh under a new one, and a
    view never mixes two."""
    open_step: int = -1
    """The number of this rank's newest step while it may still grow (its iteration ended
    at an optimizer step and no forward, evaluation or cell end has followed: a second
    optimizer's step would join it), else -1. A writer leaves it for a later message."""
