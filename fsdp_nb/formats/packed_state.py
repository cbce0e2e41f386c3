"""A rank's state packed for a copy in memory: its sharded tensors in one flat byte buffer,
everything else beside it (``sess.autosave(..., in_memory=True)``).

A state tree (the nested dicts and lists of ``get_state_dict``'s model and optimizer state,
and what else the rank keeps) is split by :func:`split` into

- its **leaves**: every DTensor's local shard (the model's parameters and the optimizer's
  moments), and the plain tensors of the subtrees named ``staged`` (an optimizer's step
  counts, which only its next step changes), in the order met, each copied by
  :func:`stage` into one preallocated ``uint8`` buffer at its offset, which is one
  message to a peer and one ``memcpy`` back;
- its **rest**: the tree with each leaf replaced by the marker ``(LEAF, i)``; the other
  plain tensors (a model's buffers, which its next forward may change), numbers and
  strings are kept as they are, copied now, so what the loop changes next is not in it.

:func:`fill` puts a packed copy back into a tree of the same shape (the state dict of the
live objects, whose DTensors it writes in place) and gives the tree to hand to
``set_state_dict``. Nothing here pickles: the rest travels as the bytes of
``formats.run_state.encode`` and is read back weights-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..torch_compat import local_tensor

__all__ = ["LEAF", "Leaf", "fill", "leaf_bytes", "split", "stage", "view"]

LEAF = "__fsdp_nb_packed__"
"""The first item of the marker that stands for a leaf in the rest of a tree."""


@dataclass(frozen=True)
class Leaf:
    """Where one leaf's bytes are in the flat buffer."""

    offset: int
    """Its first byte."""
    nbytes: int
    """Its length in bytes."""
    dtype: str
    """Its dtype, as ``str(torch.float32)`` spells it."""
    shape: tuple[int, ...]
    """Its local shape."""
    sharded: bool = True
    """A DTensor's local shard (False: a plain tensor)."""

    def as_tuple(self) -> tuple[int, int, str, tuple[int, ...], bool]:
        """The leaf as plain values (what the rest's bytes carry)."""
        return self.offset, self.nbytes, self.dtype, self.shape, self.sharded

    @classmethod
    def parse(cls, values: Any) -> Leaf:
        """A leaf from the plain values a copy carries (``as_tuple``'s, perhaps a peer's);
        a ValueError naming them for anything else."""
        try:
            offset, nbytes, dtype, shape, sharded = values
            ints = [offset, nbytes, *shape]
        except (TypeError, ValueError):
            ints, dtype, sharded = [None], None, None
        if not (all(isinstance(x, int) and not isinstance(x, bool) for x in ints) and isinstance(dtype, str)
                and isinstance(sharded, bool)):
            raise ValueError(f"a copy's leaf {values!r} is not (offset, bytes, dtype, shape, sharded)")
        return cls(offset, nbytes, dtype, tuple(shape), sharded)


def _is_sharded(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def split(tree: Any, staged: tuple[str, ...] = ()) -> tuple[Any, list[Any], list[Leaf]]:
    """(the rest of ``tree``, its leaves' tensors in order, where each goes in the flat
    buffer). ``staged``: the top-level keys of ``tree`` whose plain tensors are leaves too.
    The leaves' tensors are the live ones, not copies: :func:`stage` copies them, and
    nothing may change them before it has."""
    import torch

    tensors: list[Any] = []
    leaves: list[Leaf] = []
    offset = 0

    def leaf(t: Any, sharded: bool) -> tuple[str, int]:
        nonlocal offset
        nbytes = t.numel() * t.element_size()
        tensors.append(t)
        leaves.append(Leaf(offset, nbytes, str(t.dtype), tuple(t.shape), sharded))
        offset += _aligned(nbytes)
        return (LEAF, len(leaves) - 1)

    def walk(node: Any, stage_plain: bool) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, stage_plain) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, stage_plain) for v in node]
        if _is_sharded(node):
            return leaf(local_tensor(node), True)
        if isinstance(node, torch.Tensor):
            return leaf(node.detach(), False) if stage_plain else node.detach().cpu().clone()
        return _plain_copy(node)

    if isinstance(tree, dict):
        return {k: walk(v, k in staged) for k, v in tree.items()}, tensors, leaves
    return walk(tree, False), tensors, leaves


def _plain_copy(node: Any) -> Any:
    import copy

    return copy.deepcopy(node)


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64  # every leaf starts on a 64-byte boundary: a view of any dtype is aligned


def leaf_bytes(leaves: list[Leaf]) -> int:
    """The flat buffer's size for ``leaves``."""
    return max((leaf.offset + _aligned(leaf.nbytes) for leaf in leaves), default=0)


def stage(tensors: list[Any], leaves: list[Leaf], flat: Any, non_blocking: bool = False) -> None:
    """Copy each leaf's local tensor into ``flat`` (a ``uint8`` buffer of at least
    :func:`leaf_bytes`), at its offset. ``non_blocking``: a device-to-pinned-host copy
    that the caller synchronises."""
    for t, leaf in zip(tensors, leaves):
        if leaf.nbytes:
            src = t.contiguous().reshape(-1).view(_uint8())
            flat[leaf.offset:leaf.offset + leaf.nbytes].copy_(src, non_blocking=non_blocking)


def _uint8() -> Any:
    import torch

    return torch.uint8


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a packed copy names dtype {name!r}, which is not a torch dtype")
    return dtype


def view(flat: Any, leaf: Leaf) -> Any:
    """Leaf ``leaf`` of the flat buffer ``flat``, as a tensor of its dtype and shape (a
    view: no copy). ValueError when the leaf does not lie inside the buffer or its bytes
    are not its shape's (a copy damaged or forged)."""
    import math

    dtype = _dtype(leaf.dtype)
    size = math.prod(leaf.shape) * dtype.itemsize
    if leaf.offset < 0 or leaf.nbytes != size or leaf.offset + leaf.nbytes > flat.numel():
        raise ValueError(f"a packed copy's leaf at {leaf.offset} of {leaf.nbytes} bytes, {leaf.shape} {leaf.dtype}, "
                         f"does not lie in its {flat.numel()}-byte buffer as its shape says")
    return flat[leaf.offset:leaf.offset + leaf.nbytes].view(dtype).view(leaf.shape)


def fill(live: Any, rest: Any, flat: Any, leaves: list[Leaf], where: str = "state", write: bool = True) -> Any:
    """Write a packed copy (``rest``, ``flat``, ``leaves``) into ``live``, a tree of the
    same shape whose leaves are the live DTensors, and return the tree to load: ``rest``
    with each marker replaced by the live DTensor it was written into. ``write`` False:
    check only, writing nothing (call it so first, and a copy that does not fit changes
    nothing).

    ValueError naming the path when ``live`` has no DTensor where the copy has a leaf, or
    one of another shape or dtype (the model or its sharding changed since the copy), or
    a leaf lies outside the buffer."""
    import torch

    def walk(node: Any, target: Any, path: str) -> Any:
        if isinstance(node, tuple) and len(node) == 2 and node[0] == LEAF:
            if not isinstance(node[1], int) or not 0 <= node[1] < len(leaves):
                raise ValueError(f"{where}: {path} names leaf {node[1]!r} of a copy with {len(leaves)}")
            leaf = leaves[node[1]]
            if leaf.sharded != _is_sharded(target) or not isinstance(target, torch.Tensor):
                kind = "a sharded tensor" if leaf.sharded else "a plain tensor"
                raise ValueError(f"{where}: {path} was {kind} in the copy and is {type(target).__name__} "
                                 "now: the model or its optimizer is not the one the copy was taken of")
            local = local_tensor(target)
            if tuple(local.shape) != leaf.shape or str(local.dtype) != leaf.dtype:
                raise ValueError(f"{where}: {path} is {tuple(local.shape)} {local.dtype} on this rank and was "
                                 f"{leaf.shape} {leaf.dtype} in the copy: the sharding or the model changed")
            saved = view(flat, leaf)
            if write:
                with torch.no_grad():
                    local.copy_(saved)
            return target
        if isinstance(node, dict):
            d = target if isinstance(target, dict) else {}
            return {k: walk(v, d.get(k), f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            items = target if isinstance(target, list) else []
            return [walk(v, items[i] if i < len(items) else None, f"{path}[{i}]") for i, v in enumerate(node)]
        return node

    return walk(rest, live, "")
