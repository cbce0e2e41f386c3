"""Which trainer wrote a sharded checkpoint, and where it keeps each part.

Every trainer below writes the model (and optimizer) with DCP, under its own keys, and
the rest of its state beside it:

==================  ==========================================  ====================  ==============================
layout              model keys                                  optimizer             other state
==================  ==========================================  ====================  ==============================
fsdp_nb             ``model.<fqn>``                             ``optim``             ``fsdp_nb.json`` (``extra``)
lightning_fabric    ``model.<fqn>``                             ``optimizer``         ``meta.pt``
lightning_trainer   ``state_dict.<LightningModule attr>.<fqn>``  ``optimizer_0``       ``meta.pt``
torchtitan          ``<fqn>`` (step-N folders)                  ``optimizer`` (flat)  ``train_state``, ``lr_scheduler``,
                                                                                      ``dataloader`` in the DCP folder
olmo_core           ``model_and_optim/`` ``model.<fqn>``        ``optim``             ``train/rank0.pt``
accelerate          ``pytorch_model_fsdp_0/`` ``model.<fqn>``   ``optimizer_0/``      ``scheduler.bin``,
                                                                ``optimizer``         ``custom_checkpoint_<i>.pkl``
dcp                 plain ``dcp.save``: ``model.<fqn>`` or ``<fqn>``  ``optim`` / ``optimizer``
==================  ==========================================  ====================  ==============================

``find_layout`` looks at the folder and the stored keys (offline: by the keys'
structure alone). Given the model's own names it matches them to the stored keys,
which also finds a module prefix (a LightningModule's ``self.model``), and raises a
``CheckpointError`` naming the keys it found when none of them is the model's.
"""

from __future__ import annotations

import posixpath
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CheckpointError
from .metadata import MARKER, META_FILE

__all__ = [
    "LAYOUTS", "PARTS", "TITAN_STATES", "WRITABLE", "Layout", "check_part_names", "choose_part", "find_layout", "layout_of_keys",
    "part_layout",
]

LAYOUTS = ("fsdp_nb", "lightning_fabric", "lightning_trainer", "torchtitan", "olmo_core", "accelerate", "dcp")
"""Every layout ``find_layout`` names."""
WRITABLE = ("fsdp_nb", "lightning", "torchtitan")
"""What ``sess.save(layout=)`` writes: fsdp_nb's own, Lightning Fabric's, torchtitan's."""
PARTS = "models"
"""The key of ``fsdp_nb.json`` that names the models of a checkpoint holding several
(``sess.save(path, [student, teacher])``): model -> its optimizer, class and size. Each is
stored under its own name: ``<name>.model.<fqn>``, ``<name>.optim.…``."""

_OPTIM_ROOT = re.compile(r"^(optim|optimizer|optimizer_\d+)$")
TITAN_STATES = ("train_state", "lr_scheduler", "dataloader")
"""torchtitan's own states, top-level in its step folder: what ``sess.save(layout="torchtitan",
state=)`` may name (engine globals of these names). ``dataloader`` is each rank's loader,
pickled (``formats.titan_loader``)."""
_STRUCTURAL = ("state_dict", "model")  # roots a trainer nests the model under
_OLMO_SHARDS, _OLMO_STATE = "model_and_optim", "train/rank0.pt"
_ACCELERATE_MODEL, _ACCELERATE_OPTIM = "pytorch_model_fsdp_0", "optimizer_0"
_LIGHTNING_META = "meta.pt"
_ACCELERATE_STATE = re.compile(r"^(scheduler(_\d+)?\.bin|custom_checkpoint_\d+\.pkl)$")


@dataclass(frozen=True)
class Layout:
    """Where one checkpoint keeps its model, optimizer and other state."""

    name: str
    """One of ``LAYOUTS``."""
    folder: str
    """The folder of the model's DCP shards (a filesystem path)."""
    model_root: str = "model"
    """The top-level key the model is nested under (``""``: the model's own keys at the top)."""
    inner: str = ""
    """A module prefix under the root: ``"model."`` for a LightningModule holding ``self.model``."""
    optim_folder: str = ""
    """The folder of the optimizer's shards, when not ``folder`` (Accelerate's ``optimizer_0/``)."""
    optim_root: str | None = None
    """The top-level key of the optimizer state; None when the checkpoint holds none."""
    flat_optim: bool = False
    """The optimizer is stored flat (``param_groups.<fqn>.lr``, torchtitan's), not nested."""
    side_files: tuple[str, ...] = ()
    """Files of the trainer's other state (filesystem paths), each read weights-only."""
    extra_roots: tuple[str, ...] = ()
    """Top-level DCP keys that hold the trainer's other state (torchtitan's ``train_state``)."""

    @property
    def model_prefix(self) -> str:
        """What stands before a parameter's name in a stored key."""
        return (self.model_root + "." if self.model_root else "") + self.inner

    def model_key(self, fqn: str) -> str:
        """The stored key of the model's parameter or buffer ``fqn``."""
        return self.model_prefix + fqn

    def fqn(self, key: str) -> str | None:
        """The model name stored ``key`` holds, or None when it is not a model key."""
        root = key.split(".", 1)[0]
        if _OPTIM_ROOT.match(root) or root in self.extra_roots:
            return None
        return key[len(self.model_prefix):] if key.startswith(self.model_prefix) else None

    def optim_key(self, fqn: str, key: str) -> str:
        """The stored key of the optimizer's ``key`` (``exp_avg``) for parameter ``fqn``."""
        return f"{self.optim_root}.state.{self.inner}{fqn}.{key}"

    def optim_fqn(self, stored: str) -> tuple[str, str] | None:
        """(fqn, key) of a stored optimizer state entry, or None for anything else."""
        head = f"{self.optim_root}.state.{self.inner}"
        if self.optim_root is None or not stored.startswith(head):
            return None
        fqn, _, key = stored[len(head):].rpartition(".")
        return (fqn, key) if fqn else None

    @property
    def optim_in_own_folder(self) -> bool:
        """Whether the optimizer lives in a folder of its own (Accelerate)."""
        return bool(self.optim_folder) and self.optim_folder != self.folder


def check_part_names(names: Iterable[str]) -> None:
    """ValueError for a model name that a stored key's first part means an optimizer by
    (``optim``, ``optimizer``, ``optimizer_<i>``), so that several models cannot be saved
    each under its own name with it."""
    for n in names:
        if _OPTIM_ROOT.match(n):
            raise ValueError(
                f"several models are stored each under its own name, and {n!r} is what a checkpoint calls an "
                "optimizer (optim, optimizer, optimizer_<i>); wrap the model under another name"
            )


def choose_part(url: str, parts: Iterable[str] | None, wanted: str | None) -> str | None:
    """The model an offline reader (consolidate, export) reads of the checkpoint ``url``:
    ``wanted`` among its ``parts`` (None: it holds one model, and ``wanted`` must be None
    too); CheckpointError naming the models it holds otherwise."""
    parts = list(parts or ())
    if not parts:
        if wanted is not None:
            raise CheckpointError(f"checkpoint {url!r} holds one model; model={wanted!r} chooses among several")
        return None
    if wanted not in parts:
        raise CheckpointError(
            f"checkpoint {url!r} holds several models, {', '.join(map(repr, parts))}: "
            + ("pass model=<one of them>" if wanted is None else f"none is named {wanted!r}")
        )
    return wanted


def part_layout(folder: str, part: str, keys: Iterable[str], parts: Iterable[str], url: str) -> Layout:
    """Where model ``part`` of a checkpoint holding several (``parts``) keeps its weights and
    optimizer; CheckpointError naming the models it holds when ``part`` is not one."""
    parts = list(parts)
    if part not in parts:
        raise CheckpointError(
            f"checkpoint {url!r} holds several models, {', '.join(map(repr, parts))}, and none named {part!r}: "
            "each loads into the model of its own name"
        )
    optim = f"{part}.optim"
    has_optim = any(k.startswith(optim + ".") for k in keys)
    return Layout("fsdp_nb", folder, model_root=f"{part}.model", optim_root=optim if has_optim else None)


def _roots(keys: Iterable[str]) -> set[str]:
    return {k.split(".", 1)[0] for k in keys}


def _optim_root(keys: Iterable[str], prefer: str | None) -> tuple[str | None, bool]:
    """(the optimizer's root among ``keys``, whether it is stored flat)."""
    roots = sorted(r for r in _roots(keys) if _OPTIM_ROOT.match(r))
    if prefer in roots:
        root: str | None = prefer
    else:
        root = next((r for r in ("optim", "optimizer", "optimizer_0") if r in roots), roots[0] if roots else None)
    if root is None:
        return None, False
    head = root + ".param_groups."
    flat = any(k.startswith(head) and not k[len(head):].split(".", 1)[0].isdigit() for k in keys)
    return root, flat


def layout_of_keys(name: str | None, folder: str, keys: Iterable[str], *, ours: bool = False,
                   side: bool = False) -> Layout:
    """The layout the stored ``keys`` of DCP folder ``folder`` spell, by their structure.

    Args:
        name: what the folder's shape already says (``"olmo_core"``, ``"accelerate"``),
            or None.
        folder: the folder holding the model's shards.
        keys: every stored key of that folder.
        ours: the folder carries fsdp_nb's own metadata.
        side: a ``meta.pt`` lies beside the shards (Lightning).
    """
    keys = list(keys)
    roots = _roots(keys)
    optim, flat = _optim_root(keys, "optim" if ours or name == "olmo_core" else None)
    model_roots = {r for r in roots if not _OPTIM_ROOT.match(r) and r not in TITAN_STATES}
    if name in ("olmo_core", "accelerate"):
        return Layout(name, folder, optim_root=optim, flat_optim=flat)
    if "state_dict" in model_roots and model_roots <= {"state_dict"}:
        return Layout("lightning_trainer", folder, "state_dict", optim_root=optim, flat_optim=flat)
    if ours and model_roots <= {"model"}:
        return Layout("fsdp_nb", folder, optim_root=optim, flat_optim=flat)
    if model_roots == {"model"}:
        return Layout("lightning_fabric" if side else "dcp", folder, optim_root=optim, flat_optim=flat)
    extra = tuple(r for r in TITAN_STATES if r in roots)
    titan = bool(extra) or optim == "optimizer"
    return Layout("torchtitan" if titan else "dcp", folder, "", optim_root=optim, flat_optim=flat,
                  extra_roots=extra)


def match_names(layout: Layout, keys: Iterable[str], expected: Iterable[str], url: str) -> Layout:
    """``layout`` with the root and module prefix under which the model's own names
    (``expected``) are stored; CheckpointError naming the keys found when none is."""
    expected = set(expected)
    counts: Counter[str] = Counter()
    for k in keys:
        root = k.split(".", 1)[0]
        if root in TITAN_STATES or _OPTIM_ROOT.match(root):
            continue
        parts = k.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in expected:
                counts[".".join(parts[:i]) + ("." if i else "")] += 1
    if not counts:
        raise CheckpointError(_unmappable(url, keys, expected))
    best = max(counts.items(), key=lambda kv: (kv[1], -len(kv[0])))[0]
    root = next((r for r in _STRUCTURAL if best.startswith(r + ".")), "")
    inner = best[len(root) + 1:] if root else best
    return replace(layout, model_root=root, inner=inner)


def _unmappable(url: str, keys: Iterable[str], expected: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:8]) + (f", … ({len(keys)} in all)" if len(keys) > 8 else "")
    want = ", ".join(sorted(expected)[:3])
    return (
        f"checkpoint {url!r}: none of its keys names a parameter of the model, so fsdp_nb cannot "
        f"map its layout. It holds keys under {', '.join(sorted(_roots(keys))) or 'nothing'}: {shown}; "
        f"the model's names are like {want}. fsdp_nb reads the layouts of fsdp_nb, Lightning Fabric "
        "and Trainer, torchtitan, OLMo-core, Accelerate FSDP and plain dcp.save "
        "(the model's own keys, or under 'model')"
    )


def find_layout(fs: Any, p: str, read_keys: Any, url: str, expected: Iterable[str] | None = None,
                part: str | None = None) -> Layout:
    """The layout of the sharded checkpoint folder ``p``.

    Args:
        fs: the fsspec filesystem ``p`` is on.
        p: the folder the user named.
        read_keys: called with a DCP folder, returns its stored keys (from its metadata).
        url: the checkpoint as the user named it, for errors.
        expected: the model's own parameter and buffer names, when loading into one;
            None offline (inspect, export), where the keys' structure alone decides.
        part: of a checkpoint holding several models, the one wanted (``part_layout``);
            None: the layout of the whole (each key at its place).
    """
    name, folder, optim_folder = None, p, ""
    if not fs.exists(posixpath.join(p, ".metadata")):
        for hint, sub in (("olmo_core", _OLMO_SHARDS), ("accelerate", _ACCELERATE_MODEL)):
            if fs.exists(posixpath.join(p, sub, ".metadata")):
                name, folder = hint, posixpath.join(p, sub)
                break
    ours = fs.exists(posixpath.join(folder, META_FILE)) or fs.exists(posixpath.join(folder, MARKER))
    keys = list(read_keys(folder))
    parts = _meta(fs, folder).get(PARTS) if ours else None
    if parts:
        if part is not None:
            return part_layout(folder, part, keys, parts, url)
        return Layout("fsdp_nb", folder, model_root="")
    if ours and _written_as(fs, folder) in ("torchtitan", "lightning"):
        ours = False  # fsdp_nb wrote it in that trainer's keys and files: read by their structure
    side = [] if ours else _side_files(fs, p, name)
    layout = layout_of_keys(name, folder, keys, ours=ours,
                            side=any(s.endswith(_LIGHTNING_META) for s in side))
    layout = replace(layout, side_files=tuple(side))
    if name == "accelerate" and fs.exists(posixpath.join(p, _ACCELERATE_OPTIM, ".metadata")):
        optim_folder = posixpath.join(p, _ACCELERATE_OPTIM)
        root, flat = _optim_root(read_keys(optim_folder), "optimizer")
        layout = replace(layout, optim_folder=optim_folder, optim_root=root, flat_optim=flat)
    return layout if expected is None else match_names(layout, keys, expected, url)


def _meta(fs: Any, folder: str) -> dict[str, Any]:
    """fsdp_nb's metadata in ``folder`` ({} when unreadable)."""
    import json

    try:
        meta = json.loads(fs.cat_file(posixpath.join(folder, META_FILE)))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _written_as(fs: Any, folder: str) -> str | None:
    """The ``layout`` fsdp_nb's metadata in ``folder`` records it saved with (``sess.save(layout=)``)."""
    return _meta(fs, folder).get("layout")


def _side_files(fs: Any, p: str, name: str | None) -> list[str]:
    if name == "olmo_core":
        candidates = [posixpath.join(p, _OLMO_STATE)]
    elif name == "accelerate":
        try:
            listed = sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))
        except FileNotFoundError:
            listed = []
        candidates = [posixpath.join(p, n) for n in listed if _ACCELERATE_STATE.match(n)]
    else:
        candidates = [posixpath.join(p, _LIGHTNING_META)]
    return [c for c in candidates if fs.exists(c)]
