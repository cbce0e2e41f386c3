"""The session's small parts: its state machine, its errors, its context, how it prints."""

from __future__ import annotations

import inspect

import pytest
from helpers import fake_context

import fsdp_nb
from fsdp_nb.errors import FsdpNbError, RankError, RankFailure, RankTimeoutError, SessionClosedError
from fsdp_nb.frontends.session_view import session_html, session_text
from fsdp_nb.runtime.lifecycle import Lifecycle
from fsdp_nb.runtime.phases import PhaseClock, phase_table


def test_the_lifecycle_allows_only_its_moves():
    lc = Lifecycle()
    lc.to("ready")
    lc.to("degraded")
    lc.to("ready")
    with pytest.raises(RuntimeError, match="cannot go from 'ready' to 'starting'"):
        lc.to("starting")
    lc.to("closed")
    with pytest.raises(RuntimeError, match="cannot go from 'closed' to 'ready'"):
        lc.to("ready")


def test_close_hooks_run_once_and_a_broken_one_does_not_stop_the_rest():
    lc, ran = Lifecycle(), []
    lc.on_close(lambda: ran.append("a"))
    lc.on_close(lambda: 1 / 0)
    lc.on_close(lambda: ran.append("b"))
    lc.to("closed")
    assert ran == ["a", "b"]


def test_a_failed_start_can_only_close():
    lc = Lifecycle()
    lc.to("failed")
    with pytest.raises(RuntimeError):
        lc.to("ready")
    lc.to("closed")


def test_every_public_error_is_an_fsdp_nb_error_and_still_its_builtin():
    errors = [getattr(fsdp_nb, n) for n in fsdp_nb.__all__
              if inspect.isclass(getattr(fsdp_nb, n)) and issubclass(getattr(fsdp_nb, n), BaseException)]
    assert len(errors) >= 8
    assert all(issubclass(e, FsdpNbError) for e in errors), errors
    assert issubclass(fsdp_nb.CheckpointError, RuntimeError) and issubclass(RankTimeoutError, TimeoutError)
    assert fsdp_nb.UnsafeCheckpointError.__mro__[1] is fsdp_nb.CheckpointError


def test_a_rank_error_knows_its_collateral_from_the_start():
    fs = [RankFailure(1, "ValueError", "bad", "tb"), RankFailure(0, "RuntimeError", "stopped", "")]
    err = RankError("run(f)", fs, 2, collateral=[0])
    assert err.collateral == [0] and err.ranks == [1, 0] and err.first.rank == 1
    assert "run(f) failed on rank(s) 1, 0 of 2." in str(err) and "tb" in str(err)
    assert RankError("x", fs).collateral == []


def test_a_timeout_shows_where_each_rank_was():
    err = RankTimeoutError("execute", 6, [1, 0], stacks={1: "File x, in data_step\n", 0: "in all_reduce"})
    assert err.pending == [0, 1] and err.stacks[1].startswith("File x")
    text = str(err)
    assert text.index("--- rank 0 was at:") < text.index("--- rank 1 was at:") and "data_step" in text


def test_a_closed_context_refuses_calls_with_what_to_do():
    ctx = fake_context(3)
    assert ctx.world_size == 3 and [r.rank for r in ctx.ranks] == [0, 1, 2]
    ctx.lifecycle.to("ready")
    assert ctx.dispatcher is ctx.recovering
    ctx.lifecycle.to("closed")
    with pytest.raises(SessionClosedError, match=r"start a new fsdp_nb.Session\(\)"):
        ctx.dispatcher  # noqa: B018 - the property is the check
    assert isinstance(SessionClosedError("x"), RuntimeError)


def test_contexts_keep_their_own_registries():
    a, b = fake_context(), fake_context()
    a.saves.append("handle")
    a.wraps["m"] = "record"
    assert b.saves == [] and b.wraps == {} and a.restart_phases == {}


def test_a_session_prints_its_state_and_one_row_per_rank():
    ctx = fake_context(2)
    ctx.lifecycle.to("ready")
    text = session_text(ctx)
    assert text.startswith("<fsdp_nb.Session ready: 2 ranks, backend=gloo, launcher=local>")
    assert "1001" in text and "1/2" in text
    html = session_html(fake_context(1))
    assert "<table" in html and "starting" in html and "1000" in html


def test_phase_tables_sum_the_phases():
    clock = PhaseClock()
    clock.mark("one")
    clock.mark("two")
    assert list(clock.times) == ["one", "two"]
    table = phase_table({"launch": 1.0, "group": 3.0})
    assert table.splitlines()[0] == "session start:" and "25.0%" in table and "4.00 s" in table
