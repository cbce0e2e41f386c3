"""What the step view derives from the ranks' steps besides their parts: throughput, model
FLOPs utilisation and the curves of what the ranks logged (``fsdp_nb.log``).

- **Throughput** sums the ranks' samples (and tokens) per second over the window, each
  rank's batch counted as its own (data parallel; under tensor parallelism the ranks of
  one group share a batch, and the sum counts it once per rank).
- **MFU** (model FLOPs utilisation) is ``6 × parameters × tokens per second``, the
  forward and backward of a dense model with no attention term, over the peak dense
  bf16 FLOPs of the ranks' GPUs (``PEAK_FLOPS``). The parameters are all of the model's,
  embeddings included (torchtitan leaves those out), and under tensor parallelism the
  sum of tokens counts a shared batch once per rank, so MFU reads higher by that degree.
  It is given only on GPU ranks whose device is in the table and whose batch shows tokens.
- A **curve** is a logged name's mean over the ranks that log it, their newest values
  lined up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .wire_step_times import RankSteps

__all__ = ["PEAK_FLOPS", "StepRates", "curves", "mfu", "peak_flops", "shared_peak", "step_rates"]

PEAK_FLOPS = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
              ("A100", 312e12), ("B200", 2250e12), ("L40S", 362e12), ("L40", 181e12), ("A10G", 125e12),
              ("L4", 121e12))
"""(words of ``torch.cuda.get_device_name()``, dense bf16 FLOPs per second), the first
whose words all appear as whole words in the name wins ("L4" is not "L40"): NVIDIA's
data sheets, without sparsity."""


def peak_flops(device_name: str) -> float | None:
    """The device's peak dense bf16 FLOPs per second, or None when it is not in ``PEAK_FLOPS``.

    Args:
        device_name: what ``torch.cuda.get_device_name()`` says, e.g. ``"NVIDIA H100 80GB HBM3"``.
    """
    words = set(re.split(r"[\s-]+", device_name))
    return next((f for part, f in PEAK_FLOPS if set(part.split()) <= words), None)


@dataclass(frozen=True)
class StepRates:
    """The ranks' throughput over the window (None where the batches do not show it)."""

    samples_per_s: float | None
    """Samples per second, all ranks together."""
    tokens_per_s: float | None
    """Tokens per second, all ranks together (batches of token ids only)."""
    mfu: float | None
    """Model FLOPs utilisation, 0 to 1 (GPU ranks of a known device, token batches only)."""
    peak: float | None
    """The peak FLOPs per second of one rank's device (None: a CPU, or not in the table)."""

    def __str__(self) -> str:
        parts = []
        if self.samples_per_s:
            parts.append(f"{self.samples_per_s:,.1f} samples/s")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        return ", ".join(parts) or "no batch size seen (the first wrapped model took no tensor)"


def step_rates(got: Sequence[RankSteps]) -> StepRates:
    """Throughput and MFU from each rank's last steps.

    Args:
        got: each rank's last steps, as it measured them.
    """
    got = [g for g in got if g.seconds]  # a rank that has not sent a step yet counts for nothing
    per_rank = [(sum(g.samples), sum(g.tokens), sum(g.seconds), g) for g in got if g.samples]
    samples = sum(s / t for s, _, t, _ in per_rank if t > 0 and s) or None
    tokens = sum(k / t for _, k, t, _ in per_rank if t > 0 and k) or None
    peak = shared_peak(got)
    return StepRates(samples_per_s=samples, tokens_per_s=tokens, mfu=mfu(got, tokens, peak), peak=peak)


def shared_peak(got: Sequence[RankSteps]) -> float | None:
    """The ranks' one device's peak FLOPs per second (None: CPUs, unknown or mixed devices).

    Args:
        got: each rank's steps.
    """
    peaks = {peak_flops(g.device_name) if g.device == "cuda" else None for g in got}
    return peaks.pop() if len(peaks) == 1 else None


def mfu(got: Sequence[RankSteps], tokens_per_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation, ``6 × parameters × tokens per second`` over the ranks' peak.

    Args:
        got: each rank's steps (their model's parameters, their count).
        tokens_per_s: all ranks together.
        peak: one rank's device's peak (``shared_peak``).
    """
    params = max((g.parameters for g in got), default=0)
    return 6.0 * params * tokens_per_s / (peak * len(got)) if tokens_per_s and peak and params and got else None


def curves(got: Sequence[RankSteps]) -> dict[str, list[float]]:
    """Each logged name's mean over the ranks that log it, oldest first (their newest values
    lined up; values that are not finite are left out of a point's mean).

    Args:
        got: each rank's last message, with what ``fsdp_nb.log`` kept there.
    """
    names = sorted({n for g in got for n in g.logged})
    out = {}
    for name in names:
        series = [g.logged[name] for g in got if g.logged.get(name)]
        n = min(len(s) for s in series)
        points = []
        for i in range(n):
            vals = [s[len(s) - n + i] for s in series]
            vals = [v for v in vals if math.isfinite(v)]
            points.append(sum(vals) / len(vals) if vals else math.nan)
        out[name] = points
    return out
