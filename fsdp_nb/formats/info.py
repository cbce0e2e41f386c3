"""What a checkpoint holds, as plain data: ``CheckpointInfo`` and its parts.

Filled offline by ``fsdp_nb.inspect`` (no process group) and returned by
``sess.save``; rendered by the checkpoint browser widget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .keys import MODEL

__all__ = [
    "CheckpointInfo", "ChunkInfo", "TensorInfo", "rank_of_file",
]

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
_STEP_IN_NAME = re.compile(r"(?:step|iter|epoch)[-_=]?(\d+)", re.IGNORECASE)


def rank_of_file(file: str) -> int | None:
    """The rank that wrote a DCP data file (``__{rank}_{i}.distcp``); None for any other file."""
    m = _RANK_FILE.search(file)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ChunkInfo:
    """One stored piece of a tensor."""

    offsets: tuple[int, ...]
    """Where the piece starts in the global tensor, per dimension."""
    sizes: tuple[int, ...]
    """The piece's shape."""
    file: str
    """The file holding it, relative to the checkpoint (``__0_0.distcp``, or the full file)."""
    file_offset: int | None = None
    """Byte offset of the piece inside ``file`` (None when unknown)."""
    length: int | None = None
    """Bytes the piece occupies in ``file`` (None when unknown)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint (a model parameter, buffer or optimizer state)."""

    name: str
    """Key, prefixed ``model.`` or ``optim.`` (e.g. ``model.layers.0.weight``)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """torch dtype name, e.g. ``"float32"``."""
    bytes: int
    """Size of the whole tensor in bytes."""
    chunks: tuple[ChunkInfo, ...] = ()
    """The stored pieces and the file holding each."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint described without loading it."""

    path: str
    """Where it is (local path or fsspec URL)."""
    kind: str
    """``"sharded"`` (a DCP folder, one file per rank) or ``"full"`` (one .pt/.safetensors file)."""
    valid: bool
    """True when the checkpoint is complete: committed (marker present, files of the recorded
    sizes); for a plain DCP folder, every file its metadata names present and long enough."""
    problem: str | None = None
    """Why it is not valid (None when valid)."""
    world_size: int | None = None
    """Ranks that wrote it."""
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    """Key -> tensor description."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The user's ``extra`` (JSON values)."""
    versions: dict[str, str] = field(default_factory=dict)
    """``torch`` and ``fsdp_nb`` versions that wrote it."""
    total_bytes: int = 0
    """Sum of the tensors' sizes."""
    created: float | None = None
    """Unix time it was written."""
    model_class: str | None = None
    """Qualified class name of the model."""
    param_count: int | None = None
    """Number of model parameters (elements)."""
    mesh: dict[str, Any] = field(default_factory=dict)
    """The device mesh it was saved from (shape, dim names, device type)."""
    files: dict[str, int] = field(default_factory=dict)
    """File name -> size in bytes, as recorded at commit."""
    has_optimizer: bool = False
    """Whether optimizer state is included."""
    source: str = "fsdp_nb"
    """Who wrote it: ``"fsdp_nb"``; ``"dcp"``, a folder of plain ``dcp.save`` (no checksums:
    only its files' presence and sizes are checked); ``"safetensors"``, a file or Hugging
    Face folder fsdp_nb did not write."""
    layout: str = "fsdp_nb"
    """Whose layout its keys and files follow (``layouts.LAYOUTS``: ``"fsdp_nb"``,
    ``"lightning_fabric"``, ``"lightning_trainer"``, ``"torchtitan"``, ``"olmo_core"``,
    ``"accelerate"``, ``"dcp"``), or ``"safetensors"``; tensors are named the same way
    whatever it is (``model.<fqn>``, ``optim.state.<fqn>.<key>``)."""
    hf_config: dict[str, Any] | None = None
    """The Hugging Face config of the saved model, as its ``config.json`` holds it (None:
    not a transformers model); ``export_safetensors`` writes it beside the weights."""
    hf_generation_config: dict[str, Any] | None = None
    """Its ``generation_config.json``, for a model that generates."""
    tied: dict[str, str] = field(default_factory=dict)
    """Parameter name -> the one it shares its tensor with (tied embeddings): left out of
    an export, as transformers' ``save_pretrained`` does."""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Of a checkpoint holding several models (``sess.save(path, [a, b])``): each model's
    name -> its optimizer, class, size and Hugging Face config; its tensors are named
    ``<name>.model.<fqn>`` and ``<name>.optim.…``. Empty for one model."""
    saved_from: tuple[str | None, str | None] = (None, None)
    """The engine global names of the model and the optimizer fsdp_nb saved it from
    (what ``restart(restore=)`` loads it back into); ``(None, None)`` when unknown."""
    optimizers: tuple[str, ...] = ()
    """Of one model saved with several optimizers (``optimizer=[...]``, an autosave's
    ``optimizer=`` list): the engine global name of each, the one in ``saved_from`` first;
    empty otherwise."""
    run_state: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Rank -> what its own file (``train/rank{r}.pt``) keeps: ``"rng"`` (its random
    state) and each engine global the save's ``state=`` named (``formats.run_state``)."""

    @property
    def name(self) -> str:
        """The last component of ``path``."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def step(self) -> int | None:
        """``extra["step"]`` when saved (or a trainer's: Lightning's and OLMo-core's
        ``global_step``, torchtitan's ``train_state["step"]``), else a number in the name
        (``step100``, ``iter_30``)."""
        train_state = self.extra.get("train_state")
        for step in (self.extra.get("step"), self.extra.get("global_step"),
                     train_state.get("step") if isinstance(train_state, dict) else None):
            if isinstance(step, int) and not isinstance(step, bool):
                return step
        m = _STEP_IN_NAME.search(self.name)
        return int(m.group(1)) if m else None

    def files_by_rank(self) -> dict[int | None, list[str]]:
        """Files holding tensor data, by the rank that wrote them (None: a full file)."""
        out: dict[int | None, set[str]] = {}
        for t in self.tensors.values():
            for c in t.chunks:
                out.setdefault(rank_of_file(c.file), set()).add(c.file)
        return {k: sorted(v) for k, v in out.items()}

    @property
    def model_keys(self) -> list[str]:
        """Model state-dict keys (without the ``model.`` prefix)."""
        return [k[len(MODEL):] for k in self.tensors if k.startswith(MODEL)]

    def __repr__(self) -> str:
        state = "valid" if self.valid else f"INVALID ({self.problem})"
        return (
            f"<CheckpointInfo {self.kind} {self.path!r}: {state}, world_size={self.world_size}, "
            f"{len(self.tensors)} tensors, {self.total_bytes / 1e6:.1f} MB, extra={self.extra}>"
        )

    def summary(self) -> str:
        """A multi-line text table: header, then one line per tensor."""
        lines = [repr(self)]
        for rank, names in sorted(self.run_state.items()):
            lines.append(f"  rank {rank}'s own state: {', '.join(names)}")
        for t in self.tensors.values():
            files = sorted({c.file for c in t.chunks})
            lines.append(
                f"  {t.name:50s} {str(list(t.shape)):18s} {t.dtype:9s} {t.bytes:>12d} B  "
                f"{len(t.chunks)} chunk(s) in {', '.join(files)}"
            )
        return "\n".join(lines)
