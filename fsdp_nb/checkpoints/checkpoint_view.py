"""How the checkpoint browser draws a ``CheckpointInfo``: list labels, tables, details.

Pure functions of ``fsdp_nb.CheckpointInfo`` (no widgets, no I/O), so the
browser, its static HTML/text forms and the dashboard show the same thing.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

from ..display.widget_parts import fmt_bytes, html_table, text_table
from ..formats.info import CheckpointInfo, ChunkInfo, TensorInfo, rank_of_file

__all__ = ["details_html", "details_text", "label", "listing_html", "listing_text", "tensor_tree"]

_COLUMNS = ("name", "step", "time", "size", "world", "kind")


def _when(t: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return time.strftime(fmt, time.localtime(t)) if t else "?"


def _kind(info: CheckpointInfo) -> str:
    """``sharded`` / ``full``, with whose layout it is when not fsdp_nb's (``sharded (torchtitan)``)."""
    other = "" if info.layout in ("fsdp_nb", "safetensors") and info.source != "dcp" else f" ({info.layout})"
    return info.kind + other + ("" if info.valid else " INVALID")


def label(info: CheckpointInfo) -> str:
    """One line for the list: name, step, time, size, world size, kind."""
    step = f"step {info.step}" if info.step is not None else "step ?"
    ws = f"world {info.world_size}" if info.world_size else "world ?"
    return f"{info.name}  |  {step}  |  {_when(info.created)}  |  {fmt_bytes(info.total_bytes)}  |  {ws}  |  {_kind(info)}"


def _row(info: CheckpointInfo) -> tuple:
    return (info.name, "?" if info.step is None else info.step, _when(info.created, "%Y-%m-%d %H:%M"),
            fmt_bytes(info.total_bytes), info.world_size or "?", _kind(info))


def listing_text(root: str, infos: list[CheckpointInfo]) -> str:
    return f"checkpoints under {root}: {len(infos)}\n" + text_table(_COLUMNS, [_row(i) for i in infos])


def listing_html(infos: list[CheckpointInfo]) -> str:
    return html_table(_COLUMNS, [_row(i) for i in infos])


def tensor_tree(info: CheckpointInfo) -> dict[str, Any]:
    """Tensors nested by dotted name: ``{"model": {"l1": {"weight": TensorInfo}}}``."""
    root: dict[str, Any] = {}
    for t in info.tensors.values():
        node = root
        parts = t.name.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):  # a tensor and a prefix share a name
                nxt = node.setdefault(part + "/", {})
            node = nxt
        node[parts[-1]] = t
    return root


def _chunk_text(c: ChunkInfo) -> str:
    rank = rank_of_file(c.file)
    who = "full" if rank is None else f"rank {rank}"
    return f"{who}:{c.file}@({','.join(map(str, c.offsets))})[{'x'.join(map(str, c.sizes))}]"


def _shape(t: TensorInfo) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def details_text(info: CheckpointInfo) -> str:
    head = (f"{info.path}: {info.kind}, step {info.step}, world {info.world_size}, "
            f"{fmt_bytes(info.total_bytes)}, extra={json.dumps(info.extra, default=str)}")
    if not info.valid:
        head += f"\nINVALID: {info.problem}"
    rows = [(t.name, _shape(t), t.dtype, fmt_bytes(t.bytes), ", ".join(_chunk_text(c) for c in t.chunks))
            for t in info.tensors.values()]
    return head + "\n" + text_table(("tensor", "shape", "dtype", "bytes", "chunks"), rows)


def _count(node: Any) -> int:
    return 1 if isinstance(node, TensorInfo) else sum(_count(v) for v in node.values())


def _node_html(name: str, node: Any) -> str:
    if isinstance(node, TensorInfo):
        chunks = "; ".join(_chunk_text(c) for c in node.chunks) or "-"
        return (f"<li><code>{html.escape(name)}</code> [{_shape(node)}] {html.escape(node.dtype)}, "
                f"{fmt_bytes(node.bytes)} <small>&larr; {html.escape(chunks)}</small></li>")
    inner = "".join(_node_html(k, v) for k, v in node.items())
    return (f"<li><details><summary><code>{html.escape(name)}</code> "
            f"<small>({_count(node)} tensors)</small></summary><ul>{inner}</ul></details></li>")


def details_html(info: CheckpointInfo) -> str:
    """The tensor tree (which rank file holds each chunk), files per rank with what each
    rank's own file keeps (its random state, the save's ``state=`` objects), ``extra``."""
    tree = "".join(_node_html(k, v) for k, v in tensor_tree(info).items())
    by_rank = sorted(info.files_by_rank().items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    rows = [("full file" if r is None else r, ", ".join(f), ", ".join(info.run_state.get(r, ())) if r is not None
             else "") for r, f in by_rank]
    files = html_table(("rank", "files", "its own state (train/rankN.pt)"), rows)
    bad = "" if info.valid else f"<p style='color:#c00'><b>INVALID:</b> {html.escape(str(info.problem))}</p>"
    return (f"<div class='fsdp-nb-ckpt-details'><b>{html.escape(info.path)}</b> "
            f"({html.escape(info.kind)}, world {info.world_size}, {fmt_bytes(info.total_bytes)}){bad}"
            f"<p><b>extra</b> <code>{html.escape(json.dumps(info.extra, default=str))}</code>"
            f" <b>versions</b> <code>{html.escape(json.dumps(info.versions))}</code></p>"
            f"<b>tensors</b><ul style='margin:0'>{tree}</ul><b>files</b>{files}</div>")
