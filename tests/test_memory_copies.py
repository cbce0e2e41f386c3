"""The in-memory autosave: each rank's state after every step in its own memory and its
buddy's, and a dead engine that costs the step in flight, not the steps since a disk save.

One private 4-rank session (``four``) takes every fault in turn; the buddy map on one
host is ``r -> r + 1``: 0->1, 1->2, 2->3, 3->0. A reference run that never stopped gives
the losses each resumed run must match bit for bit.
"""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import (
    RUN_LOOP,
    DropNet,
    forget_models,
    killable_session,
    mark_code,
    on_marker,
    run_out,
    whole,
)
from test_autosave_meets import AM_LOOP

from fsdp_nb.errors import DeadRankError, RankTimeoutError, SessionUnfinishedError
from fsdp_nb.runtime.cluster import wait_until

STEPS = 10


@pytest.fixture(scope="module")
def four_ranks(session_factory):
    """A 4-rank session of its own, for the tests that kill engines."""
    yield from killable_session(session_factory, 4, AM_LOOP)


@pytest.fixture
def four(four_ranks):
    """The 4-rank session, whole (``helpers.whole``)."""
    return whole(four_ranks, 4)


def _remake():
    """``restart(setup=)``: the run's objects on every rank, for the rebuilt model."""
    am_setup("mc_m")  # noqa: F821 - an engine global (AM_LOOP), replayed on a new engine


def _fresh(s):
    """Model ``mc_m`` at the wrap's seed, its optimizer, loader and scheduler, each rank's
    random state seeded alike each time."""
    torch.manual_seed(0)
    model = s.wrap(DropNet, name="mc_m")
    s.execute("am_setup('mc_m'); torch.manual_seed(10 + rank)")
    return model


@pytest.fixture(scope="module")
def never_stopped(four_ranks):
    """Each rank's losses of ``STEPS`` steps of the run that never stopped."""
    _fresh(whole(four_ranks, 4))
    return run_out(four_ranks, f"rs_out = am_train({STEPS})")


def _arm(s, root, model, **kw):
    return s.autosave(str(root) if root else None, every=4 if root else None, model=model, optimizer="am_opt",
                      loaders=["am_batches"], state=["am_sched"], in_memory=True, **kw)


def _trained_with_disk(s, root, steps):
    """A fresh run armed to disk every 4 steps and to memory after each, trained ``steps``
    steps, its disk autosave of step 4 complete."""
    _arm(s, root, _fresh(s))
    run_out(s, f"rs_out = am_train({steps})")
    assert wait_until(lambda: (root / "step-4" / ".fsdp_nb_complete").exists(), 60)


def _kill(s, ranks):
    s.cluster.signal(list(ranks), signal.SIGKILL)  # by the session's verified handle
    assert wait_until(lambda: set(ranks) <= set(s.cluster.dead_ranks()), 60)


def _sample():
    """This rank's memory sample, as the live memory view's sampler reads it."""
    from fsdp_nb.memory.rank_memory_kinds import MemoryReading

    return MemoryReading().read(rank, 0, None)  # noqa: F821 - an engine global


def _after(losses, start):
    return [r[start:] for r in losses]


def test_a_dead_engine_costs_no_step_the_state_comes_back_from_a_buddys_memory(four, never_stopped, tmp_path):
    """The issue's run: disk every 4 steps and memory after each, 6 steps, rank 2 killed,
    restart(restore="latest"): the state of step 6 comes from memory (rank 2's from rank 3,
    its buddy), nothing is read from disk, and the unchanged cell gives steps 7 to 10."""
    s = four
    model = _fresh(s)
    auto = _arm(s, tmp_path / "auto", model)
    assert auto.buddies == (1, 2, 3, 0) and "into memory after every step" in repr(auto)
    assert run_out(s, "rs_out = am_train(6)") == [r[:6] for r in never_stopped]
    said = s.autosave()
    assert "in memory: step 6" in repr(said), repr(said)
    held = [r.copies.bytes for r in said.ranks]
    assert all(b > 0 for b in held) and [x.copies for x in s.run(_sample)] == held  # what the memory view shows
    # the disk save of step 4 ended first: a rank killed while it writes leaves the others'
    # save threads waiting on it in the old group, and the restart gives them a minute
    # (rank_async_saves.REFORM_WAIT_S; the checkpoints guide says so)
    assert wait_until(lambda: (tmp_path / "auto" / "step-4" / ".fsdp_nb_complete").exists(), 60)
    _kill(s, [2])
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.step == 6 and report.restored.memory is not None
    assert report.restored.memory.sources == {2: 3}
    assert "rank 2 from rank 3's memory" in repr(report) and "nothing was read from disk" in repr(report)
    assert "state moved from memory" in s.restart_phases and "checkpoint loaded" not in s.restart_phases
    assert run_out(s, "rs_out = am_train(4)") == _after(never_stopped, 6)


def test_two_ranks_that_are_not_buddies_die_and_memory_still_serves(four, never_stopped, tmp_path):
    """Ranks 0 and 2 die together: each one's copy lives on its buddy (1 and 3)."""
    s = four
    model = _fresh(s)
    _arm(s, tmp_path / "auto", model)
    run_out(s, "rs_out = am_train(5)")
    _kill(s, [0, 2])
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.step == 5 and report.restored.memory.sources == {0: 1, 2: 3}
    assert run_out(s, "rs_out = am_train(5)") == _after(never_stopped, 5)


def test_a_rank_and_its_buddy_die_together_and_the_disk_autosave_serves_by_name(four, never_stopped, tmp_path):
    """Ranks 1 and 2 die together: rank 1's copies were on rank 2. The restart falls back
    to the disk autosave of step 4, says why, and the run goes on from there bit for bit."""
    s = four
    _trained_with_disk(s, tmp_path / "auto", 6)
    _kill(s, [1, 2])
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.memory is None and report.restored.step == 4
    assert "rank 1 (its buddy: rank 2)" in report.restored.fallback, report.restored.fallback
    assert "from disk, because" in repr(report)
    assert run_out(s, "rs_out = am_train(6)") == _after(never_stopped, 4)


def test_a_kill_during_a_copy_leaves_the_generation_before_it(four, never_stopped):
    """Rank 3 dies as its copy of step 4 begins to go out (its copy thread kills its own
    process there, while its training thread is in step 5's forward: the others cannot
    end step 5 without it, as when a rank dies). Step 4 is whole nowhere for rank 3, so
    every rank rolls back to step 3, and the unchanged cell goes on from there bit for bit."""
    s = four
    model = _fresh(s)
    _arm(s, None, model)  # memory only
    s.execute(
        "import signal\n"
        "import fsdp_nb.autosave.rank_memory_copies as _mc\n"
        "_mc_plain = _mc.transfer\n"
        "def _mc_dies(group, sends, *a, **kw):\n"
        "    if rank == 3 and sends and sends[0][1] is not None and sends[0][1].step == 4:\n"
        "        signal.raise_signal(signal.SIGKILL)  # this process itself: no pid to get wrong\n"
        "    return _mc_plain(group, sends, *a, **kw)\n"
        "_mc.transfer = _mc_dies\n"
    )
    with pytest.raises(DeadRankError):
        s.execute("am_train(6)")
    s.execute("_mc.transfer = _mc_plain", ranks=[0, 1, 2])
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.memory is not None and report.restored.step == 3, repr(report)
    assert run_out(s, "rs_out = am_train(7)") == _after(never_stopped, 3)


def _remake_and_die_on_rank_1():
    """A setup that kills rank 1's engine: a death during the recovery itself."""
    if rank == 1:  # noqa: F821 - an engine global
        signal.raise_signal(signal.SIGKILL)  # this process itself: no pid to get wrong
    am_setup("mc_m")  # noqa: F821 - an engine global (AM_LOOP)


def test_a_kill_during_the_recovery_and_the_next_restart_still_takes_memory(four, never_stopped, tmp_path):
    """Rank 3 dies; the restart's setup kills rank 1. That restart stops and the session
    says so; the next one finds rank 3's copy on rank 0 and rank 1's on rank 2, both alive,
    and the run goes on bit for bit."""
    s = four
    _trained_with_disk(s, tmp_path / "auto", 5)
    _kill(s, [3])
    with pytest.raises(DeadRankError):
        s.restart(restore="latest", setup=_remake_and_die_on_rank_1)
    with pytest.raises(SessionUnfinishedError):
        s.execute("1")
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.memory is not None and report.restored.step == 5, repr(report)
    assert report.restored.memory.sources == {1: 2, 3: 0}
    assert run_out(s, "rs_out = am_train(5)") == _after(never_stopped, 5)


class HeldNet(torch.nn.Module):
    """The held-out check's model: a norm, a persistent buffer and dropout of its own."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(16, 1)
        self.register_buffer("seen", torch.zeros(1))

    def reset_parameters(self):
        """The buffer's value after the meta-device build (``sess.wrap`` calls it)."""
        self.seen.zero_()

    def forward(self, x):
        self.seen += 1
        return self.out(self.drop(torch.nn.functional.gelu(self.norm(self.inp(x)))))


def _remake_held():
    """``restart(setup=)`` for the held-out run (RUN_LOOP's objects)."""
    rs_setup("mc_h")  # noqa: F821 - an engine global (RUN_LOOP), replayed on a new engine


def test_held_out_a_model_and_a_stateful_loader_of_its_own_killed_inside_a_step(four, tmp_path):
    """Another model (a LayerNorm, a buffer the forward changes) and torchdata's
    StatefulDataLoader over a shuffled DistributedSampler (six batches a rank), copies in
    memory only; rank 1 killed inside step 5 of a cell: every rank rolls back to step 4,
    from memory, and the unchanged cell gives steps 5 and 6 of the run that never stopped."""

    s = four
    s.execute(RUN_LOOP)

    def fresh():
        torch.manual_seed(1)
        m = s.wrap(HeldNet, name="mc_h")
        s.execute("rs_setup('mc_h'); torch.manual_seed(20 + rank)")
        return m

    fresh()
    ref = run_out(s, "rs_out = rs_train('mc_h', 6)")
    ref_seen = run_out(s, "rs_out = mc_h.seen.item()")
    model = fresh()
    s.autosave(model=model, optimizer="rs_opt", loaders=["rs_loader"], state=["rs_sched"], in_memory=True)
    marker = tmp_path / "in_step_5"
    on_marker(marker, lambda: s.cluster.signal([1], signal.SIGKILL))
    # rank 1 stops inside step 5's forward, once its copy of step 4 (taken as that forward
    # began, the iteration's boundary) is complete, and is killed there
    s.execute(
        "import time as _mc_time\nfrom fsdp_nb.autosave.rank_memory_copies import copies as _mc_copies\n"
        "_mc_calls = [0]\n"
        "def _mc_stop(module, args, out):\n"
        "    _mc_calls[0] += 1\n"
        "    if rank == 1 and _mc_calls[0] == 5:\n"
        "        _mc_copies().wait_exchange()\n"
        "        " + mark_code(marker).strip() + "\n"
        "        _mc_time.sleep(30)\n"
        "_mc_hook = mc_h.register_forward_hook(_mc_stop)\n"
    )
    with pytest.raises(DeadRankError):
        s.execute("rs_train('mc_h', 6)")
    s.execute("_mc_hook.remove()", ranks=[0, 2, 3])
    report = s.restart(restore="latest", setup=_remake_held)
    assert report.restored.memory is not None and report.restored.step == 4
    assert report.restored.memory.sources == {1: 2}
    assert run_out(s, "rs_out = rs_train('mc_h', 2)") == _after(ref, 4)
    assert run_out(s, "rs_out = mc_h.seen.item()") == ref_seen  # the buffer came back too
    s.stop_autosave()
    forget_models(s, "mc_h", optimizers=("rs_opt", "rs_sched", "rs_loader"))


# -- refused before anything changes ---------------------------------------------------

def test_in_memory_arguments_are_checked_before_any_rank_is_asked(sess):
    with pytest.raises(TypeError, match="every= counts steps between disk saves"):
        sess.autosave(every=4, in_memory=True)
    with pytest.raises(TypeError, match="in_memory must be True or False"):
        sess.autosave("/tmp/x", every=4, in_memory="yes")


def test_arming_refuses_by_name_where_a_hosts_memory_cannot_hold_the_copies(sess, tmp_path):
    """Each rank's host says 1 MB is available: the copies (four times a rank's state)
    would not fit with the margin; refused naming the host and the sizes, and the
    autosave that was running goes on."""
    sess.execute(AM_LOOP)
    model = sess.wrap(DropNet, name="mc_r")
    sess.execute("am_setup('mc_r')")
    before = sess.autosave(str(tmp_path / "disk"), every=2, model=model, optimizer="am_opt")
    sess.execute("import psutil as _mc_ps\n_mc_vm = _mc_ps.virtual_memory\n"
                 "_mc_ps.virtual_memory = lambda: type('vm', (), {'available': 2000})()\n")
    try:
        with pytest.raises(MemoryError, match=r"the copies in memory need .* on host .* has 2.0 KiB available"):
            sess.autosave(model=model, optimizer="am_opt", in_memory=True)
    finally:
        sess.execute("_mc_ps.virtual_memory = _mc_vm")
    now = sess.autosave()
    assert now is not None and now.root == before.root and not now.in_memory
    sess.stop_autosave()
    forget_models(sess, "mc_r", optimizers=("am_opt", "am_sched", "am_batches"))


def _shards():
    """This rank's model shards now."""
    return {k: v.to_local().clone() for k, v in mc_m.state_dict().items()}  # noqa: F821 - an engine global


def test_a_copy_one_rank_cannot_take_changes_no_rank(four, never_stopped):
    """Rank 1's check of its copy fails (here forced; a copy that does not fit its model).
    Every rank hears it before any writes: the ranks that could have rolled back to step 3
    keep the weights they had (moved off step 3 here), and the restart says so. Mended,
    the next restart takes step 3 from memory and the run goes on bit for bit."""
    s = four
    model = _fresh(s)
    _arm(s, None, model)  # memory only
    run_out(s, "rs_out = am_train(3)")
    trained = s.run(_shards)
    s.execute("with torch.no_grad():\n    for _p in mc_m.parameters():\n        _p.add_(1.0)")  # not a step: no copy
    moved = s.run(_shards)
    s.execute("import fsdp_nb.autosave.rank_memory_copies as _nc\n_nc_plain = _nc._checked\n"
              "def _nc_refuse(*a):\n    raise ValueError('rank 1 cannot take this copy')\n"
              "if rank == 1:\n    _nc._checked = _nc_refuse\n")
    with pytest.raises(Exception, match="no rank's state was changed") as info:
        s.restart(restore="latest", setup=_remake)
    assert "rank 1 cannot take this copy" in str(info.value)
    # the session refuses calls until a restart ends; ipyparallel's own view still reads the ranks
    view = s.view()
    view.execute("mc_after = {k: v.to_local().clone() for k, v in mc_m.state_dict().items()}", block=True)
    after = view.pull("mc_after", block=True)
    for r in range(s.world_size):  # as it was before the restart: no rank wrote step 3 over it
        assert all(torch.equal(after[r][k], moved[r][k]) for k in moved[r]), r
        assert not all(torch.equal(after[r][k], trained[r][k]) for k in trained[r]), r
    view.execute("_nc._checked = _nc_plain", block=True)
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.memory is not None and report.restored.step == 3, repr(report)
    assert run_out(s, "rs_out = am_train(3)") == [r[3:6] for r in never_stopped]
    s.stop_autosave()


def test_after_the_sessions_own_restart_the_copies_wait_for_a_restore(four, never_stopped):
    """Rank 1 ignores Ctrl-C in a cell and is wedged: the session kills and replaces it with
    a plain restart, which rebuilds the model at its initial weights and suspends the
    autosave. The copies on the ranks that lived stay, and rank 1's on its buddy: the next
    restart(restore="latest") takes step 5 from memory and the cell goes on from there."""
    s = four
    assert wait_until(s.cluster.standby.waiting, 120)
    model = _fresh(s)
    _arm(s, None, model)  # memory only
    assert run_out(s, "rs_out = am_train(5)") == [r[:5] for r in never_stopped]
    wedge = "am_train(1)\nif rank == 1:\n    import signal\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n" \
            "    _am_time.sleep(120)\n"
    policy = s.context.recovering.policy
    wedged_after, policy.wedge_timeout = policy.wedge_timeout, 3.0  # SIGINT at 0 and 2 s, then it is wedged
    try:
        with pytest.raises(RankTimeoutError):
            s.execute(wedge, timeout=5)
    finally:
        policy.wedge_timeout = wedged_after
    assert s.state == "ready" and s.autosave().suspended
    report = s.restart(restore="latest", setup=_remake)
    assert report.restored.memory is not None and report.restored.step == 5, repr(report)
    assert report.restored.memory.sources == {1: 2}  # the new engine holds nothing: its copy is on rank 2
    assert "autosave goes on from step 5 (it was suspended)" in repr(report)
    assert run_out(s, "rs_out = am_train(5)") == _after(never_stopped, 5)
    s.stop_autosave()


def test_a_resize_moves_the_buddies_and_a_rank_of_the_new_world_comes_back_from_memory(four, tmp_path, caplog):
    """A disk-only autosave stops at a resize, saying so (its checkpoints keep the old
    world's own state). An in-memory one, at a resize from 4 ranks to 3, is armed again,
    every rank's state copied under the new map (0->1, 1->2, 2->0) before it returns, and
    a rank of the new world killed after two more steps comes back from its new buddy's
    memory with the state it had (the model's and optimizer's full tensors, the loader's
    position)."""
    s = four
    model = _fresh(s)
    s.autosave(str(tmp_path / "disk"), every=2, model=model, optimizer="am_opt", loaders=["am_batches"])
    with caplog.at_level("WARNING", logger="fsdp_nb"):
        assert "autosave" not in str(s.resize(3))
    assert s.autosave() is None and "stopped the autosave" in caplog.text
    s.resize(4)
    model = _fresh(s)
    _arm(s, tmp_path / "auto", model)
    run_out(s, "rs_out = am_train(3)")
    report = s.resize(3)
    assert "autosave armed again from step 3" in str(report) and "(0->1, 1->2, 2->0)" in str(report)
    held = s.autosave().ranks
    assert [r.copies.own[-1] for r in held] == [3, 3, 3] and [tuple(r.copies.held) for r in held] == [(2,), (0,), (1,)]
    run_out(s, "rs_out = am_train(2)")
    want = run_out(s, "rs_out = (am_weights(), am_batches.pos, am_opt.state_dict()['state'][0]['step'].item())")
    _kill(s, [1])
    restarted = s.restart(restore="latest", setup=_remake)
    assert restarted.restored.step == 5 and restarted.restored.memory.sources == {1: 2}
    got = run_out(s, "rs_out = (am_weights(), am_batches.pos, am_opt.state_dict()['state'][0]['step'].item())")
    for (w_got, pos_got, step_got), (w_want, pos_want, step_want) in zip(got, want):
        assert w_got.keys() == w_want.keys() and all(torch.equal(w_got[k], w_want[k]) for k in w_want)
        assert (pos_got, step_got) == (pos_want, step_want)
    s.stop_autosave()


GATE = '''
import time as _gt_time
import fsdp_nb.autosave.rank_memory_copies as _gt_mc
from fsdp_nb.formats.packed_state import Leaf as _GtLeaf, view as _gt_view
from fsdp_nb.formats.run_state import decode as _gt_decode

_gt_plain = _gt_mc.stage

def _gt_slow(*args):
    _gt_time.sleep(0.5)  # the copy thread is slow to stage: the next optimizer step must wait for it
    return _gt_plain(*args)

_gt_gate = _gt_mc.MemoryCopies.optimizer_stepping
gt_gate_waits = []

def _gt_timed(self, optimizer):
    """The gate, timed: how long each optimizer step waited at it."""
    t0 = _gt_time.perf_counter()
    _gt_gate(self, optimizer)
    gt_gate_waits.append(_gt_time.perf_counter() - t0)

def gt_train_two():
    """Two steps in one cell, each rank's shards kept after the first."""
    global gt_after_one
    am_train(1)
    gt_after_one = {k: v.to_local().clone() for k, v in mc_m.state_dict().items()}
    am_train(1)

def gt_copy_of_step(step):
    """Whether this rank's own copy of ``step`` holds the shards it had after that step."""
    gen = next(g for g in _gt_mc.copies().own if g.step == step)
    body = _gt_decode(gen.rest, "memory", "test")
    tree, leaves = body["tree"]["model"], [_GtLeaf.parse(x) for x in body["leaves"]]
    return all(torch.equal(_gt_view(gen.flat, leaves[tree[k][1]]), v) for k, v in gt_after_one.items())
'''


def test_a_step_waits_for_the_copy_of_the_step_before_it(four, tmp_path):
    """The copy thread stages the shards of step 1 while step 2 runs; it is held back
    half a second, so step 2's optimizer would change them first, were it not held at its
    ``optimizer.step()`` until the staging is done. The copy of step 1 holds step 1's shards."""
    s = four
    model = _fresh(s)
    s.execute(GATE + "\n_gt_mc.stage = _gt_slow\n_gt_mc.MemoryCopies.optimizer_stepping = _gt_timed")
    try:
        _arm(s, None, model)
        s.execute("gt_train_two()")
        assert s.run(lambda: gt_copy_of_step(1)) == [True] * s.world_size  # noqa: F821 - an engine global
        # step 2's optimizer step itself waited at the gate for step 1's staging (not the cell's end)
        assert all(max(w) >= 0.3 for w in s.pull("gt_gate_waits")), s.pull("gt_gate_waits")
        assert all(r.blocked_s >= 0.4 for r in s.autosave().ranks)  # and the autosave counts that wait
    finally:
        s.execute("_gt_mc.stage = _gt_plain\n_gt_mc.MemoryCopies.optimizer_stepping = _gt_gate")
        s.stop_autosave()
