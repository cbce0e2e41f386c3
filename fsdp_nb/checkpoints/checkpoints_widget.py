"""Checkpoint browser: the checkpoints under a folder or fsspec URL, and actions on them.

``sess.checkpoints(root)`` returns a :class:`CheckpointBrowser`: a list (step, time,
size, world size), details of the selected one (tensor tree; which rank file holds each
chunk; ``extra``), and buttons to save now, load, consolidate and delete (delete asks
for a confirmation first). A progress bar follows saves; an async save shows staging,
then the bytes written so far while training goes on, then the commit. It renders
``fsdp_nb.CheckpointInfo`` as ``fsdp_nb.inspect`` returns it; the folder scan is
``fsdp_nb.formats.listing``, the drawing ``_checkpoint_view``.
"""

from __future__ import annotations

import html
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..display.widget_parts import StaticForm, fmt_bytes
from ..formats.info import CheckpointInfo
from ..formats.listing import list_checkpoints, remove_checkpoint
from . import checkpoint_view as view
from .load import load
from .save import save

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["CheckpointBrowser", "checkpoint_browser"]

log = logging.getLogger("fsdp_nb")


class CheckpointBrowser(StaticForm, W.VBox):
    """List, details and actions for the checkpoints under ``root``."""

    def __init__(self, ctx: SessionContext, root: str, *, model: Any = None, optimizer: str | None = None,
                 extra: dict | Callable[[], dict] | None = None,
                 storage_options: dict | None = None, **kwargs: Any):
        if not isinstance(root, str) or not root:
            raise TypeError(f"checkpoints() needs a folder path or fsspec URL (str), got {root!r}")
        self.ctx, self.root, self.model, self.optimizer = ctx, root.rstrip("/"), model, optimizer
        self.extra = extra
        self.storage_options = storage_options
        """fsspec options for ``root``; None takes those of :func:`fsdp_nb.set_storage_options`."""
        self.entries: list[CheckpointInfo] = []
        """What ``fsdp_nb.inspect`` says of each checkpoint under ``root``, by step and time."""
        self.save_handle: Any = None
        self.last_message: tuple[str, str] = ("info", "")

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
        self.b_refresh.on_click(self._on_refresh)
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
        ok, entries = self._attempt(f"listing {self.root}",
                                    lambda: list_checkpoints(self.root, storage_options=self.storage_options))
        self.entries = entries if ok else []
        keep = self.listing.value
        with self.hold_sync():
            self.listing.options = [(view.label(e), e.path) for e in self.entries]
            paths = [e.path for e in self.entries]
            self.listing.value = keep if keep in paths else (paths[-1] if paths else None)
            self._show_details()

    @property
    def selected(self) -> CheckpointInfo | None:
        return next((e for e in self.entries if e.path == self.listing.value), None)

    def select(self, path_or_name: str) -> None:
        """Select a checkpoint by path or name."""
        for e in self.entries:
            if path_or_name in (e.path, e.name):
                self.listing.value = e.path
                return
        raise KeyError(f"no checkpoint {path_or_name!r} under {self.root}; "
                       f"have: {[e.name for e in self.entries]}")

    def _on_refresh(self, _button: Any) -> None:
        self.check_save()
        self.refresh()

    def _on_select(self, _change: Any) -> None:
        self.cancel_delete()
        self._show_details()

    def _show_details(self) -> None:
        e = self.selected
        self.details.value = view.details_html(e) if e else "<i>no checkpoint selected</i>"

    def _say(self, text: str, level: str = "info") -> None:
        color = {"info": "#333", "ok": "#2a7", "warn": "#b60", "error": "#c00"}[level]
        self.message.value = f"<span style='color:{color}'>{html.escape(text)}</span>"
        self.last_message = (level, text)

    def _attempt(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run one action for a button: ``(True, result)``, or ``(False, None)`` with the
        error shown in the widget (a callback must not raise). Ctrl-C still interrupts."""
        try:
            return True, fn()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            log.debug("checkpoint browser: %s failed", what, exc_info=True)
            self._progress(None)
            self._say(f"{what} failed: {type(exc).__name__}: {exc}", "error")
            return False, None

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
        ok, out = self._attempt("save", lambda: save(self.ctx,
            target, self.model, optimizer=self.optimizer, extra=extra, async_save=asyn))
        if not ok:
            return None
        if asyn and out is not None and hasattr(out, "done"):
            self.save_handle = out
            blocked = getattr(out, "blocked_s", None)
            note = f" (the ranks were held {blocked:.2f} s)" if isinstance(blocked, float) else ""
            self._progress(0.1, out.phase)
            self._say(f"saving {target} in the background{note}", "info")
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
        ok, prog = self._attempt("async save", h.progress)
        if ok and prog.phase in ("staging", "writing", "committing"):
            frac = min(prog.written / prog.total, 1.0) if prog.total else 0.0
            label = f"writing {100 * frac:.0f}%" if prog.phase == "writing" else prog.phase
            self._progress(0.1 + 0.85 * frac, label)
            return False
        self.save_handle = None
        if ok and self._attempt("async save", h.wait)[0]:
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

    def _need_selection(self, what: str) -> CheckpointInfo | None:
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
        ok, extra = self._attempt("load", lambda: load(self.ctx, e.path, self.model,
                                                                 optimizer=self.optimizer))
        if ok:
            self._say(f"loaded {e.name}; extra={json.dumps(extra, default=str)}", "ok")
        return extra

    def consolidate_selected(self) -> str | None:
        """Write the selected checkpoint as one full file (default ``<path>.safetensors``)."""
        from .consolidate import consolidate

        e = self._need_selection("consolidate")
        if e is None:
            return None
        out = self.consolidate_to.value.strip() or e.path.rstrip("/") + ".safetensors"
        ok, _ = self._attempt("consolidate",
                              lambda: consolidate(e.path, out, storage_options=self.storage_options))
        if not ok:
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
                                       f"({fmt_bytes(e.total_bytes)})? This cannot be undone.")
            self.confirm.layout.display = "flex"

    def cancel_delete(self) -> None:
        self.pending_delete = None
        self.confirm.layout.display = "none"

    def confirm_delete(self) -> bool:
        """Second step: delete the checkpoint the confirmation named."""
        path, self.pending_delete = self.pending_delete, None
        self.confirm.layout.display = "none"
        if path is None:
            return False
        ok, _ = self._attempt("delete", lambda: remove_checkpoint(path, storage_options=self.storage_options))
        if ok:
            self._say(f"deleted {path}", "ok")
            self.refresh()
        return ok

    # -- static form --------------------------------------------------------------

    def to_text(self) -> str:
        return view.listing_text(self.root, self.entries)

    def to_html(self) -> str:
        sel = self.selected
        return (f"<div class='fsdp-nb-ckpt'><b>Checkpoints</b> under <code>{html.escape(self.root)}"
                f"</code>{view.listing_html(self.entries)}{view.details_html(sel) if sel else ''}</div>")


def checkpoint_browser(ctx: SessionContext, root: str, **kwargs: Any) -> CheckpointBrowser:
    """The checkpoint browser for ``root`` (see :class:`CheckpointBrowser` for options)."""
    return CheckpointBrowser(ctx, root, **kwargs)
