"""Session calls over the direct call channel (``fsdp_nb.runtime.call_channel``): what ``run``,
``push`` and ``pull`` answer is what the ipyparallel path answers, output and errors
included; Ctrl-C, timeouts and dead engines on this path are in test_failures."""

from __future__ import annotations

import pytest

from fsdp_nb.engine.namespace import call
from fsdp_nb.errors import RankError
from fsdp_nb.runtime.call_channel import CallResult
from fsdp_nb.runtime.shipping import by_value


def chatty(n):
    print("line", n, rank)  # noqa: F821 - engine global
    print("half", end="")
    return n * 10 + rank  # noqa: F821


def broken(n):
    return n / 0


def both_paths(sess, fn):
    """``fn()`` over the direct channel, then over ipyparallel: both results."""
    direct = fn()
    sess.context.channel.enabled = False
    try:
        through_ipp = fn()
    finally:
        sess.context.channel.enabled = True
    return direct, through_ipp


def test_run_push_pull_go_direct_and_answer_as_ipyparallel_does(sess, capsys):
    d = sess.dispatcher
    shipped = (by_value(chatty), by_value((1,)), by_value({}))
    pending = d.apply("chatty", call, args=shipped, fast=True)
    assert all(isinstance(r, CallResult) for r in pending.results.values())
    assert d.gather(pending) == [10, 11]
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[rank 0] line 1 0", "[rank 1] line 1 1", "[ranks 0-1] half"]  # alike: once

    direct, via_ipp = both_paths(sess, lambda: sess.run(chatty, 2))
    assert direct == via_ipp == [20, 21]
    out = capsys.readouterr().out
    assert out.count("[rank 0] line 2 0\n") == 2 and out.count("[rank 1] line 2 1\n") == 2

    sess.push({"calls_x": {"a": [1, 2]}})
    assert both_paths(sess, lambda: sess.pull("calls_x")) == ([{"a": [1, 2]}] * 2,) * 2
    sess.execute("del calls_x")


def test_a_failing_direct_run_names_the_rank_error_and_frame(sess):
    errors = []
    for enabled in (True, False):
        sess.context.channel.enabled = enabled
        try:
            with pytest.raises(RankError) as info:
                sess.run(broken, 3)
        finally:
            sess.context.channel.enabled = True
        errors.append(info.value)
    for err in errors:
        assert sorted(f.rank for f in err.failures) == [0, 1]
        assert {f.ename for f in err.failures} == {"ZeroDivisionError"}
        assert "broken" in err.failures[0].traceback
    assert "call_server" not in errors[0].failures[0].traceback  # the user's frames only
    assert sess.run(int) == [0, 0]  # usable right after


def note_after_reply():
    from fsdp_nb.engine.call_channel import after_reply

    after_reply(lambda: after_log.append("after"))  # noqa: F821 - engine global
    return list(after_log)  # noqa: F821


def test_work_put_after_a_direct_reply_runs_once_the_reply_left(sess):
    """An async save starts its copy and write once its call has answered (its threads
    would hold the GIL against the reply); outside a direct call it runs at once."""
    sess.execute("after_log = []")
    assert sess.run(note_after_reply) == [[], []]  # not yet run when the call returned
    assert sess.pull("after_log") == [["after"], ["after"]]
    sess.context.channel.enabled = False
    try:
        sess.execute("after_log = []")
        assert sess.run(note_after_reply) == [["after"], ["after"]]  # ipyparallel: at once
    finally:
        sess.context.channel.enabled = True
    sess.execute("del after_log")
