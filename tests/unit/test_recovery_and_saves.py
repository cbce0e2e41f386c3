"""Restart's refusals, the registry of async saves and a session's stop, on a context
whose cluster and dispatcher are fakes."""

from __future__ import annotations

import warnings

import pytest
from helpers import FakeDispatcher, fake_context

from fsdp_nb.checkpoints.async_saves import AsyncCheckpoint, register, wait_pending
from fsdp_nb.checkpoints.wire_checkpoint import Outcome, SaveProgress
from fsdp_nb.errors import CorruptCheckpointError, SessionClosedError
from fsdp_nb.formats.info import CheckpointInfo
from fsdp_nb.lifetime.start_stop import stop
from fsdp_nb.models.wrap import WrapRecord, check_replayable
from fsdp_nb.recovery.restart import restart


def _ctx_with_wraps(**kinds: str):
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    for name, kind in kinds.items():
        ctx.wraps[name] = WrapRecord(name, kind, None, None, None, 0)  # type: ignore[arg-type]
    return ctx


def test_drop_must_name_wrapped_models():
    ctx = _ctx_with_wraps(net="class")
    with pytest.raises(ValueError, match=r"names model\(s\) \['other'\] that this session did not wrap; wrapped: \['net'\]"):
        check_replayable(ctx, None, ("other",), replaying=False)


def test_an_instance_wrap_cannot_be_rebuilt_without_a_checkpoint():
    ctx = _ctx_with_wraps(inst="instance", net="class")
    with pytest.raises(ValueError, match=r"rebuild model\(s\) 'inst'.*Nothing was changed"):
        check_replayable(ctx, None, (), replaying=True)
    check_replayable(ctx, None, ("inst",), replaying=True)  # let it go
    check_replayable(ctx, None, (), replaying=False)  # nothing is rebuilt on a healthy session
    ctx2 = _ctx_with_wraps(net="class", inst="instance")
    check_replayable(ctx2, "ckpt", (), replaying=True)  # restore= fills the last wrap


def test_restart_refuses_before_touching_anything():
    ctx = _ctx_with_wraps(inst="instance")
    ctx.cluster.dead = {1}
    with pytest.raises(ValueError, match="Nothing was changed"):
        restart(ctx)
    assert ("start_replacements", [1]) not in ctx.cluster.asked and ctx.state == "ready"
    ctx.lifecycle.to("closed")
    with pytest.raises(SessionClosedError):
        restart(ctx)


def _handle(ctx, answers):
    ctx.recovering = FakeDispatcher(answers)
    return register(ctx, AsyncCheckpoint(ctx, "ckpt/step1", "tok", 0.01))


def test_async_progress_sums_the_ranks_and_the_slowest_phase_wins():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    h = _handle(ctx, {"async_progress": [SaveProgress("writing", 10, 40), SaveProgress("staging", 0, 40)]})
    p = h.progress()
    assert (p.phase, p.written, p.total) == ("staging", 10, 80) and h.phase == "staging"
    ctx.recovering.answers["async_progress"] = [SaveProgress("done", 40, 40), SaveProgress("done", 40, 40)]
    assert h.progress().phase == "committed"
    assert "ckpt/step1" in repr(h)


def test_a_committed_save_leaves_the_registry_and_keeps_its_info():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    info = CheckpointInfo(path="ckpt/step1", kind="sharded", valid=True)
    h = _handle(ctx, {"async_wait": [Outcome(info=info), Outcome()]})
    assert ctx.saves == [h]
    wait_pending(ctx)
    assert ctx.saves == [] and h.wait() is info and h.done() and h.phase == "committed"
    assert [s[1] for s in ctx.recovering.sent] == ["async_wait"]  # asked once


def test_a_failed_save_raises_its_error_each_time_it_is_asked():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    h = _handle(ctx, {"async_wait": [Outcome.failed(CorruptCheckpointError("disk full")), Outcome()]})
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match="disk full"):
            h.wait()
    assert ctx.saves == [] and h.phase == "failed"


class _Closable:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name
        self.owns_engines = True

    def close(self) -> None:
        self.log.append(f"{self.name} closed")

    def stop(self) -> None:
        self.log.append(f"{self.name} stopped")


def test_stop_finishes_pending_saves_first_then_closes_once():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    log: list[str] = []
    info = CheckpointInfo(path="ckpt/step1", kind="sharded", valid=True)
    h = _handle(ctx, {"async_wait": [Outcome(info=info), Outcome()]})
    ctx.cluster, ctx.channel, ctx.health = _Closable(log, "cluster"), _Closable(log, "channel"), _Closable(log, "health")  # type: ignore[assignment]
    closed = []
    ctx.lifecycle.on_close(lambda: closed.append(h.done()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the save finished: nothing to warn about
        stop(ctx)
    assert closed == [True] and ctx.saves == [] and ctx.state == "closed"
    assert log == ["channel closed", "cluster stopped", "health closed"]
    stop(ctx)
    assert log == ["channel closed", "cluster stopped", "health closed"]
