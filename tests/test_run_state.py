"""A run carried through a save: each rank's random state, a scheduler and a per-rank
loader saved beside the shards and given back, so the resumed run is the run that was
saved, bit for bit; fp16 that trains with the scaler a "16-mixed" wrap gives each rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RUN_LOOP, DropNet, forget_models, run_out

import fsdp_nb
from fsdp_nb import CheckpointError
from fsdp_nb.checkpoints.checkpoint_view import details_html

STATE = ["rs_sched", "rs_loader"]

FLAKY = """
class Flaky:
    def state_dict(self):
        if rank == 1:
            raise RuntimeError("rank 1's loader broke")
        return {}

    def load_state_dict(self, state):
        pass


class Classy(Flaky):
    def state_dict(self):
        return {"kept": Flaky()}


rs_flaky, rs_classy = Flaky(), Classy()
"""


@pytest.fixture
def run_model(sess):
    sess.execute(RUN_LOOP)
    sm = sess.wrap(DropNet, name="rs_model")
    sess.execute("rs_setup('rs_model')")
    yield sm
    forget_models(sess, "rs_model", optimizers=("rs_opt", "rs_sched", "rs_loader"))


def test_a_resumed_run_is_the_run_that_was_saved_bit_for_bit(sess, run_model, tmp_path):
    """Dropout, a shuffled per-rank loader, an LR schedule and AdamW: stopped after 3 steps
    and resumed, the next steps' losses and the final weights are the uninterrupted run's."""
    path = str(tmp_path / "step3")
    run_out(sess, "rs_out = rs_train('rs_model', 3)")
    handle = sess.save(path, run_model, optimizer="rs_opt", state=STATE, async_save=True)
    # the save keeps the moment it was called: these steps overlap its write
    uninterrupted = run_out(sess, "rs_out = rs_train('rs_model', 4)")
    handle.wait()
    want = run_out(sess, "rs_out = rs_weights('rs_model')")[0]

    # the run goes elsewhere (more steps, other random draws), then comes back
    run_out(sess, "rs_out = rs_train('rs_model', 2); torch.manual_seed(1234)")
    sess.load(path, run_model, optimizer="rs_opt", state=STATE)
    sess.execute("rs_it = None")  # a new iterator over the loader resumes where it was
    resumed = run_out(sess, "rs_out = rs_train('rs_model', 4)")
    assert resumed == uninterrupted  # per rank, every step, exactly
    assert uninterrupted[0] != uninterrupted[1]  # the ranks draw their own batches
    got = run_out(sess, "rs_out = rs_weights('rs_model')")[0]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k

    # without the random state, the same load draws other dropout masks
    sess.execute("torch.manual_seed(99 + rank)")
    sess.load(path, run_model, optimizer="rs_opt", state=STATE, rng=False)
    sess.execute("rs_it = None")
    assert run_out(sess, "rs_out = rs_train('rs_model', 4)") != uninterrupted

    info = fsdp_nb.inspect(path, verify=True)
    assert info.valid, info.problem
    assert info.run_state == {0: ("rng", *STATE), 1: ("rng", *STATE)}
    assert "train/rank1.pt" in info.files
    assert "rank 1's own state: rng, rs_sched, rs_loader" in info.summary()
    assert ">__1_0.distcp</td><td style='padding:1px 6px'>rng, rs_sched, rs_loader</td>" in details_html(info)
    # the offline tools read past the ranks' own files: the weights consolidate and export
    fsdp_nb.consolidate(path, str(tmp_path / "full.pt"))
    assert fsdp_nb.inspect(str(tmp_path / "full.pt")).model_keys == info.model_keys
    fsdp_nb.export_safetensors(path, str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").exists()


def test_bad_state_names_are_refused_before_any_work(sess, run_model, tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(NameError, match="no engine global named 'nowhere'"):
        sess.save(path, run_model, state=["nowhere"])
    sess.execute("rs_plain = 3")
    with pytest.raises(TypeError, match="'rs_plain' is a int, which has no state_dict or load_state_dict"):
        sess.save(path, run_model, state=["rs_plain"])
    assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match="state must be a list"):
        sess.save(path, run_model, state="rs_sched")
    with pytest.raises(ValueError, match="random state goes by"):
        sess.save(path, run_model, state=["rng"])
    with pytest.raises(ValueError, match="sharded=False writes one file"):
        sess.save(str(tmp_path / "full.pt"), run_model, state=["rs_sched"], sharded=False)
    sess.save(path, run_model, optimizer="rs_opt", state=["rs_sched"])
    with pytest.raises(CheckpointError, match=r"keeps no 'rs_loader'.*state= may name 'rs_sched'"):
        sess.load(path, run_model, state=["rs_loader"])
    sess.save(str(tmp_path / "full.pt"), run_model, sharded=False)
    with pytest.raises(CheckpointError, match="keeps no per-rank state"):
        sess.load(str(tmp_path / "full.pt"), run_model, rng=True)

    # a failure on one rank, or an object on one rank only, is every rank's error: no rank
    # is left waiting in a collective, and nothing is written or loaded
    sess.execute(FLAKY)
    with pytest.raises(CheckpointError, match="RuntimeError: rank 1's loader broke"):
        sess.save(str(tmp_path / "flaky"), run_model, state=["rs_flaky"])
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match="a state_dict that a load would refuse"):
        sess.save(str(tmp_path / "flaky"), run_model, state=["rs_classy"])
    assert not (tmp_path / "flaky").exists()
    sess.execute("rs_once = torch.optim.lr_scheduler.StepLR(rs_opt, 2)", ranks=[0])
    with pytest.raises(NameError, match="no engine global named 'rs_once'"):
        sess.load(path, run_model, state=["rs_once"])
    assert sess.all_reduce_check() == 1.0
    sess.execute("del rs_flaky, rs_classy")
    sess.execute("del rs_once", ranks=[0])


def test_fp16_trains_with_the_scaler_a_16_mixed_wrap_gives(sess):
    """A loss small enough that its fp16 gradients underflow: without scaling no weight
    moves; with the rank's ``scaler`` the loss falls as it does in bf16 (whose range is
    fp32's). A cell that fails on one rank inside the scaler's step drops that step on
    every rank; a typo cell after ``unscale_`` leaves it, and one after ``step`` runs the
    update."""
    sess.execute(RUN_LOOP)
    after = {}
    try:
        for precision, scaled in (("16-mixed", False), ("16-mixed", True), ("bf16-mixed", False)):
            sess.wrap(DropNet, name="rs_model", mixed_precision=precision)
            # gradients near 1e-9: below fp16's smallest number (6e-8), and an eps below
            # them, so that AdamW moves the weights as far as it would for a loss of 1
            sess.execute("rs_setup('rs_model', scale=1e-9, lr=0.05, eps=1e-15)")
            before = run_out(sess, "rs_out = rs_eval('rs_model')")[0]
            run_out(sess, f"rs_out = rs_train('rs_model', 12, {scaled})")
            after[(precision, scaled)] = run_out(sess, "rs_out = rs_eval('rs_model')")[0] / before
            if precision == "16-mixed":
                assert run_out(sess, "rs_out = type(scaler).__name__") == ["CountingScaler"] * 2
        # every gradient underflowed: only AdamW's weight decay moved anything
        assert after[("16-mixed", False)] == pytest.approx(1.0, abs=1e-3)
        assert after[("16-mixed", True)] < 0.8
        assert after[("bf16-mixed", False)] < 0.8
        before = run_out(sess, "rs_out = scaler.state_dict()")
        # rank 1 alone overflows (an inf loss): every rank skips that step and halves its
        # scale, since found_inf is agreed across ranks
        run_out(sess, "rs_it = None; rs_scale = float('inf') if rank == 1 else 1.0\nrs_out = rs_train('rs_model', 1, True)")
        state = run_out(sess, "rs_out = scaler.state_dict()")
        assert state[0] == state[1]
        assert [s["skipped"] for s in state] == [before[0]["skipped"] + 1] * 2
        assert state[0]["scale"] == before[0]["scale"] / 2
        # rank 1 fails after the unscale (whose found_inf all-reduce is its last collective)
        # and before the step, while rank 0 ends the cell: the scaler's step is dropped on
        # both, or rank 0 alone would refuse the next unscale ("already been called")
        sess.execute("rs_scale = 1.0\nrs_step = 'scaler.scale(rs_model(torch.ones(2, 8)).float().sum()).backward()\\n"
                     "scaler.unscale_(rs_opt)'")
        with pytest.raises(fsdp_nb.RankError, match="after the unscale") as err:
            sess.execute("exec(rs_step)\nif rank == 1:\n    raise ValueError('after the unscale')")
        assert err.value.first.rank == 1
        sess.execute("exec(rs_step)\nscaler.step(rs_opt)\nscaler.update()\nrs_opt.zero_grad()", timeout=60)
        # a typo after unscale_ cuts no step short: the scaler's step goes on, and its step
        # leaves the gradients unscaled once (a dropped step would unscale them again)
        sess.execute("exec(rs_step)\nrs_g = [p.grad.to_local().clone() for p in rs_model.parameters()]")
        with pytest.raises(fsdp_nb.RankError, match="NameError"):
            sess.execute("rs_typo")
        assert run_out(sess, "scaler.step(rs_opt)\n"
                       "rs_out = all(torch.equal(p.grad.to_local(), g) for p, g in zip(rs_model.parameters(), rs_g))\n"
                       "scaler.update()\nrs_opt.zero_grad()") == [True, True]
        # a typo between scaler.step and scaler.update: the update runs, the next step too
        sess.execute("exec(rs_step)\nscaler.step(rs_opt)\nrs_opt.zero_grad()")
        with pytest.raises(fsdp_nb.RankError, match="NameError"):
            sess.execute("rs_typo")
        sess.execute("exec(rs_step)\nscaler.step(rs_opt)\nscaler.update()\nrs_opt.zero_grad()", timeout=60)
    finally:
        sess.execute("[globals().pop(n, None) for n in ('rs_step', 'rs_g')]", output=None)
        forget_models(sess, "rs_model", optimizers=("rs_opt", "rs_sched", "rs_loader", "scaler"))


def test_several_models_go_in_one_checkpoint_and_come_back_each_to_its_own(sess, tmp_path):
    """A teacher and a student (each with its AdamW) and the run's state in one save; loaded
    back together, or one of them alone; offline, each is consolidated and exported alone."""
    sess.execute(RUN_LOOP)
    names = ("rs_student", "rs_teacher")
    models = [sess.wrap(DropNet, name=n) for n in names]
    path = str(tmp_path / "both")
    try:
        sess.execute("rs_setup('rs_student'); rs_t_opt = torch.optim.AdamW(rs_teacher.parameters(), lr=0.1)\n"
                     "rs_train('rs_student', 2)\n"
                     "rs_teacher(torch.ones(2, 8)).sum().backward(); rs_t_opt.step(); rs_t_opt.zero_grad()")
        info = sess.save(path, models, optimizer=["rs_opt", "rs_t_opt"], state=STATE)
        assert set(info.models) == set(names) and info.has_optimizer
        assert info.models["rs_teacher"]["optimizer"] == "rs_t_opt"
        assert "rs_student.model.inp.weight" in info.tensors and "rs_teacher.optim.state.out.bias.exp_avg" in info.tensors
        want = {n: run_out(sess, f"rs_out = rs_weights({n!r})")[0] for n in names}
        moments_of = "rs_out = [s['exp_avg'].to_local().clone() for s in rs_t_opt.state_dict()['state'].values()]"
        moments = run_out(sess, moments_of)
        after = run_out(sess, "rs_out = rs_train('rs_student', 3)")
        sess.execute("rs_teacher(torch.ones(2, 8)).sum().backward(); rs_t_opt.step(); rs_t_opt.zero_grad()")

        sess.load(path, models, optimizer=["rs_opt", "rs_t_opt"], state=STATE)
        for n in names:
            got = run_out(sess, f"rs_out = rs_weights({n!r})")[0]
            assert all(torch.equal(got[k], want[n][k]) for k in want[n]), n
        back = run_out(sess, moments_of)
        assert all(torch.equal(b, m) for rank_b, rank_m in zip(back, moments) for b, m in zip(rank_b, rank_m))
        sess.execute("rs_it = None")
        assert run_out(sess, "rs_out = rs_train('rs_student', 3)") == after  # the run goes on as it did

        sess.execute("rs_teacher(torch.ones(2, 8)).sum().backward(); rs_t_opt.step(); rs_t_opt.zero_grad()")
        sess.load(path, "rs_teacher")  # one of them alone, from the part of its name
        got = run_out(sess, "rs_out = rs_weights('rs_teacher')")[0]
        assert all(torch.equal(got[k], want["rs_teacher"][k]) for k in got)

        with pytest.raises(CheckpointError, match=r"holds several models, 'rs_student', 'rs_teacher': pass model="):
            fsdp_nb.consolidate(path, str(tmp_path / "one.pt"))
        full = fsdp_nb.consolidate(path, str(tmp_path / "teacher.pt"), model="rs_teacher")
        assert full.model_keys == list(want["rs_teacher"]) and full.has_optimizer
        fsdp_nb.export_safetensors(path, str(tmp_path / "student"), model="rs_student")
        from safetensors.torch import load_file

        exported = load_file(str(tmp_path / "student" / "model.safetensors"))
        assert all(torch.equal(exported[k], want["rs_student"][k]) for k in want["rs_student"])

        with pytest.raises(ValueError, match="several models .* sharded=True, layout='fsdp_nb'"):
            sess.save(str(tmp_path / "x.pt"), models, sharded=False)
        with pytest.raises(TypeError, match="a list of as many engine global names"):
            sess.save(str(tmp_path / "x"), models, optimizer="rs_opt")
        sess.wrap(DropNet, name="rs_third")
        with pytest.raises(CheckpointError, match="none named 'rs_third': each loads into the model of its own name"):
            sess.load(path, "rs_third")
    finally:
        forget_models(sess, *names, "rs_third", optimizers=("rs_opt", "rs_t_opt", "rs_sched", "rs_loader"))


def test_autosave_counts_the_loops_steps_only(sess, run_model, tmp_path):
    """Plain SGD has no state, so each save's ``get_state_dict`` steps it (at lr 0) to make
    some: those steps are not the loop's, and the count stays the loop's."""
    root = tmp_path / "auto"
    # the loop's optimizer from now on (an optimizer of the model that autosave leaves out is refused)
    sess.execute("rs_sgd = rs_opt = torch.optim.SGD(rs_model.parameters(), lr=0.01)")
    try:
        sess.autosave(str(root), every=2, model=run_model, optimizer="rs_sgd", keep_last=None)
        sess.execute("for _ in range(7):\n    rs_model(torch.ones(2, 8)).sum().backward(); rs_sgd.step(); rs_sgd.zero_grad()")
        assert [r.step for r in sess.autosave().ranks] == [7, 7]
        sess.stop_autosave()
        sess.save(str(tmp_path / "after"), run_model)  # waits for the last autosave's commit first
        assert [i.step for i in fsdp_nb.list_checkpoints(str(root))] == [2, 4, 6]
    finally:
        sess.execute("del rs_sgd")


def test_an_fp16_run_resumes_bit_for_bit_with_its_scaler(sess, tmp_path):
    """The same stop and resume in ``"16-mixed"``, the loss scaled by the rank's
    ``scaler``, whose state goes with the run's."""
    sess.execute(RUN_LOOP)
    model = sess.wrap(DropNet, name="rs_model", mixed_precision="16-mixed")
    try:
        sess.execute("rs_setup('rs_model')")
        run_out(sess, "rs_out = rs_train('rs_model', 3, True)")
        sess.save(str(tmp_path / "fp16"), model, optimizer="rs_opt", state=[*STATE, "scaler"])
        uninterrupted = run_out(sess, "rs_out = rs_train('rs_model', 4, True)")
        scale = run_out(sess, "rs_out = scaler.state_dict()")
        run_out(sess, "rs_out = rs_train('rs_model', 2, True); scaler.update(1.0)")
        sess.load(str(tmp_path / "fp16"), model, optimizer="rs_opt", state=[*STATE, "scaler"])
        sess.execute("rs_it = None")
        assert run_out(sess, "rs_out = rs_train('rs_model', 4, True)") == uninterrupted
        assert run_out(sess, "rs_out = scaler.state_dict()") == scale
    finally:
        forget_models(sess, "rs_model", optimizers=("rs_opt", "rs_sched", "rs_loader", "scaler"))


def test_a_new_session_resumes_the_run_bit_for_bit(sess, run_model, session_factory, tmp_path):
    """Saved from one session, resumed in another with engines of its own: the same
    steps as the run that never stopped."""
    path = str(tmp_path / "step3")
    run_out(sess, "rs_out = rs_train('rs_model', 3)")
    sess.save(path, run_model, optimizer="rs_opt", state=STATE)
    uninterrupted = run_out(sess, "rs_out = rs_train('rs_model', 4)")
    other = session_factory(2, private=True)
    try:
        other.execute(RUN_LOOP)
        model = other.wrap(DropNet, name="rs_model")  # another seed: other initial weights
        other.execute("rs_setup('rs_model'); torch.manual_seed(77)")
        other.load(path, model, optimizer="rs_opt", state=STATE)
        assert run_out(other, "rs_out = rs_train('rs_model', 4)") == uninterrupted
    finally:
        other.shutdown()
