"""Where autosave meets the other features: a loader of the user's own class, a second
optimizer, the user's own async saves, a cell's end, a load, a dead or wedged engine.

Each test trains a small run (``AM_LOOP``: dropout, a loader drawn with ``next()``, AdamW
and a scheduler) on real engines. Tests that kill engines share a private session
(``killable``); the others share ``sess`` and clean up the names they bind.
"""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import DropNet, forget_models, killable_session, mark_code, on_marker, run_out, whole

import fsdp_nb
from fsdp_nb import CheckpointError
from fsdp_nb.errors import DeadRankError, RankTimeoutError
from fsdp_nb.runtime.cluster import wait_until

AM_LOOP = '''
import sys as _am_sys, threading as _am_th, time as _am_time
import torch
import torch.nn.functional as F

class AmBatches:
    """A loader of its own class, as nanoGPT's loop draws batches: next(), and its
    position through state_dict() / load_state_dict()."""

    def __init__(self, n=96, dim=8):
        g = torch.Generator().manual_seed(7 + rank)
        self.x = torch.randn(n, dim, generator=g)
        self.pos = 0

    def next(self):
        i = self.pos % len(self.x)
        self.pos += 4
        xb = self.x[i:i + 4]
        return xb, xb.sum(1, keepdim=True)

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]

def am_setup(name, two=False):
    """The run's objects for model ``name``: its loader, one optimizer (am_opt) or two
    (am_emb_opt for the first layer, am_rest_opt for the rest), a scheduler."""
    global am_name, am_opts, am_batches, am_sched
    m = globals()[name]
    am_name, am_batches = name, AmBatches()
    if two:
        globals()["am_emb_opt"] = torch.optim.AdamW(m.inp.parameters(), lr=0.02)
        globals()["am_rest_opt"] = torch.optim.AdamW(m.out.parameters(), lr=0.01)
        am_opts = ("am_emb_opt", "am_rest_opt")
    else:
        globals()["am_opt"] = torch.optim.AdamW(m.parameters(), lr=0.02)
        am_opts = ("am_opt",)
    am_sched = torch.optim.lr_scheduler.StepLR(globals()[am_opts[-1]], step_size=2, gamma=0.7)

def am_train(n):
    m, losses = globals()[am_name], []
    m.train()
    for _ in range(n):
        xb, yb = am_batches.next()
        loss = F.mse_loss(m(xb), yb)
        loss.backward()
        for o in am_opts:
            globals()[o].step()
        for o in am_opts:
            globals()[o].zero_grad()
        am_sched.step()
        losses.append(loss.item())
    return losses

def am_weights():
    return {k: v.full_tensor().clone() for k, v in globals()[am_name].state_dict().items()}
'''

OPTIMIZERS = ("am_opt", "am_emb_opt", "am_rest_opt", "am_sched", "am_batches")


@pytest.fixture
def run(sess):
    """A run on the shared session: model ``am_m`` with one optimizer, ``am_opt``."""
    sess.execute(AM_LOOP)
    model = sess.wrap(DropNet, name="am_m")
    sess.execute("am_setup('am_m')")
    yield model
    if sess.autosave() is not None:
        sess.stop_autosave()
    sess.execute("for _n in [n for n in " + repr(OPTIMIZERS) + " if n in globals()]: del globals()[_n]")
    forget_models(sess, "am_m")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _committed(path) -> bool:
    return (path / ".fsdp_nb_complete").exists()


# -- 2: an async save is never torn by a step -----------------------------------------

HOLD_STAGING = '''
from torch.distributed.checkpoint.staging import DefaultStager as _AmStager
_am_go = _am_th.Event()
_am_plain_stage = _AmStager._stage

def _am_held_stage(self, sd, **kw):
    _am_go.wait(120)  # the copy waits until the test lets it go
    return _am_plain_stage(self, sd, **kw)

_AmStager._stage = _am_held_stage

def _am_main_thread_waits():
    f = _am_sys._current_frames().get(_am_th.main_thread().ident)
    while f is not None and not (f.f_code.co_name == "wait" and f.f_code.co_filename.endswith("threading.py")):
        f = f.f_back
    return f is not None

def am_held_step(opt):
    # let the copy go once this thread waits for it in the step, or, if the step does
    # not wait, once the step is over (the copy then sees the stepped weights)
    stepped = _am_th.Event()
    def release():
        while not (stepped.is_set() or _am_main_thread_waits()):
            _am_time.sleep(0.002)
        _am_go.set()
    _am_th.Thread(target=release, daemon=True).start()
    globals()[opt].step()
    stepped.set()
'''


@pytest.mark.parametrize("named", [None, "am_emb_opt"], ids=["no optimizer named", "a second optimizer steps"])
def test_a_step_during_an_async_saves_copy_waits_for_it(sess, tmp_path, named):
    """The copy of an async save is held until the training thread waits for it in a
    step, or the step is over: the checkpoint holds the weights of the moment it was
    saved, whichever optimizer steps, named or not, on a model with no buffers."""
    sess.execute(AM_LOOP)
    sess.wrap(DropNet, name="am_t")
    try:
        sess.execute("am_setup('am_t', two=True)\nxb, yb = am_batches.next()\n"
                     "F.mse_loss(am_t(xb), yb).backward()\n" + HOLD_STAGING)
        before = run_out(sess, "rs_out = am_weights()")[0]
        path = tmp_path / "held"
        try:
            h = sess.save(str(path), "am_t", optimizer=named, async_save=True)
            sess.execute("am_held_step('am_rest_opt')")
            assert not _same(run_out(sess, "rs_out = am_weights()")[0], before)  # the step ran
            assert h.wait().valid
        finally:
            sess.execute("_am_go.set(); _AmStager._stage = _am_plain_stage")
        sess.load(str(path), "am_t")
        assert _same(run_out(sess, "rs_out = am_weights()")[0], before)  # not the stepped weights
    finally:
        sess.execute("for _n in [n for n in " + repr(OPTIMIZERS) + " if n in globals()]: del globals()[_n]")
        forget_models(sess, "am_t")


# -- 3: the user's own async save stays the user's ------------------------------------

def test_an_autosave_leaves_the_users_async_save_to_its_handle(sess, run, tmp_path):
    sess.autosave(str(tmp_path / "auto"), every=1, model=run, optimizer="am_opt")
    sess.execute("am_train(1)")
    h = sess.save(str(tmp_path / "mine"), run, optimizer="am_opt", extra={"step": 1}, async_save=True)
    sess.execute("am_train(1)")  # the autosave of step 2 first waits for the user's save
    info = h.wait()
    assert info.valid and info.extra == {"step": 1}
    h2 = sess.save(str(tmp_path / "mine2"), run, optimizer="am_opt", extra={"step": 2}, async_save=True)
    sess.execute("am_train(1)")
    assert h2.wait().valid


# -- 13: a save due at a cell's last step is written at the cell's end ---------------

def test_a_save_due_at_a_cells_last_step_is_written_at_its_end_and_a_failed_cell_drops_it(sess, run, tmp_path):
    root = tmp_path / "auto"
    sess.autosave(str(root), every=2, model=run, optimizer="am_opt", keep_last=None)
    sess.execute("am_train(2)")  # the cell ends on step 2: no forward follows it
    assert wait_until(lambda: _committed(root / "step-2"), 60)
    assert sess.autosave().ranks[0].saved == str(root / "step-2")
    sess.run(lambda: am_train(2))  # noqa: F821 - an engine global (AM_LOOP); a sess.run call ends alike
    assert wait_until(lambda: _committed(root / "step-4"), 60)
    with pytest.raises(fsdp_nb.RankError, match="the cell broke"):
        sess.execute("am_train(2)\nraise RuntimeError('the cell broke')")
    # step 6 fell due in a cell that failed: dropped on every rank, never written
    assert [(r.step, r.due) for r in sess.autosave().ranks] == [(6, False)] * 2
    sess.execute("am_train(1)")
    sess.stop_autosave()
    sess.save(str(tmp_path / "drained"), run)  # waits for every save still writing
    assert [i.step for i in fsdp_nb.list_checkpoints(str(root))] == [2, 4]


# -- 1 and 14: what an autosave cannot place is refused by name ------------------------

def test_a_loader_of_its_own_class_in_state_is_refused_by_name_and_nothing_changes(sess, run, tmp_path):
    sess.autosave(str(tmp_path / "first"), every=5, model=run, optimizer="am_opt", state=["am_sched"])
    with pytest.raises(TypeError, match=r"'am_batches' \(a AmBatches with next\(\)\).*loaders=\[\.\.\.\].*"
                                        r"Nothing changed"):
        sess.autosave(str(tmp_path / "second"), every=2, model=run, optimizer="am_opt", state=["am_batches"])
    on = sess.autosave()
    assert on.root == str(tmp_path / "first") and on.state == ("am_sched",)
    sess.autosave(str(tmp_path / "second"), every=2, model=run, optimizer="am_opt", loaders=["am_batches"])
    with pytest.raises(ValueError, match="'am_sched' is named in both loaders= and state="):
        sess.autosave(str(tmp_path / "second"), every=2, model=run, optimizer="am_opt", loaders=["am_sched"],
                      state=["am_sched"])
    sess.execute("am_plain = torch.utils.data.DataLoader(range(8))")
    try:
        with pytest.raises(TypeError, match="'am_plain' is a DataLoader, which has no state_dict"):
            sess.autosave(str(tmp_path / "second"), every=2, model=run, optimizer="am_opt", loaders=["am_plain"])
    finally:
        sess.execute("del am_plain")
    assert sess.autosave().root == str(tmp_path / "second")


def test_an_optimizer_of_the_model_left_out_of_the_autosave_is_refused_by_name(sess, run, tmp_path):
    sess.execute("del am_opt\nam_setup('am_m', two=True)")
    with pytest.raises(ValueError, match=r"'am_emb_opt' hold an optimizer of its parameters too.*"
                                         r"optimizer=\['am_rest_opt', 'am_emb_opt'\].*Nothing changed"):
        sess.autosave(str(tmp_path / "auto"), every=2, model=run, optimizer="am_rest_opt")
    assert sess.autosave() is None
    on = sess.autosave(str(tmp_path / "auto"), every=2, model=run, optimizer=["am_emb_opt", "am_rest_opt"])
    assert on.optimizers == ("am_emb_opt", "am_rest_opt")


# -- 16: a load that keeps no step is refused while the autosave counts ----------------

def test_a_load_of_a_checkpoint_without_a_step_is_refused_while_autosave_counts(sess, run, tmp_path):
    sess.execute("am_train(1)")
    sess.save(str(tmp_path / "nostep"), run, optimizer="am_opt")
    sess.save(str(tmp_path / "step3"), run, optimizer="am_opt", extra={"step": 3})
    sess.autosave(str(tmp_path / "auto"), every=4, model=run, optimizer="am_opt")
    sess.execute("am_train(2)")
    trained = run_out(sess, "rs_out = am_weights()")[0]
    with pytest.raises(CheckpointError, match=r"keeps no step \(extra\['step'\]\).*Nothing was loaded.*"
                                              r"sess.stop_autosave\(\).*extra=\{'step': N\}"):
        sess.load(str(tmp_path / "nostep"), run, optimizer="am_opt")
    assert _same(run_out(sess, "rs_out = am_weights()")[0], trained)
    assert [r.step for r in sess.autosave().ranks] == [2, 2]
    sess.load(str(tmp_path / "step3"), run, optimizer="am_opt")
    assert [r.step for r in sess.autosave().ranks] == [3, 3]  # counting on from the loaded step


# -- 17: the last committed save, and the one in flight -------------------------------

HOLD_WRITES = '''
import os as _am_os
import fsdp_nb.formats.checksums as _am_cs
_am_plain_write = _am_cs.ChecksumStream.write
def _am_held_write(self, b, _release={release!r}):
    n = _am_plain_write(self, b)
    while not _am_os.path.exists(_release):  # the test lets the write go on
        _am_time.sleep(0.01)
    return n
_am_cs.ChecksumStream.write = _am_held_write
'''


def test_autosave_names_its_last_committed_save_and_the_one_still_writing(sess, run, tmp_path):
    root, release = tmp_path / "auto", tmp_path / "release"
    sess.autosave(str(root), every=1, model=run, optimizer="am_opt")
    sess.execute(HOLD_WRITES.format(release=str(release)))
    try:
        # step 1, then an eval forward: its boundary at the latest, the save is under way
        sess.execute("am_train(1)\nwith torch.no_grad():\n    am_m.eval(); am_m(torch.ones(2, 8))")
        r0 = sess.autosave().ranks[0]
        assert r0.saved is None and r0.writing == str(root / "step-1")
        assert f"last save none yet, writing {root / 'step-1'}" in repr(sess.autosave())
        release.touch()
        assert wait_until(lambda: _committed(root / "step-1"), 60)
        assert wait_until(lambda: sess.autosave().ranks[0].saved == str(root / "step-1"), 60)
        assert sess.autosave().ranks[0].writing is None
    finally:
        release.touch()
        sess.execute("_am_cs.ChecksumStream.write = _am_plain_write")


# -- 1, 14 and 11: a killed or wedged engine, and the run goes on -----------------------

@pytest.fixture(scope="module")
def killable_ranks(session_factory):
    """A 2-rank session of its own, for the tests that kill engines."""
    yield from killable_session(session_factory, 2, AM_LOOP)


@pytest.fixture
def killable(killable_ranks):
    """The 2-rank session, whole (``helpers.whole``)."""
    return whole(killable_ranks, 2)


def _remake_two():
    """``restart(setup=)``: the run's objects on every rank, for the rebuilt model (a
    replaced rank has none; a survivor's are made anew, the checkpoint fills them)."""
    am_setup("am_k", two=True)  # noqa: F821 - an engine global (AM_LOOP), replayed on a new engine


def _remake_one():
    """``restart(setup=)`` for ``am_w``, as :func:`_remake_two`."""
    am_setup("am_w")  # noqa: F821 - an engine global (AM_LOOP), replayed on a new engine


def _fresh(s, name: str, two: bool):
    torch.manual_seed(0)  # the wrap's seed: the same initial weights each time
    model = s.wrap(DropNet, name=name)
    s.execute(f"am_setup({name!r}, two={two}); torch.manual_seed(10 + rank)")
    return model


def test_a_run_with_its_own_loader_class_and_two_optimizers_resumes_bit_for_bit(killable, tmp_path):
    """Autosave every 2 steps of a loop that draws with ``next()`` from a loader of its
    own class and steps two optimizers; rank 1 killed in step 5; restart(restore="latest")
    and the unchanged training cell gives steps 5 to 10 of the run that never stopped."""
    s = killable
    _fresh(s, "am_k", two=True)
    never_stopped = run_out(s, "rs_out = am_train(10)")
    want = run_out(s, "rs_out = am_weights()")[0]

    model = _fresh(s, "am_k", two=True)
    root = tmp_path / "auto"
    s.autosave(str(root), every=2, model=model, optimizer=["am_emb_opt", "am_rest_opt"], loaders=["am_batches"],
               state=["am_sched"], keep_last=2)
    assert run_out(s, "rs_out = am_train(4)") == [r[:4] for r in never_stopped]
    assert wait_until(lambda: _committed(root / "step-4"), 60)  # written at the cell's end
    marker = tmp_path / "in_step_5"
    on_marker(marker, lambda: s.cluster.signal([1], signal.SIGKILL))  # by the session's verified handle
    with pytest.raises(DeadRankError):
        s.execute("am_train(1)\nif rank == 1:\n    " + mark_code(marker) + "    _am_time.sleep(30)\nam_train(2)\n")
    report = s.restart(restore="latest", setup=_remake_two)
    assert report.restored.step == 4 and report.restored.optimizer == ("am_emb_opt", "am_rest_opt")
    assert "optimizers 'am_emb_opt', 'am_rest_opt', 'am_batches', 'am_sched'" in repr(report)
    assert "autosave goes on from step 4" in repr(report)
    assert run_out(s, "rs_out = am_batches.pos") == [16, 16]  # taken at step 4's end, before step 5's batch
    assert run_out(s, "rs_out = am_train(6)") == [r[4:] for r in never_stopped]
    got = run_out(s, "rs_out = am_weights()")[0]
    assert _same(got, want)
    assert wait_until(lambda: _committed(root / "step-10"), 60)  # re-armed
    s.stop_autosave()
    forget_models(s, "am_k", optimizers=("am_emb_opt", "am_rest_opt", "am_sched", "am_batches"))


def test_after_the_sessions_own_restart_autosave_waits_suspended_for_a_restore(killable, tmp_path):
    """A rank that ignores Ctrl-C is wedged, killed and replaced by the session's own
    restart, which rebuilds the model at its initial weights: the autosave is suspended
    (saving them would put them over the run's checkpoints), the error says so, and
    restart(restore="latest") arms it again from the restored step."""
    s = killable
    assert wait_until(s.cluster.standby.waiting, 120)
    _fresh(s, "am_w", two=False)
    never_stopped = run_out(s, "rs_out = am_train(6)")
    model = _fresh(s, "am_w", two=False)
    root = tmp_path / "auto"
    s.autosave(str(root), every=2, model=model, optimizer="am_opt", loaders=["am_batches"], state=["am_sched"])
    assert run_out(s, "rs_out = am_train(4)") == [r[:4] for r in never_stopped]
    assert wait_until(lambda: _committed(root / "step-4"), 60)
    wedge = "am_train(1)\nif rank == 1:\n    import signal\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n" \
            "    _am_time.sleep(120)\n"
    policy = s.context.recovering.policy
    wedged_after, policy.wedge_timeout = policy.wedge_timeout, 3.0  # SIGINT at 0 and 2 s, then it is wedged
    try:
        with pytest.raises(RankTimeoutError) as info:
            s.execute(wedge, timeout=5)
    finally:
        policy.wedge_timeout = wedged_after
    said = "\n".join([str(info.value), *getattr(info.value, "__notes__", ())])
    assert "autosave suspended: a restart rebuilt the models" in said
    assert s.state == "ready" and s.autosave().suspended
    assert "suspended: a restart rebuilt the models" in repr(s.autosave())
    report = s.restart(restore="latest", setup=_remake_one)
    assert "autosave goes on from step 4 (it was suspended)" in repr(report)
    assert not s.autosave().suspended
    assert run_out(s, "rs_out = am_train(2)") == [r[4:] for r in never_stopped]
    assert wait_until(lambda: _committed(root / "step-6"), 60)
    s.stop_autosave()
    assert s.autosave() is None
    forget_models(s, "am_w", optimizers=("am_opt", "am_sched", "am_batches"))
