"""What crosses between the notebook and the engines for a save or a load.

The notebook validates the user's arguments into a :class:`SaveSpec` / :class:`LoadSpec`
and ships it; every rank answers with an :class:`Outcome`. An expected failure (a
missing name, a key mismatch, a corrupt file) comes back as an outcome carrying its
exception class, agreed by all ranks, so the notebook raises one clear error instead
of a wall of per-rank tracebacks (``fsdp_nb.checkpoints.arguments.raise_outcomes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..formats.info import CheckpointInfo

__all__ = [
    "LoadSpec", "Outcome", "SaveProgress", "SaveSpec",
]


@dataclass(frozen=True, kw_only=True)
class _Target:
    """What a save and a load both name: where, and which engine globals."""

    url: str
    """The checkpoint: a local path or fsspec URL (a DCP folder, or one full file)."""
    storage_options: dict[str, Any]
    """fsspec options for ``url`` (credentials, endpoint), as the notebook has them."""
    model: str
    """Engine global name of the model."""
    optimizer: str | None
    """Engine global name of the optimizer, if saved / loaded."""
    report_progress: bool = False
    """Publish the bytes done as they go (the notebook may draw a bar); else publish nothing."""
    state: tuple[str, ...] = ()
    """Engine globals whose ``state_dict`` each rank keeps in its own file (a scheduler,
    a scaler, a data loader): ``fsdp_nb.formats.run_state``."""
    parts: tuple[tuple[str, str | None], ...] = ()
    """Several models in one checkpoint (a teacher and a student; a GAN): each model's
    engine global name and its optimizer's (or None), ``model`` / ``optimizer`` being the
    first; each is stored under its own name (``formats.parts``). Empty: one model."""
    optimizers: tuple[str, ...] = ()
    """Of one model whose parameters several optimizers step (an embedding's and the
    rest's): every one of them, saved and loaded together (torch's ``get_state_dict``
    with a list), ``optimizer`` being the first. Empty: ``optimizer`` alone."""


@dataclass(frozen=True, kw_only=True)
class SaveSpec(_Target):
    """One ``sess.save``, as every rank receives it."""

    sharded: bool
    """DCP folder (one file per rank) or one full file."""
    async_save: bool
    """Stage, then write and commit in the background."""
    keep_last: int | None
    """Keep the newest k checkpoints in the folder, this one among them."""
    token: str
    """Unique id of this save (its temporary sibling and its async job)."""
    meta: dict[str, Any]
    """Metadata the notebook knows (``extra``, versions, time); ranks add the rest."""
    check_exists: bool
    """Refuse an existing target (``overwrite=False``)."""
    layout: str = "fsdp_nb"
    """Whose keys the folder is written in: ``"fsdp_nb"``, ``"lightning"`` (Fabric's), ``"torchtitan"``."""
    rng: bool = True
    """Keep each rank's random state in its file (a sharded save in fsdp_nb's layout)."""


@dataclass(frozen=True, kw_only=True)
class LoadSpec(_Target):
    """One ``sess.load``, as every rank receives it."""

    strict: bool
    """Every key must match (else: load the keys both have)."""
    verify: bool = True
    """Refuse what cannot be verified (no completion marker, missing or short files);
    False loads it anyway, and skips the per-item checksums."""
    fill: bool = False
    """The model was just built for this load (``wrap(weights=)``): each piece read goes
    straight into its parameter, with no fresh copy of the shard first; a failure drops
    the model instead of keeping it as it was."""
    weights_only: bool = True
    """Unpickle what the checkpoint pickled (optimizer ``param_groups``, ``.pt`` files)
    only with torch's weights-only unpickler; False trusts it (it can run code)."""
    rng: bool | None = None
    """Put back each rank's random state: True requires it (same world size), False
    leaves the ranks' own, None puts it back for a resume (the load names an optimizer or
    ``state``) where the checkpoint has it and the world size is the one that wrote it."""


@dataclass
class Outcome:
    """One rank's answer to a checkpoint call."""

    ok: bool = True
    """False when this rank (or, agreed, any rank) met an expected failure."""
    error: type[BaseException] | None = None
    """The exception class to raise in the notebook."""
    message: str = ""
    """What was wrong and what to do."""
    info: CheckpointInfo | None = None
    """rank 0, after a commit: what was written."""
    exists: bool = False
    """save: the target already exists (agreed by every rank; nothing was written)."""
    removed: list[str] = field(default_factory=list)
    """``keep_last``: older checkpoints removed."""
    seconds: float | None = None
    """Time the call took on this rank."""
    blocked: float | None = None
    """Time training was blocked on this rank (async: staging only)."""
    pending: bool = False
    """An async save continues in the background."""
    extra: dict[str, Any] | None = None
    """load: the checkpoint's ``extra``."""
    world_size: int | None = None
    """load: the world size that wrote it."""

    @classmethod
    def failed(cls, exc: BaseException | str, error: type[BaseException] | None = None) -> Outcome:
        """A failure outcome from an exception (its class and text) or a message."""
        if isinstance(exc, BaseException):
            return cls(ok=False, error=error or type(exc), message=str(exc))
        return cls(ok=False, error=error or CheckpointError, message=exc)


@dataclass
class SaveProgress:
    """Where one rank's part of an async save is (``AsyncCheckpoint.progress`` sums them)."""

    phase: str = "writing"
    """``"staging"`` (the CPU copy is being taken; the optimizer's next step waits for
    it), ``"writing"`` (bytes going out), ``"committing"`` (written; the ranks gather and
    rank 0 commits), ``"done"`` (this rank's part finished; on rank 0: committed) or
    ``"failed"``. Summed over the ranks: ``"committed"`` once every rank is done."""
    written: int = 0
    """Bytes this rank has written so far, counted against ``total``: at most it, and
    ``total`` once written (``rank_progress.counted``)."""
    total: int = 0
    """Bytes of tensor data this rank staged (what it will write, files' framing aside)."""
