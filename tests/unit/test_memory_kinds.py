"""What a rank holds by kind: read on the main thread only, handed to the sampler's thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from fsdp_nb.engine.step import owner
from fsdp_nb.memory.rank_memory_kinds import KindReadings, by_kind

PARAMS = (16 * 8 + 8) * 4
"""Bytes of the parameters of ``Linear(16, 8)``."""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wrapped():
    """A model as the engine's registry holds it, the namespace optimizers are found in, a
    clock, and readings of those (not the engine's own)."""
    model = torch.nn.Linear(16, 8)
    ns: dict[str, object] = {}
    clock = _Clock()
    readings = KindReadings(read=lambda: by_kind({"kinds_model": SimpleNamespace(module=model)}, ns), clock=clock)
    yield model, ns, clock, readings
    readings.uninstall()


def test_only_the_main_thread_reads_the_tensors(wrapped):
    """The sampler's thread must never touch a tensor: off the main thread ``note`` does
    nothing, and ``kept`` hands over the main thread's last reading."""
    model, _, _, readings = wrapped
    other = threading.Thread(target=readings.note, kwargs={"force": True})
    other.start()
    other.join()
    assert readings.kept() is None
    readings.note(force=True)
    assert readings.kept() == (PARAMS, 0, 0)
    seen = []
    reader = threading.Thread(target=lambda: seen.append(readings.kept()))
    reader.start()
    reader.join()
    assert seen == [(PARAMS, 0, 0)]


def test_every_optimizer_step_refreshes_the_reading_at_most_once_per_interval(wrapped):
    model, ns, clock, readings = wrapped
    opt = torch.optim.AdamW(model.parameters())
    ns["opt"] = opt
    owner().cell_started()  # an iteration an earlier test left is over
    readings.install()
    readings.install()  # idempotent: told once
    assert owner().listeners.count(readings) == 1 and readings.kept() == (PARAMS, 0, 0)
    model(torch.randn(4, 16)).sum().backward()
    clock.now += readings.every / 2
    opt.step()  # within ``every`` of the install's reading: not read again
    assert readings.kept() == (PARAMS, 0, 0)
    clock.now += readings.every
    opt.step()
    got = readings.kept()
    assert got is not None and got[:2] == (PARAMS, PARAMS)  # the gradients
    assert got[2] >= 2 * PARAMS  # AdamW's two moments (and its step counts)
    readings.uninstall()
    assert readings not in owner().listeners
    clock.now += 10 * readings.every
    model(torch.randn(4, 16)).sum().backward()
    opt.zero_grad(set_to_none=True)
    opt.step()
    owner().cell_ended(False)
    assert readings.kept() == got  # no longer told: nothing read


def test_no_model_wrapped_reads_nothing():
    assert by_kind({}, {}) is None
