"""What a rank holds by kind: read on the main thread only, handed to the sampler's thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.optim.optimizer as optimizer_module

from fsdp_nb.engine import memory_kinds
from fsdp_nb.engine.wrap import MODELS


@pytest.fixture
def wrapped(monkeypatch):
    model = torch.nn.Linear(16, 8)
    monkeypatch.setitem(MODELS, "kinds_model", SimpleNamespace(module=model))
    monkeypatch.setattr(memory_kinds, "_KEPT", {"value": None, "at": float("-inf"), "installed": False})
    ns = {}
    monkeypatch.setattr(memory_kinds, "user_ns", lambda: ns)
    return model, ns


def test_only_the_main_thread_reads_the_tensors(wrapped):
    """The sampler's thread must never touch a tensor: off the main thread ``note`` does
    nothing, and ``kept`` hands over the main thread's last reading."""
    model, _ = wrapped
    other = threading.Thread(target=memory_kinds.note, kwargs={"force": True})
    other.start()
    other.join()
    assert memory_kinds.kept() is None
    memory_kinds.note(force=True)
    assert memory_kinds.kept() == ((16 * 8 + 8) * 4, 0, 0)
    seen = []
    reader = threading.Thread(target=lambda: seen.append(memory_kinds.kept()))
    reader.start()
    reader.join()
    assert seen == [((16 * 8 + 8) * 4, 0, 0)]


def test_every_optimizer_step_refreshes_the_reading_at_most_once_per_interval(wrapped, monkeypatch):
    model, ns = wrapped
    opt = torch.optim.AdamW(model.parameters())
    ns["opt"] = opt
    handles = []
    real = optimizer_module.register_optimizer_step_post_hook
    monkeypatch.setattr(optimizer_module, "register_optimizer_step_post_hook",
                        lambda hook: handles.append(real(hook)) or handles[-1])
    try:
        memory_kinds.install()
        memory_kinds.install()  # idempotent: one hook
        assert len(handles) == 1 and memory_kinds.kept() == ((16 * 8 + 8) * 4, 0, 0)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()  # within EVERY of the install's reading: not read again
        assert memory_kinds.kept()[1:] == (0, 0)
        monkeypatch.setattr(memory_kinds, "EVERY", 0.0)
        opt.step()
        params = (16 * 8 + 8) * 4
        assert memory_kinds.kept()[:2] == (params, params)  # the gradients
        assert memory_kinds.kept()[2] >= 2 * params  # AdamW's two moments (and its step counts)
    finally:
        for h in handles:
            h.remove()
