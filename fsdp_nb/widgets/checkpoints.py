"""Checkpoint browser: the checkpoints under a folder or fsspec URL, and actions on them.

``sess.checkpoints(root)`` returns a :class:`CheckpointBrowser`: a list (step, time,
size, world size), details of the selected one (tensor tree; which rank file holds each
chunk; ``extra``), and buttons to save now, load, consolidate and delete (delete asks
for a confirmation first). A progress bar follows saves; async saves show staging vs
writing. The browser renders :class:`CheckpointEntry` rows, filled from
``fsdp_nb.inspect`` by the single adapter :func:`entry_from_info`.
"""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as W

from ._render import StaticForm, fmt_bytes, html_table, text_table

__all__ = [
    "CheckpointBrowser", "CheckpointEntry", "ChunkEntry", "TensorEntry", "checkpoint_browser",
    "entry_from_info", "scan",
]

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
_STEP = re.compile(r"(?:step|iter|epoch)[-_=]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor."""

    file: str
    """File holding it, relative to the checkpoint."""
    rank: int | None
    """Rank that wrote the file (from ``__{rank}_{i}.distcp``), None for a full file."""
    offsets: tuple[int, ...]
    """Start of the piece in the global tensor."""
    sizes: tuple[int, ...]
    """Shape of the piece."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint."""

    name: str
    """Key (``model.layers.0.weight``, ``optim.state...``)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """dtype name."""
    bytes: int
    """Size of the whole tensor."""
    chunks: tuple[ChunkEntry, ...] = ()
    """Stored pieces."""


@dataclass(frozen=True)
class CheckpointEntry:
    """One row of the browser: what a checkpoint is, without loading it."""

    path: str
    """Local path or fsspec URL of the checkpoint."""
    name: str
    """Its last path component."""
    kind: str
    """``"sharded"`` or ``"full"``."""
    step: int | None
    """``extra["step"]`` when saved, else a number in the name (``step100``), else None."""
    created: float | None
    """Unix time it was written."""
    size: int
    """Bytes of tensor data."""
    world_size: int | None
    """Ranks that wrote it."""
    tensors: tuple[TensorEntry, ...] = ()
    """Its tensors."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The user's ``extra``."""
    versions: dict[str, str] = field(default_factory=dict)
    """Versions that wrote it."""
    valid: bool = True
    """False when the checkpoint is incomplete or corrupt."""
    problem: str | None = None
    """Why it is not valid."""

    def label(self) -> str:
        step = f"step {self.step}" if self.step is not None else "step ?"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created)) if self.created else "?"
        ws = f"world {self.world_size}" if self.world_size else "world ?"
        bad = "" if self.valid else "  INVALID"
        return f"{self.name}  |  {step}  |  {when}  |  {fmt_bytes(self.size)}  |  {ws}  |  {self.kind}{bad}"

    def tree(self) -> dict[str, Any]:
        """Tensors nested by dotted name: ``{"model": {"l1": {"weight": TensorEntry}}}``."""
        root: dict[str, Any] = {}
        for t in self.tensors:
            node = root
            parts = t.name.split(".")
            for part in parts[:-1]:
                nxt = node.setdefault(part, {})
                if not isinstance(nxt, dict):  # a tensor and a prefix share a name
                    nxt = node.setdefault(part + "/", {})
                node = nxt
            node[parts[-1]] = t
        return root

    def files_by_rank(self) -> dict[int | None, list[str]]:
        out: dict[int | None, set[str]] = {}
        for t in self.tensors:
            for c in t.chunks:
                out.setdefault(c.rank, set()).add(c.file)
        return {k: sorted(v) for k, v in out.items()}

    def details_text(self) -> str:
        head = (f"{self.path}: {self.kind}, step {self.step}, world {self.world_size}, "
                f"{fmt_bytes(self.size)}, extra={json.dumps(self.extra, default=str)}")
        if not self.valid:
            head += f"\nINVALID: {self.problem}"
        rows = [(t.name, "x".join(map(str, t.shape)) or "scalar", t.dtype, fmt_bytes(t.bytes),
                 ", ".join(_chunk_text(c) for c in t.chunks)) for t in self.tensors]
        return head + "\n" + text_table(("tensor", "shape", "dtype", "bytes", "chunks"), rows)

    def details_html(self) -> str:
        def node_html(name: str, node: Any) -> str:
            if isinstance(node, TensorEntry):
                chunks = "; ".join(_chunk_text(c) for c in node.chunks) or "-"
                return (f"<li><code>{html.escape(name)}</code> "
                        f"[{'x'.join(map(str, node.shape)) or 'scalar'}] {html.escape(node.dtype)}, "
                        f"{fmt_bytes(node.bytes)} <small>&larr; {html.escape(chunks)}</small></li>")
            inner = "".join(node_html(k, v) for k, v in node.items())
            return (f"<li><details><summary><code>{html.escape(name)}</code> "
                    f"<small>({_count(node)} tensors)</small></summary><ul>{inner}</ul></details></li>")

        tree = "".join(node_html(k, v) for k, v in self.tree().items())
        files = html_table(("rank", "files"), [(("full file" if r is None else r), ", ".join(f))
                                               for r, f in sorted(self.files_by_rank().items(),
                                                                  key=lambda kv: (kv[0] is None, kv[0] or 0))])
        bad = "" if self.valid else f"<p style='color:#c00'><b>INVALID:</b> {html.escape(str(self.problem))}</p>"
        return (f"<div class='fsdp-nb-ckpt-details'><b>{html.escape(self.path)}</b> "
                f"({html.escape(self.kind)}, world {self.world_size}, {fmt_bytes(self.size)}){bad}"
                f"<p><b>extra</b> <code>{html.escape(json.dumps(self.extra, default=str))}</code>"
                f" <b>versions</b> <code>{html.escape(json.dumps(self.versions))}</code></p>"
                f"<b>tensors</b><ul style='margin:0'>{tree}</ul><b>files</b>{files}</div>")


def _count(node: Any) -> int:
    return 1 if isinstance(node, TensorEntry) else sum(_count(v) for v in node.values())


def _chunk_text(c: ChunkEntry) -> str:
    who = f"rank {c.rank}" if c.rank is not None else "full"
    return f"{who}:{c.file}@({','.join(map(str, c.offsets))})[{'x'.join(map(str, c.sizes))}]"


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def entry_from_info(path: str, info: Any) -> CheckpointEntry:
    """The one adapter from ``fsdp_nb.inspect``'s ``CheckpointInfo`` to a browser row."""
    tensors = []
    raw = _get(info, "tensors", {}) or {}
    items = raw.items() if isinstance(raw, dict) else ((_get(t, "name"), t) for t in raw)
    for key, t in items:
        chunks = []
        for c in _get(t, "chunks", ()) or ():
            file = str(_get(c, "file", ""))
            m = _RANK_FILE.search(file)
            chunks.append(ChunkEntry(file, int(m.group(1)) if m else None,
                                     tuple(_get(c, "offsets", ()) or ()),
                                     tuple(_get(c, "sizes", ()) or ())))
        tensors.append(TensorEntry(str(_get(t, "name", key) or key), tuple(_get(t, "shape", ())),
                                   str(_get(t, "dtype", "?")), int(_get(t, "bytes", 0) or 0),
                                   tuple(chunks)))
    extra = dict(_get(info, "extra", {}) or {})
    name = path.rstrip("/").rsplit("/", 1)[-1]
    step = extra.get("step")
    if not isinstance(step, int):
        m = _STEP.search(name)
        step = int(m.group(1)) if m else None
    size = int(_get(info, "total_bytes", 0) or 0) or sum(t.bytes for t in tensors)
    return CheckpointEntry(
        path=path, name=name, kind=str(_get(info, "kind", "?")), step=step,
        created=_get(info, "created"), size=size, world_size=_get(info, "world_size"),
        tensors=tuple(tensors), extra=extra, versions=dict(_get(info, "versions", {}) or {}),
        valid=bool(_get(info, "valid", True)), problem=_get(info, "problem"),
    )


def scan(root: str, *, inspect: Callable[[str], Any] | None = None,
         storage_options: dict | None = None) -> list[CheckpointEntry]:
    """Checkpoints directly under ``root`` (and ``root`` itself if it is one), by step/time.

    ``inspect(path)`` describes one checkpoint (default ``fsdp_nb.inspect``); entries it
    rejects are not checkpoints and are skipped. A missing root lists nothing.
    """
    from ..checkpoint import inspect as inspect_checkpoint
    from ..checkpoint.storage import url_to_fs

    if inspect is None:
        def inspect(path: str) -> Any:
            return inspect_checkpoint(path, storage_options=storage_options)
    fs, base = url_to_fs(root, storage_options)
    if not fs.exists(base):
        return []
    candidates = [root]
    if fs.isdir(base):
        for child in sorted(fs.ls(base, detail=False)):
            leaf = child.rstrip("/").rsplit("/", 1)[-1]
            if leaf.startswith((".", "_")) or ".tmp" in leaf:
                continue
            candidates.append(child if "://" not in root else fs.unstrip_protocol(child))
    out = []
    for c in candidates:
        try:
            info = inspect(c)
        except Exception:
            continue
        entry = entry_from_info(str(c), info)
        recognisable = entry.tensors or entry.world_size or _get(info, "files")
        if entry.valid or (c is not root and recognisable):  # a plain folder is no checkpoint
            out.append(entry)
    out.sort(key=lambda e: (e.step is None, e.step or 0, e.created or 0, e.name))
    return out


class CheckpointBrowser(StaticForm, W.VBox):
    """List, details and actions for the checkpoints under ``root``."""

    def __init__(self, sess: Any, root: str, *, model: Any = None, optimizer: str | None = None,
                 extra: dict | Callable[[], dict] | None = None,
                 inspect: Callable[[str], Any] | None = None,
                 storage_options: dict | None = None, **kwargs: Any):
        if not isinstance(root, str) or not root:
            raise TypeError(f"checkpoints() needs a folder path or fsspec URL (str), got {root!r}")
        self.sess, self.root, self.model, self.optimizer = sess, root.rstrip("/"), model, optimizer
        self.extra = extra
        self._inspect = inspect
        self.storage_options = storage_options
        """fsspec options for ``root``; None takes fsdp_nb's (``set_storage_options``)."""
        self.entries: list[CheckpointEntry] = []
        self.save_handle: Any = None

        self.title = W.HTML(f"<b>Checkpoints</b> under <code>{html.escape(root)}</code>")
        self.listing = W.Select(options=[], rows=6, layout=W.Layout(width="100%"))
        self.listing.add_class("fsdp-nb-ckpt-list")
        self.details = W.HTML("<i>select a checkpoint</i>")
        self.b_refresh = W.Button(description="Refresh", icon="refresh")
        self.b_save = W.Button(description="Save now", icon="save", button_style="primary")
        self.b_load = W.Button(description="Load", icon="upload")
        self.b_consolidate = W.Button(description="Consolidate", icon="compress")
        self.b_delete = W.Button(description="Delete", icon="trash", button_style="danger")
        self.save_name = W.Text(value="", placeholder="name (default: time stamp)",
                                description="save as")
        self.async_save = W.Checkbox(value=False, description="async", indent=False)
        self.consolidate_to = W.Text(value="", placeholder="out file (default: <ckpt>.safetensors)",
                                     description="out")
        self.confirm_text = W.HTML()
        self.b_yes = W.Button(description="Yes, delete", button_style="danger")
        self.b_no = W.Button(description="Cancel")
        self.confirm = W.HBox([self.confirm_text, self.b_yes, self.b_no],
                              layout=W.Layout(display="none"))
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="",
                                        layout=W.Layout(visibility="hidden"))
        self.message = W.HTML()
        self.pending_delete: str | None = None
        super().__init__([
            self.title, self.listing,
            W.HBox([self.b_refresh, self.b_save, self.b_load, self.b_consolidate, self.b_delete]),
            W.HBox([self.save_name, self.async_save, self.consolidate_to]),
            self.confirm, self.progress, self.message, self.details,
        ], **kwargs)
        self.add_class("fsdp-nb-checkpoint-browser")
        self.listing.observe(self._on_select, names="value")
        self.b_refresh.on_click(lambda _b: (self.check_save(), self.refresh()))
        self.b_save.on_click(lambda _b: self.save_now())
        self.b_load.on_click(lambda _b: self.load_selected())
        self.b_consolidate.on_click(lambda _b: self.consolidate_selected())
        self.b_delete.on_click(lambda _b: self.ask_delete())
        self.b_yes.on_click(lambda _b: self.confirm_delete())
        self.b_no.on_click(lambda _b: self.cancel_delete())
        self.refresh()

    # -- listing ------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-scan ``root``."""
        try:
            self.entries = scan(self.root, inspect=self._inspect, storage_options=self.storage_options)
        except Exception as exc:  # a bad URL or credentials: show, do not raise in a callback
            self.entries = []
            self._say(f"cannot list {self.root}: {type(exc).__name__}: {exc}", "error")
        keep = self.listing.value
        with self.hold_sync():
            self.listing.options = [(e.label(), e.path) for e in self.entries]
            paths = [e.path for e in self.entries]
            self.listing.value = keep if keep in paths else (paths[-1] if paths else None)
            self._show_details()

    @property
    def selected(self) -> CheckpointEntry | None:
        for e in self.entries:
            if e.path == self.listing.value:
                return e
        return None

    def select(self, path_or_name: str) -> None:
        """Select a checkpoint by path or name."""
        for e in self.entries:
            if path_or_name in (e.path, e.name):
                self.listing.value = e.path
                return
        raise KeyError(f"no checkpoint {path_or_name!r} under {self.root}; "
                       f"have: {[e.name for e in self.entries]}")

    def _on_select(self, _change: Any) -> None:
        self.cancel_delete()
        self._show_details()

    def _show_details(self) -> None:
        e = self.selected
        self.details.value = e.details_html() if e else "<i>no checkpoint selected</i>"

    def _say(self, text: str, level: str = "info") -> None:
        color = {"info": "#333", "ok": "#2a7", "warn": "#b60", "error": "#c00"}[level]
        self.message.value = f"<span style='color:{color}'>{html.escape(text)}</span>"
        self.last_message = (level, text)

    # -- actions ------------------------------------------------------------------

    def _target(self) -> str:
        name = self.save_name.value.strip() or time.strftime("manual-%Y%m%d-%H%M%S")
        if "/" in name or name in (".", ".."):
            raise ValueError(f"save name must be one folder name (no '/'), got {name!r}")
        return f"{self.root}/{name}"

    def save_now(self) -> Any:
        """Save ``model`` (and ``optimizer``) to ``root/<name>``; a bar follows the save."""
        if self.model is None:
            self._say("no model to save: open the browser with sess.checkpoints(root, "
                      "model=model, optimizer='optimizer')", "error")
            return None
        try:
            target = self._target()
        except ValueError as exc:
            self._say(str(exc), "error")
            return None
        extra = self.extra() if callable(self.extra) else self.extra
        asyn = bool(self.async_save.value)
        self._progress(0.1, "staging" if asyn else "writing")
        try:
            out = self.sess.save(target, self.model, optimizer=self.optimizer, extra=extra,
                                 async_save=asyn)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._progress(None)
            self._say(f"save failed: {type(exc).__name__}: {exc}", "error")
            return None
        if asyn and out is not None and hasattr(out, "done"):
            self.save_handle = out
            blocked = getattr(out, "blocked_s", None)
            note = f" (training blocked {blocked:.2f} s)" if isinstance(blocked, float) else ""
            self._progress(0.5, "writing")
            self._say(f"staged {target}{note}; writing in the background", "info")
            self._poll_later()
        else:
            self._finish_save(target)
        return out

    def check_save(self) -> bool:
        """Look at the async save in flight (on this thread); finish it when written.

        True when no save is in flight any more. Polled from the kernel's event loop
        between messages (never from another thread: the handle asks the engines).
        """
        h = self.save_handle
        if h is None:
            return True
        try:
            if not h.done():
                return False
            h.wait()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.save_handle = None
            self._progress(None)
            self._say(f"async save failed: {type(exc).__name__}: {exc}", "error")
            return True
        self.save_handle = None
        self._finish_save(str(getattr(h, "path", "")))
        return True

    def _poll_later(self) -> None:
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no kernel loop (a script, a test): check_save() by hand
            return

        def tick() -> None:
            if not self.check_save():
                loop.call_later(0.5, tick)

        loop.call_later(0.5, tick)

    def _finish_save(self, target: str) -> None:
        self._progress(1.0, "saved")
        self._say(f"saved {target}", "ok")
        self.refresh()
        if any(e.path == target for e in self.entries):
            self.listing.value = target

    def _progress(self, value: float | None, phase: str = "") -> None:
        with self.progress.hold_sync():
            if value is None:
                self.progress.layout.visibility = "hidden"
                self.progress.description = ""
                return
            self.progress.layout.visibility = "visible"
            self.progress.value = value
            self.progress.description = phase[:20]
            self.progress.bar_style = "success" if value >= 1.0 else "info"

    def _need_selection(self, what: str) -> CheckpointEntry | None:
        e = self.selected
        if e is None:
            self._say(f"select a checkpoint to {what}", "warn")
        return e

    def load_selected(self) -> Any:
        """Load the selected checkpoint into ``model`` (and ``optimizer``)."""
        e = self._need_selection("load")
        if e is None:
            return None
        if self.model is None:
            self._say("no model to load into: pass model= to sess.checkpoints()", "error")
            return None
        try:
            extra = self.sess.load(e.path, self.model, optimizer=self.optimizer)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._say(f"load failed: {type(exc).__name__}: {exc}", "error")
            return None
        self._say(f"loaded {e.name}; extra={json.dumps(extra, default=str)}", "ok")
        return extra

    def consolidate_selected(self) -> str | None:
        """Write the selected checkpoint as one full file (default ``<path>.safetensors``)."""
        e = self._need_selection("consolidate")
        if e is None:
            return None
        out = self.consolidate_to.value.strip() or e.path.rstrip("/") + ".safetensors"
        try:
            from ..checkpoint import consolidate

            consolidate(e.path, out, storage_options=self.storage_options)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._say(f"consolidate failed: {type(exc).__name__}: {exc}", "error")
            return None
        self._say(f"consolidated {e.name} -> {out}", "ok")
        self.refresh()
        return out

    def ask_delete(self) -> None:
        """First step of delete: show the confirmation."""
        e = self._need_selection("delete")
        if e is None:
            return
        self.pending_delete = e.path
        with self.confirm.hold_sync():
            self.confirm_text.value = (f"Delete <code>{html.escape(e.path)}</code> "
                                       f"({fmt_bytes(e.size)})? This cannot be undone.")
            self.confirm.layout.display = "flex"

    def cancel_delete(self) -> None:
        self.pending_delete = None
        self.confirm.layout.display = "none"

    def confirm_delete(self) -> bool:
        """Second step: delete the checkpoint the confirmation named."""
        from ..checkpoint.storage import url_to_fs

        path, self.pending_delete = self.pending_delete, None
        self.confirm.layout.display = "none"
        if path is None:
            return False
        try:
            fs, p = url_to_fs(path, self.storage_options)
            fs.rm(p, recursive=fs.isdir(p))
        except Exception as exc:
            self._say(f"delete failed: {type(exc).__name__}: {exc}", "error")
            return False
        self._say(f"deleted {path}", "ok")
        self.refresh()
        return True

    # -- static form --------------------------------------------------------------

    def to_text(self) -> str:
        rows = [(e.name, e.step if e.step is not None else "?",
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created)) if e.created else "?",
                 fmt_bytes(e.size), e.world_size or "?", e.kind + ("" if e.valid else " INVALID"))
                for e in self.entries]
        return (f"checkpoints under {self.root}: {len(rows)}\n"
                + text_table(("name", "step", "time", "size", "world", "kind"), rows))

    def to_html(self) -> str:
        rows = [(e.name, e.step if e.step is not None else "?",
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created)) if e.created else "?",
                 fmt_bytes(e.size), e.world_size or "?", e.kind + ("" if e.valid else " INVALID"))
                for e in self.entries]
        sel = self.selected
        return (f"<div class='fsdp-nb-ckpt'><b>Checkpoints</b> under <code>{html.escape(self.root)}"
                f"</code>{html_table(('name', 'step', 'time', 'size', 'world', 'kind'), rows)}"
                f"{sel.details_html() if sel else ''}</div>")


def checkpoint_browser(sess: Any, root: str, **kwargs: Any) -> CheckpointBrowser:
    """The checkpoint browser for ``root`` (see :class:`CheckpointBrowser` for options)."""
    return CheckpointBrowser(sess, root, **kwargs)
