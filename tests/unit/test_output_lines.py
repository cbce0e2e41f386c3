"""Ranks' printed lines merged (``runtime.output_lines``): pure logic, a clock of our own."""

from __future__ import annotations

from fsdp_nb.runtime.output_lines import HOLD, LineMerger, rank_label


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _merger():
    out: list[str] = []
    clock = _Clock()
    return LineMerger(out.append, clock), out, clock


def test_a_rank_label_joins_runs_of_ranks():
    assert rank_label([3]) == "rank 3"
    assert rank_label(range(8)) == "ranks 0-7"
    assert rank_label([6, 0, 1, 2, 4]) == "ranks 0-2,4,6"
    assert rank_label([1, 3, 5, 7]) == "ranks 1,3,5,7"


def test_lines_alike_print_once_and_lines_that_differ_keep_their_tags_in_order():
    m, out, _ = _merger()
    for r in range(8):
        m.add(r, ["step 0 loss 2.31", f"rank {r} here", "even" if r % 2 == 0 else "odd", "step 1 loss 2.10"])
    m.emit(running=range(8))
    assert "".join(out).splitlines() == [
        "[ranks 0-7] step 0 loss 2.31",
        *(f"[rank {r}] rank {r} here" for r in range(8)),
        "[ranks 0,2,4,6] even", "[ranks 1,3,5,7] odd",
        "[ranks 0-7] step 1 loss 2.10",
    ]


def test_a_line_waits_for_the_others_while_they_run_but_never_past_the_hold():
    m, out, clock = _merger()
    m.add(0, ["step 0"])
    m.emit(running=[0, 1])
    assert out == []  # rank 1's line may still come
    m.add(1, ["step 0"])
    m.emit(running=[0, 1])
    assert out == ["[ranks 0-1] step 0\n"]
    m.add(0, ["only rank 0 prints this"])
    clock.t += HOLD / 2
    m.emit(running=[0, 1])
    assert len(out) == 1
    clock.t += HOLD
    m.emit(running=[0, 1])  # rank 1 is behind, or prints nothing: shown anyway
    assert out[-1] == "[rank 0] only rank 0 prints this\n"
    m.add(0, ["last"])
    m.emit(running=[0])  # rank 1 has finished: nothing to wait for
    assert out[-1] == "[rank 0] last\n"


def test_the_final_emit_writes_everything_and_each_ranks_order_is_kept():
    m, out, _ = _merger()
    m.add(0, ["a", "b", "c"])
    m.add(1, ["a"])
    m.emit(running=[0, 1])
    assert "".join(out) == "[ranks 0-1] a\n"
    m.emit(running=[0, 1], final=True)
    assert "".join(out).splitlines()[1:] == ["[rank 0] b", "[rank 0] c"]


def test_a_rank_that_printed_one_line_more_falls_back_into_step():
    m, out, _ = _merger()
    m.add(0, ["UserWarning: something", "step 0", "step 1"])
    m.add(1, ["step 0", "step 1"])
    m.emit(running=[0, 1])
    assert "".join(out).splitlines() == ["[rank 0] UserWarning: something", "[ranks 0-1] step 0",
                                         "[ranks 0-1] step 1"]


def test_lines_that_never_match_are_all_written_each_with_its_rank():
    m, out, _ = _merger()
    n = 20_000
    for r in range(4):
        m.add(r, [f"rank {r} line {i}" for i in range(n)])
    m.emit(running=range(4), final=True)
    lines = "".join(out).splitlines()
    assert len(lines) == 4 * n and lines[:2] == ["[rank 0] rank 0 line 0", "[rank 1] rank 1 line 0"]
    assert lines[-1] == f"[rank 3] rank 3 line {n - 1}"
