"""Working with a live session: some ranks only, one rank's output, post-mortem pdb on
the rank that failed, reloading edited code, ``sess.models``.

All on the shared 2-rank gloo session; each test leaves it usable.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

import fsdp_nb
from fsdp_nb import RankError
from fsdp_nb.frontends.magics import activate_px, parse_px

# -- some ranks, one rank's output ------------------------------------------------------


def test_execute_on_some_ranks_leaves_the_others_alone(sess, capsys):
    sess.push({"mark": -1})
    sess.execute("mark = rank * 10\nprint('ran on', rank)", ranks=[1])
    assert sess.pull("mark") == [-1, 10]
    out = capsys.readouterr().out
    assert "[rank 1] ran on 1" in out and "[rank 0]" not in out
    # every rank runs, only rank 1's output is shown
    sess.execute("print('hello', rank)", output="rank1")
    out = capsys.readouterr().out
    assert "[rank 1] hello 1" in out and "[rank 0]" not in out
    # a failure on the ranks that ran is reported under its rank
    with pytest.raises(RankError) as ei:
        sess.execute("raise KeyError('only here')", ranks=[0])
    assert ei.value.ranks == [0] and "KeyError" in str(ei.value)
    assert sess.all_reduce_check() == 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ranks": [2]}, ValueError, r"this session has ranks 0\.\.1"),
        ({"ranks": []}, ValueError, r"non-empty list of distinct ranks"),
        ({"ranks": [1, 1]}, ValueError, r"distinct ranks"),
        ({"ranks": "0"}, TypeError, r"ranks must be a list of ints"),
        ({"output": "rank5"}, ValueError, r"allowed: 'all', 'each', 'none', 'rank0', 'rank1'"),
        ({"ranks": [1], "output": "rank0"}, ValueError, r"allowed: 'all', 'each', 'none', 'rank1'$"),
        ({"output": "loud"}, ValueError, r"output='loud'"),
    ],
)
def test_bad_ranks_or_output_are_refused_before_anything_runs(sess, kwargs, error, match):
    sess.push({"untouched": 0})
    with pytest.raises(error, match=match):
        sess.execute("untouched = 1", **kwargs)
    assert sess.pull("untouched") == [0, 0]


def test_px_ranks_and_output_options(sess, shell, capsys):
    activate_px(sess)
    sess.push({"px_mark": 0})
    shell.run_cell_magic("px", "--ranks 1 --output rank1", "px_mark = 5\nprint('only', rank)\nrank + 40")
    assert sess.pull("px_mark") == [0, 5]
    out = capsys.readouterr().out
    assert "[rank 1] only 1" in out and "Out[rank 1]: 41" in out and "rank 0" not in out
    assert parse_px("--ranks 2,0 --timeout 3") == parse_px("--timeout 3 --ranks 2,0")
    assert parse_px("--ranks 2,0").ranks == [2, 0] and parse_px("").ranks is None
    for line in ("--ranks", "--ranks a,b", "--loud 1", "--timeout soon"):
        with pytest.raises(ValueError, match=r"usage: %%px \[--ranks 0,2\]"):
            parse_px(line)


# -- post-mortem -------------------------------------------------------------------------

_FAILING = textwrap.dedent(
    """
    def inner(x):
        y = x * 2
        raise ValueError(f"bad value {y}")

    def outer(x):
        z = x + 1
        return inner(z)
    """
)


def test_debug_opens_pdb_on_the_first_failing_rank_after_a_collective_failure(sess):
    sess.execute(_FAILING)
    # rank 1 fails before the collective; rank 0 waits in it until the session stops it
    code = "if rank == 1:\n    outer(4)\ndist.all_reduce(torch.ones(1))"
    with pytest.raises(RankError) as ei:
        sess.execute(code)
    assert ei.value.first.rank == 1
    text = sess.debug(commands=["p y", "up", "p z", "p x", "where"])
    assert text.startswith("ValueError: bad value 10\n> ")
    assert "(Pdb rank 1) p y\n10\n" in text
    assert "(Pdb rank 1) up\n> " in text and "outer()" in text
    assert "(Pdb rank 1) p z\n5\n" in text and "(Pdb rank 1) p x\n4\n" in text
    # the traceback is kept: a new look starts again at the frame that raised
    assert "(Pdb rank 1) p x * 3\n15\n" in sess.debug(1, ["p x * 3"])
    # rank 0 has its own: where the session stopped it, in the collective
    assert "dist.all_reduce(torch.ones(1))" in sess.debug(0, ["where"])
    assert sess.all_reduce_check() == 1.0


def test_debug_a_failed_run_and_a_rank_without_failure(sess):
    def explode(n):
        local_value = n + 100
        raise ZeroDivisionError(f"no {local_value}")

    with pytest.raises(RankError):
        sess.run(explode, 7)
    assert "(Pdb rank 0) p local_value\n107\n" in sess.debug(0, ["p local_value", "q", "p n"])
    # 'q' ends it: the commands after it are not run
    assert "p n" not in sess.debug(0, ["q", "p n"])
    sess.execute("import sys\nsys.last_traceback = None", ranks=[1])
    assert sess.debug(1, ["p 1"]) == (
        "rank 1 has no failure to debug (a rank keeps its last failure until the next)\n"
    )
    with pytest.raises(ValueError, match=r"rank must be one of 0\.\.1 or None"):
        sess.debug(2)
    with pytest.raises(TypeError, match="commands must be a list of pdb command lines"):
        sess.debug(0, "p x")


def test_debug_interactive_reads_commands_with_input(sess, monkeypatch, capsys):
    with pytest.raises(RankError):
        sess.execute("if rank == 0:\n    hidden = 'seen'\n    raise RuntimeError('look here')")
    answers = iter(["p hidden", "p len(hidden)", "q"])
    prompts = []

    def fake_input(prompt=""):
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", fake_input)
    assert sess.debug() is None
    out = capsys.readouterr().out
    assert prompts == ["(Pdb rank 0) "] * 3
    assert "RuntimeError: look here" in out and "'seen'\n4\n" in out


# -- reloading edited code ---------------------------------------------------------------


def _write(path, body: str) -> None:
    path.write_text(textwrap.dedent(body))
    st = os.stat(path)  # a new mtime, even within the same second as the last write
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))


def test_reload_brings_edited_code_to_every_rank_and_the_notebook(sess, tmp_path, monkeypatch):
    mod = tmp_path / "fsdp_nb_edited.py"
    _write(mod, """
        import torch

        VERSION = 1

        def answer():
            return 1

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.version = VERSION

            def forward(self, x):
                return self.lin(x)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fsdp_nb_edited  # noqa: F401

    sess.execute(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
                 "import fsdp_nb_edited\nfrom fsdp_nb_edited import answer")
    old = sess.wrap(fsdp_nb_edited.Tiny, name="edited_old")
    sess.execute("got = (answer(), fsdp_nb_edited.VERSION, edited_old.version)")
    assert sess.pull("got") == [(1, 1, 1)] * 2
    _write(mod, mod.read_text().replace("VERSION = 1", "VERSION = 22").replace("return 1", "return 22"))
    assert sess.reload("fsdp_nb_edited") == [0, 1]
    # `from m import answer` was re-bound on the ranks; the module itself is new everywhere
    sess.execute("got = (answer(), fsdp_nb_edited.VERSION, edited_old.version)")
    assert sess.pull("got") == [(22, 22, 1)] * 2
    assert sys.modules["fsdp_nb_edited"].answer() == 22
    # a wrap after the reload builds the edited class; the model built before still trains
    new = sess.wrap(sys.modules["fsdp_nb_edited"].Tiny, name="edited_new")
    sess.execute("got = edited_new.version")
    assert sess.pull("got") == [22, 22]
    sess.execute("edited_old(torch.ones(2, 4)).sum().backward()")
    assert set(sess.models) >= {"edited_old", "edited_new"}
    assert sess.models["edited_new"] is new and sess.models["edited_old"] is old
    sys.modules.pop("fsdp_nb_edited", None)


def test_reload_of_a_module_nobody_imported_is_refused(sess):
    with pytest.raises(ValueError, match="'no_such_mod_xyz' is not imported on any rank nor in the notebook"):
        sess.reload("no_such_mod_xyz")
    with pytest.raises(ValueError, match="needs a module name"):
        sess.reload("not a module")


def test_sessions_lists_running_sessions(sess):
    found = {s.cluster_id: s for s in fsdp_nb.sessions()}
    me = sess.context.keeper.record.cluster_id
    assert me in found and found[me].attached and found[me].world_size == 2
    assert found[me].keep_alive is False and "stops with its kernel" in str(found[me])


def test_a_notebook_class_defined_again_is_shipped_anew_on_the_next_wrap(sess, shell):
    source = (
        "import torch\n"
        "class Redefined(torch.nn.Module):\n"
        "    VERSION = {v}\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(2, 2)\n"
    )
    shell.run_cell(source.format(v=1))
    sess.wrap(shell.user_ns["Redefined"], name="redefined_a")
    shell.run_cell(source.format(v=2))
    sess.wrap(shell.user_ns["Redefined"], name="redefined_b")
    sess.execute("got = (type(redefined_a).VERSION, type(redefined_b).VERSION)")
    assert sess.pull("got") == [(1, 2), (1, 2)]
