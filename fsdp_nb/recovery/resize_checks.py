"""Everything ``sess.resize`` checks before it changes anything.

``check`` asks the ranks what they hold (``fsdp_nb.recovery.rank_resize.survey``: the optimizers,
the variables, the bytes to stage) and, on rank 0, how to build each optimizer again
(``recipes``) and runs the pure checks below; any problem raises a
``ValueError`` naming what was wrong and what to do, with the session untouched.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.health import whoami
from ..models.wire_mesh_plan import MeshPlan, plan_mesh
from ..runtime import membership
from ..runtime.checks import local_gpu_count
from . import rank_resize as _er
from .wire_resize import OptimizerRecipe, RankSurvey

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..models.wrap import WrapRecord

__all__ = [
    "STAGING", "ResizePlan", "agree_surveys", "check", "check_n", "check_space", "mesh_plans", "staging_folder",
]

STAGING = "/dev/shm"
"""Where a resize stages the models' state by default: memory (a tmpfs), private to the user
in a 0700 folder of its own, removed at the end."""

SPACE_MARGIN = 1.05
"""Staging needs the state's bytes times this free (DCP's metadata, file alignment)."""


@dataclass(frozen=True)
class ResizePlan:
    """What a checked resize will do."""

    n: int
    """The new world size."""
    staging: str
    """The folder (in memory) the state is staged in."""
    plans: dict[str, MeshPlan]
    """Each wrapped model's mesh on ``n`` ranks."""
    optimizers: dict[str, tuple[str, ...]]
    """Each wrapped model's optimizers (engine globals)."""
    recipes: dict[str, tuple[OptimizerRecipe, ...]]
    """Each wrapped model's optimizers, as a rank that never had them builds them."""
    variables: tuple[str, ...]
    """Rank 0's other variables: they stay only on the ranks that survive."""


def check_n(n: Any) -> int:
    """``n`` is a positive int."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"resize(n) needs a positive int (the new number of ranks), got {n!r}")
    return n


def staging_folder(staging: Any, hosts: Sequence[str]) -> str:
    """The folder to stage in: ``staging``, or ``/dev/shm`` when every rank (``hosts``: the
    hosts of the ranks before and after) runs on one host; /dev/shm is each host's own, so
    ranks on several hosts need a folder they all share."""
    if staging is None:
        if len(set(hosts)) > 1:
            raise ValueError(
                f"the ranks run on {len(set(hosts))} hosts ({', '.join(sorted(set(hosts)))}) and /dev/shm is "
                "each host's own; pass staging='/path' to a folder in memory that every host mounts, "
                "or save, start a new session and load")
        if not os.path.isdir(STAGING):
            raise ValueError(f"this host has no {STAGING}; pass staging='/path' to a folder in memory (tmpfs)")
        return STAGING
    if not isinstance(staging, str) or not os.path.isdir(staging):
        raise ValueError(f"staging={staging!r} is not an existing folder; pass a folder in memory (tmpfs)")
    return staging


def mesh_plans(wraps: Mapping[str, WrapRecord], n: int, backend: str, hosts: list[str]) -> dict[str, MeshPlan]:
    """Each wrap's mesh on ``n`` ranks (``hosts``: theirs); ValueError naming the first
    model that cannot be resized and why."""
    plans = {}
    for name, rec in wraps.items():
        if rec.kind == "string":
            raise ValueError(
                f"model {name!r} was wrapped from a module that %%px code built on the engines, and a "
                "new rank cannot build it again; wrap it from its class or an instance to resize, or "
                "save it, start a session of the new size and load it. Nothing was changed.")
        try:
            plans[name] = plan_mesh(n, backend, hosts, rec.options)
        except ValueError as exc:
            raise ValueError(
                f"model {name!r} cannot be sharded over {n} ranks: {exc}. Pick a world size that fits "
                "(tensor_parallel_size must divide it), or wrap it again with other sizes. Nothing "
                "was changed.") from None
    return plans


def agree_surveys(surveys: Sequence[RankSurvey]) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """(each model's optimizers, rank 0's other variables) once every rank holds the same
    optimizers and none is one a resize cannot carry; else ValueError naming it."""
    for r, s in enumerate(surveys):
        if s.problems:
            raise ValueError(
                f"rank {r}: {s.problems[0]}; a resize re-shards an optimizer with the one model it "
                "steps. Delete it, or build one optimizer per model. Nothing was changed.")
    first = surveys[0].optimizers
    for r, s in enumerate(surveys[1:], 1):
        if s.optimizers != first:
            raise ValueError(
                f"the ranks hold different optimizers (rank 0: {dict(first)}, rank {r}: "
                f"{dict(s.optimizers)}); make them the same on every rank. Nothing was changed.")
    return dict(first), surveys[0].variables


def check_space(free: int, needed: int, folder: str) -> None:
    """ValueError if ``folder`` has less than ``needed`` bytes (with a margin) free."""
    if free < needed * SPACE_MARGIN:
        raise ValueError(
            f"staging the models' state needs {needed / 2**20:.0f} MiB in {folder}, which has "
            f"{free / 2**20:.0f} MiB free; free some, pass staging= a larger folder in memory, "
            "or save, start a session of the new size and load. Nothing was changed.")


def _hosts_after(ctx: SessionContext, n: int) -> tuple[list[str], list[str]]:
    """(hosts of the ranks after the resize, hosts of the engines it would add)."""
    c = ctx.cluster
    hosts = [r.host for r in ctx.ranks]
    if n <= len(hosts):
        return hosts[:n], []
    k = n - len(hosts)
    if c.cluster is None:
        spare = membership.spare_engines(c)
        if len(spare) < k:
            raise ValueError(
                f"growing to {n} ranks needs {k} more engine(s), and the cluster this session attached "
                f"to has {len(spare)} spare; start more with its launcher (ipcluster engines, srun, "
                "mpiexec), then resize. Nothing was changed.")
        added = [c.client[e].apply_sync(whoami)[1] for e in spare[:k]]
    elif c._local_launcher():
        added = [socket.gethostname()] * k
    else:
        added = ["(the launcher's choice)"] * k
    return hosts + added, added


def check(ctx: SessionContext, n: Any, staging: Any) -> ResizePlan:
    """The plan of a resize to ``n`` ranks, every check passed; nothing changed."""
    n = check_n(n)
    ctx.check_open()
    dead = ctx.cluster.dead_ranks()
    if dead or ctx.state != "ready":
        raise ValueError(
            f"the session is {ctx.state}" + (f" (rank(s) {dead} dead: their shards are gone)" if dead else "")
            + "; bring it back with sess.restart() (restore= a checkpoint to get the models back), then "
            "resize. Nothing was changed.")
    if n == ctx.world_size:
        return ResizePlan(n, "", {}, {}, {}, ())
    hosts, added = _hosts_after(ctx, n)
    if ctx.backend == "nccl" and ctx.cluster._local_launcher() and n > local_gpu_count():
        raise ValueError(f"this host has {local_gpu_count()} GPU(s), and an NCCL session needs one per rank; "
                         f"resize to at most {local_gpu_count()}. Nothing was changed.")
    folder = staging_folder(staging, [r.host for r in ctx.ranks] + added)
    plans = mesh_plans(ctx.wraps, n, ctx.backend or "gloo", hosts)
    d = ctx.plain_dispatcher
    surveys = d.gather(d.apply("survey", _er.survey, args=(tuple(ctx.wraps),)), 60)
    optimizers, variables = agree_surveys(surveys)
    check_space(shutil.disk_usage(folder).free, sum(s.state_bytes for s in surveys), folder)
    (got,) = d.gather(d.apply("optimizer recipes", _er.recipes, args=(optimizers,), ranks=[0]), 60)
    problems = [p for pairs in got.values() for _, p in pairs if p]
    if problems and n > ctx.world_size:  # only a new rank builds one
        raise ValueError(f"{problems[0]}. Nothing was changed.")
    recipes = {model: tuple(r for r, _ in pairs) for model, pairs in got.items()}
    return ResizePlan(n, folder, plans, optimizers, recipes, variables)
