"""What the notebook's terminal shows of a call: rank output, tagged and bounded; and
how a rank's answer is read (completion times, failures)."""

from __future__ import annotations

import ipyparallel as ipp
import pytest
from helpers import FakeReply, pending_of

from fsdp_nb.runtime.results import completed, failure, strip_ansi
from fsdp_nb.runtime.terminal import OUTPUT_LIMIT, Echo, tag


def test_colour_codes_are_stripped_and_lines_tagged_by_rank():
    assert strip_ansi("\x1b[31mred\x1b[0m plain") == "red plain"
    assert strip_ansi(None) == ""  # type: ignore[arg-type]
    assert tag(3, "a\nb\n") == "[rank 3] a\n[rank 3] b\n"


def test_echo_streams_whole_lines_then_the_rest_at_the_end(capsys):
    reply = FakeReply(stdout="one\ntw")
    echo = Echo(pending_of({0: reply}))
    echo.flush()
    assert capsys.readouterr().out == "[rank 0] one\n"
    reply.metadata["stdout"] = "one\ntwo\nthr"
    echo.flush()
    assert capsys.readouterr().out == "[rank 0] two\n"
    echo.flush(final=True)
    assert capsys.readouterr().out == "[rank 0] thr\n"


def test_echo_shows_only_the_echoed_ranks_and_stderr_on_stderr(capsys):
    p = pending_of({0: FakeReply(stdout="zero\n"), 1: FakeReply(stdout="one\n", stderr="warn\n")})
    p.echoed = (1,)
    Echo(p).flush(final=True)
    out = capsys.readouterr()
    assert out.out == "[rank 1] one\n" and out.err == "[rank 1] warn\n"


def test_a_chatty_rank_is_cut_at_the_limit(capsys):
    reply = FakeReply(stdout="x" * 99 + "\n")
    echo = Echo(pending_of({0: reply}))
    reply.metadata["stdout"] = ("y" * 1000 + "\n") * (OUTPUT_LIMIT // 1000 + 5)
    echo.flush(final=True)
    out = capsys.readouterr().out
    assert f"cut at {OUTPUT_LIMIT} characters" in out and len(out) < OUTPUT_LIMIT + 10_000


@pytest.mark.parametrize("stamp, expect", [
    ("2026-01-01T00:00:00Z", 1767225600.0),
    (1767225600.0, 1767225600.0),
    ("not a date", float("inf")),
    (None, float("inf")),
])
def test_completion_times_read_as_ipyparallel_sends_them(stamp, expect):
    assert completed(FakeReply(1, completed=stamp)) == expect


def test_a_remote_error_keeps_its_name_message_and_traceback_without_colours():
    remote = ipp.error.RemoteError("ZeroDivisionError", "division by zero", "\x1b[1mTraceback\x1b[0m ...")
    f = failure(2, FakeReply(error=remote))
    assert (f.rank, f.ename, f.evalue, f.traceback) == (2, "ZeroDivisionError", "division by zero", "Traceback ...")
    assert str(f) == "[rank 2] ZeroDivisionError: division by zero"
    plain = failure(0, FakeReply(error=OSError("disk")))
    assert (plain.ename, plain.evalue, plain.traceback) == ("OSError", "disk", "")
