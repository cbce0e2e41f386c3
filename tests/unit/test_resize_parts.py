"""The pure parts of ``sess.resize``: its checks, the session's definitions, its report."""

from __future__ import annotations

import pytest
import torch

from fsdp_nb.engine import definitions as engine_definitions
from fsdp_nb.engine.namespace import user_ns
from fsdp_nb.models.wire_mesh_plan import MeshPlan
from fsdp_nb.models.wire_wrap_options import make_options
from fsdp_nb.models.wrap import WrapRecord
from fsdp_nb.recovery.rank_resize import _build_optimizer, recipe
from fsdp_nb.recovery.resize import ResizeReport
from fsdp_nb.recovery.resize_checks import (
    agree_surveys,
    check_n,
    check_space,
    mesh_plans,
    staging_folder,
)
from fsdp_nb.recovery.wire_resize import RankSurvey
from fsdp_nb.runtime.definitions import Definitions, top_level_definitions
from fsdp_nb.wire.calls import ByValue


def test_check_n():
    assert check_n(3) == 3
    for bad in (0, -2, True, 2.0, "2", None):
        with pytest.raises(ValueError, match="positive int"):
            check_n(bad)


def test_staging_folder(tmp_path):
    assert staging_folder(None, ["a", "a"]) == "/dev/shm"
    assert staging_folder(str(tmp_path), ["a", "b"]) == str(tmp_path)
    with pytest.raises(ValueError, match=r"2 hosts \(a, b\) and /dev/shm is each host's own"):
        staging_folder(None, ["a", "b", "a"])
    with pytest.raises(ValueError, match="not an existing folder"):
        staging_folder(str(tmp_path / "no"), ["a"])
    with pytest.raises(ValueError, match="not an existing folder"):
        staging_folder(3, ["a"])


def _record(name: str, kind: str = "class", **options) -> WrapRecord:
    one_rank = MeshPlan("cpu", (1,), ("dp",), ("dp",))  # the mesh it was wrapped on (mesh_plans plans anew)
    return WrapRecord(name, kind, ByValue(b"", name), make_options(**options), one_rank, 0)


def test_mesh_plans_name_the_model_that_cannot_be_resized():
    tp = {"tp": _record("tp", parallelize=lambda m, mesh: m, tensor_parallel_size=2)}
    assert mesh_plans(tp, 4, "gloo", ["h"] * 4)["tp"].shape == (2, 2)
    with pytest.raises(ValueError, match=r"model 'tp' cannot be sharded over 3 ranks: tensor_parallel_size=2 does "
                                         r"not divide the world size 3.*Nothing was changed"):
        mesh_plans(tp, 3, "gloo", ["h"] * 3)
    fixed = {"m": _record("m", data_parallel_size=2)}
    with pytest.raises(ValueError, match="model 'm' cannot be sharded over 3 ranks: data_parallel_size=2"):
        mesh_plans(fixed, 3, "gloo", ["h"] * 3)
    with pytest.raises(ValueError, match="model 's' was wrapped from a module that %%px code built"):
        mesh_plans({"s": _record("s", kind="string")}, 3, "gloo", ["h"] * 3)
    hybrid = {"h": _record("h", sharding="hybrid")}
    assert mesh_plans(hybrid, 4, "gloo", ["a", "a", "b", "b"])["h"].shape == (2, 2)
    assert mesh_plans({"m": _record("m")}, 1, "gloo", ["h"])["m"].shape == (1,)


def test_agree_surveys():
    a = RankSurvey({"net": ("opt",)}, (), ("x", "y"))
    assert agree_surveys([a, RankSurvey({"net": ("opt",)}, (), ("z",))]) == ({"net": ("opt",)}, ("x", "y"))
    with pytest.raises(ValueError, match="rank 1: optimizer 'o' steps parameters of several"):
        agree_surveys([a, RankSurvey({"net": ()}, ("optimizer 'o' steps parameters of several wrapped models",), ())])
    with pytest.raises(ValueError, match="the ranks hold different optimizers"):
        agree_surveys([a, RankSurvey({"net": ()}, (), ())])


def test_check_space():
    check_space(2 * 2**20, 2**20, "/dev/shm")
    with pytest.raises(ValueError, match=r"needs 100 MiB in /dev/shm, which has 50 MiB free"):
        check_space(50 * 2**20, 100 * 2**20, "/dev/shm")


def test_top_level_definitions_keep_imports_classes_functions_only():
    cell = (
        "import torch, os\nfrom torch import nn as tnn\n%time x = 1\n!echo hi\n"
        "class Net(tnn.Module):\n    pass\n\n@staticmethod\ndef f(a):\n    return a\n"
        "async def g():\n    pass\nx = 5\nfor i in range(2):\n    import json\n"
    )
    got = top_level_definitions(cell)
    assert [k for k, _ in got] == ["import:import torch, os", "import:from torch import nn as tnn", "Net", "f", "g"]
    assert got[3][1].startswith("@staticmethod\ndef f(a):")
    assert top_level_definitions("def broken(:\n") == []


def test_definitions_replay_in_order_latest_wins():
    defs = Definitions()
    defs.note_code("import math\nclass A:\n    v = 1\n")
    defs.note_code("class B(A):\n    pass\n")
    defs.note_code("class A:\n    v = 2\n")  # made again: replayed after B, as the ranks last saw it
    defs.note_push({"sqrt": __import__("math").sqrt, "data": [1, 2], "Tensor": torch.Tensor})
    assert list(defs.items) == ["import:import math", "B", "A", "sqrt", "Tensor"]
    ns = user_ns()
    saved = dict(ns)
    try:
        for k in ("A", "B", "math", "sqrt", "Tensor"):
            ns.pop(k, None)
        failed = engine_definitions.replay(list(defs.items.values()))
        assert failed == ["class B(A):: NameError: name 'A' is not defined"]
        assert ns["A"].v == 2 and ns["math"].pi > 3 and ns["sqrt"](4.0) == 2.0 and ns["Tensor"] is torch.Tensor
    finally:
        ns.clear()
        ns.update(saved)


def test_optimizer_recipe_builds_the_same_optimizer(monkeypatch):
    from fsdp_nb.models import rank_wrap as ew

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW([{"params": [model.weight], "lr": 0.5}, {"params": [model.bias], "weight_decay": 0.0}],
                              lr=0.1, betas=(0.8, 0.9))
    monkeypatch.setitem(ew.wrapped(), "m", ew.Wrapped(model, None, None))
    monkeypatch.setitem(user_ns(), "opt", optim)
    rec, problem = recipe("opt", "m")
    assert problem is None and rec.fqns == (("weight",), ("bias",))
    fresh = torch.nn.Linear(3, 2)
    built = _build_optimizer(rec, dict(fresh.named_parameters()))
    assert type(built) is torch.optim.AdamW and built.defaults == optim.defaults
    assert [g["params"] for g in built.param_groups] == [[fresh.weight], [fresh.bias]]
    for g, h in zip(built.param_groups, optim.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}

    class NeedsModel(torch.optim.SGD):
        def __init__(self, params, model, lr=0.1):
            super().__init__(params, lr=lr)

    monkeypatch.setitem(user_ns(), "odd", NeedsModel(model.parameters(), model))
    _, problem = recipe("odd", "m")
    assert "optimizer 'odd' (" in problem and "cannot be built again on a new rank: TypeError" in problem


def test_report_text():
    r = ResizeReport(2, 3, ("net",), {"net": ("optimizer",)}, ("loss", "step"), ("[rank 2] f: NameError: x",),
                     3 * 2**20, (2**30, 2**30, 2**29), {"state staged": 0.5, "models re-sharded": 1.0})
    text = str(r)
    assert text.splitlines()[0] == "resized 2 -> 3 ranks in 1.5 s"
    assert "model 'net' re-sharded with optimizer" in text and "new ranks do not have: loss, step" in text
    assert "peak resident per rank: 1024, 1024, 512 MiB" in text and "definition not replayed: [rank 2] f" in text
    assert "retired ranks took theirs of: loss" in str(ResizeReport(3, 1, variables=("loss",)))
    assert str(ResizeReport(2, 2)) == "resize: already 2 rank(s); nothing changed"


def test_optimizer_state_templates_from_the_staged_metadata():
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from fsdp_nb.recovery.rank_resize import _templates
    from fsdp_nb.recovery.wire_resize import OptimizerRecipe

    def tensor(*size, dtype=torch.float32):
        return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])

    params = {"w": torch.nn.Parameter(torch.zeros(3, 2)), "b": torch.nn.Parameter(torch.zeros(2))}
    rec = OptimizerRecipe("opt", "m", ByValue(b"", "AdamW"), {}, ({"lr": 0.1},), (("w", "b"),))
    md = Metadata({"model.w": tensor(3, 2), "optim.state.w.exp_avg": tensor(3, 2), "optim.state.w.step": tensor(),
                   "optim.state.b.exp_avg_sq": tensor(2, dtype=torch.bfloat16), "optim.param_groups.w.lr": BytesStorageMetadata()})
    got = _templates(params, rec, "optim", md)
    assert {f: {k: (tuple(t.shape), t.dtype) for k, t in e.items()} for f, e in got.items()} == {
        "w": {"exp_avg": ((3, 2), torch.float32), "step": ((), torch.float32)},
        "b": {"exp_avg_sq": ((2,), torch.bfloat16)}}
    assert _templates(params, rec, "optim_1", md) == {}
    md.state_dict_metadata["optim.state.w.count"] = BytesStorageMetadata()  # not a tensor: DCP's way
    assert _templates(params, rec, "optim", md) is None


def test_survey_carries_a_models_optimizers_and_leaves_the_rest(monkeypatch):
    from fsdp_nb.models import rank_wrap as ew
    from fsdp_nb.recovery.rank_resize import survey

    a, b, old = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    monkeypatch.setitem(ew.wrapped(), "a", ew.Wrapped(a, None, None))
    monkeypatch.setitem(ew.wrapped(), "b", ew.Wrapped(b, None, None))
    ns = user_ns()
    for name, value in {"opt_a": torch.optim.SGD(a.parameters(), lr=0.1),
                        "stale": torch.optim.SGD(old.parameters(), lr=0.1),  # a model wrapped again since
                        "steps": 3, "_private": 1, "helper": len}.items():
        monkeypatch.setitem(ns, name, value)
    got = survey(("a", "b"))
    assert got.optimizers == {"a": ("opt_a",), "b": ()} and got.problems == ()
    assert {"stale", "steps"} <= set(got.variables) and not {"opt_a", "a", "_private", "helper"} & set(got.variables)
    monkeypatch.setitem(ns, "both", torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    monkeypatch.setitem(ns, "mixed", torch.optim.SGD([*b.parameters(), *old.parameters()], lr=0.1))
    assert survey(("a", "b")).problems == (
        "optimizer 'both' steps parameters of several wrapped models (a, b)",
        "optimizer 'mixed' steps parameters of wrapped model 'b' and others that no wrapped model holds")
