"""Bad input is refused before any work starts, with what was wrong and what is allowed."""

from __future__ import annotations

import pytest

from fsdp_nb.checkpoints.arguments import check_optimizer, model_name, raise_outcomes
from fsdp_nb.checkpoints.wire_checkpoint import Outcome
from fsdp_nb.errors import CheckpointError, CorruptCheckpointError
from fsdp_nb.frontends.magics import fsdp_command, parse_px
from fsdp_nb.lifetime.keepalive import check_keep_alive
from fsdp_nb.models.wire_wrap_options import make_options
from fsdp_nb.runtime import checks
from fsdp_nb.runtime.launch_settings import split_cluster_kwargs


@pytest.mark.parametrize("n, backend, launcher, match", [
    (0, None, "local", "n must be a positive int"),
    (True, None, "local", "n must be a positive int"),
    (2, "mpi", "local", "unknown backend 'mpi'; allowed: gloo, nccl"),
    (2, "gloo", "nowhere", "unknown launcher 'nowhere'; allowed: .*local"),
    (4, "nccl", "local", "needs 4 GPUs, but this machine has 0"),
])
def test_session_arguments_are_checked_before_anything_starts(n, backend, launcher, match):
    with pytest.raises(ValueError, match=match):
        checks.validate(n, backend, launcher)


def test_a_machine_without_gpus_gets_two_gloo_ranks():
    assert checks.validate(None, None, "local") == (2, "gloo")
    assert checks.validate(3, None, "mpi") == (3, None)  # decided from the engines' probes


@pytest.mark.parametrize("check, value", [
    (checks.check_grace, -1), (checks.check_grace, "3"), (checks.check_grace, True),
    (checks.check_standby, 1), (check_keep_alive, -5), (check_keep_alive, "yes"),
])
def test_settings_refuse_what_they_cannot_mean(check, value):
    with pytest.raises(ValueError):
        check(value)


def test_keep_alive_is_false_true_or_seconds():
    assert check_keep_alive(False) is False and check_keep_alive(True) is True
    assert check_keep_alive(30) == 30.0


def test_ranks_and_output_of_a_call():
    assert checks.check_ranks(None, 3) == [0, 1, 2] and checks.check_ranks([2, 0], 3) == [0, 2]
    for bad in ([], [0, 0], [3], [True]):
        with pytest.raises(ValueError, match="this session has ranks 0..2"):
            checks.check_ranks(bad, 3)
    with pytest.raises(TypeError):
        checks.check_ranks("01", 3)
    assert checks.check_output("all", [0, 1]) is None and checks.check_output("rank1", [0, 1]) == (1,)
    assert checks.check_output("each", [0, 1]) is None
    assert checks.check_output("none", [0, 1]) == () and checks.check_output(None, [0, 1]) == ()  # nothing shown
    with pytest.raises(ValueError, match="allowed: 'all', 'each', 'none', 'rank0'"):
        checks.check_output("rank1", [0])


def test_cluster_settings_are_sorted_between_the_cluster_and_its_launcher():
    out = split_cluster_kwargs("mpi", {"controller_ip": "*", "mpi_args": ["-x", "A"]})
    assert out["controller_ip"] == "*"
    assert out["config"]["MPIEngineSetLauncher"]["mpi_args"] == ["-x", "A"]
    with pytest.raises(ValueError, match="unknown setting.*mpi_agrs.*MPIEngineSetLauncher settings"):
        split_cluster_kwargs("mpi", {"mpi_agrs": []})
    with pytest.raises(ValueError, match="cannot be given as cluster settings"):
        split_cluster_kwargs("local", {"n": 3})


def test_px_lines_are_read_or_refused_with_the_usage():
    args = parse_px("--ranks 0,2 --output rank0 --timeout 5")
    assert (args.ranks, args.output, args.timeout) == ([0, 2], "rank0", 5.0)
    assert parse_px("").ranks is None
    for bad in ("--ranks", "--ranks a,b", "--colour red"):
        with pytest.raises(ValueError, match=r"usage: %%px"):
            parse_px(bad)


def test_fsdp_magic_refuses_unknown_verbs_and_bad_usage_before_doing_anything():
    with pytest.raises(ValueError, match="allowed: start, status, stop, list, attach, debug"):
        fsdp_command("launch")
    for line, usage in (("start 2 --gpus 4", "%fsdp start"), ("attach a b", "%fsdp attach"),
                        ("debug one", "%fsdp debug")):
        with pytest.raises(ValueError, match=usage):
            fsdp_command(line)


def test_status_without_a_session_says_so(capsys, monkeypatch):
    from fsdp_nb.frontends import magics

    monkeypatch.setattr(magics.TARGET, "active", None)  # a session another test opened is not this one's
    assert fsdp_command("status") is None
    assert "no fsdp_nb session" in capsys.readouterr().out


def test_wrap_options_name_what_is_allowed():
    with pytest.raises(TypeError, match="unknown wrap option.*'shard'.*allowed: .*sharding"):
        make_options(shard="full")
    with pytest.raises(ValueError):
        make_options(sharding="most")
    assert make_options(sharding="grad_op").sharding == "grad_op"


def test_checkpoint_arguments_become_engine_names():
    assert model_name("model") == "model"
    with pytest.raises(ValueError, match="not a Python identifier"):
        model_name("my model")
    with pytest.raises(TypeError, match="ShardedModel"):
        model_name(3)
    assert check_optimizer(None) is None and check_optimizer("opt") == "opt"
    with pytest.raises(TypeError, match="engine global name of a torch.optim.Optimizer"):
        check_optimizer(object())


def test_the_ranks_agreed_outcome_is_raised_as_its_own_class():
    raise_outcomes([Outcome(), Outcome()])
    with pytest.raises(CorruptCheckpointError, match="file x is short"):
        raise_outcomes([Outcome(), Outcome.failed(CorruptCheckpointError("file x is short"))])
    with pytest.raises(CheckpointError, match="nothing there"):
        raise_outcomes([Outcome.failed("nothing there")])
    with pytest.raises(CheckpointError, match="checkpoint operation failed"):
        raise_outcomes([Outcome(ok=False, error=KeyboardInterrupt)])
