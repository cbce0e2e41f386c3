"""``sess.autosave`` and ``sess.stop_autosave``: the façade's autosave methods, checked and
delegated.

Mixed into :class:`fsdp_nb.Session`; each method hands the session context to
``fsdp_nb.autosave.autosave``, imported at the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..models.sharded_model import ShardedModel
    from .autosave import Autosaving

__all__ = ["SessionAutosave"]


class SessionAutosave:
    """The autosave methods of a ``Session``."""

    _ctx: SessionContext

    def autosave(
        self,
        root: str | None = None,
        *,
        every: int | None = None,
        model: ShardedModel | str = "model",
        optimizer: str | list[str] = "optimizer",
        state: list[str] | tuple[str, ...] | None = None,
        loaders: list[str] | tuple[str, ...] | None = None,
        keep_last: int | None = 3,
        in_memory: bool = False,
    ) -> Autosaving | None:
        """Save the run from the ranks every ``every`` optimizer steps, with no code in the
        training loop; with no arguments, where the autosave is.

        Each save is an async save of a sharded checkpoint, ``<root>/step-<N>``, with the
        model, its optimizers, each ``loaders`` and ``state`` engine global and each rank's
        random state (``save``'s ``state``). It is taken in two parts: at the end of every
        ``every``-th step (its first ``optimizer.step()``), before the loop draws the next
        batch, each rank's random state and the position of each loader; at the iteration
        boundary (the next forward, when the scheduler and scaler have stepped, or the end
        of a cell that succeeded on every rank) the rest, and the save is written. Training
        waits while the ranks copy their shards, and first for the previous autosave's
        write when it has not finished. A dead engine then costs the steps since the last
        committed save (``every``, or up to twice that when it died while the last save
        was being written): ``restart(restore="latest", setup=...)``. One model (with its
        optimizers) per autosave; calling it again counts from step 0.

        An object it cannot place is refused by name before anything changes: in
        ``state``, one of another class than torch's ``DataLoader`` / ``Sampler`` that
        draws batches (``__iter__``, ``__next__``, ``next()``, ``get_batch()``,
        ``next_batch()``), which belongs in ``loaders``; an optimizer of the model's
        parameters that ``optimizer`` leaves out. A ``sess.load`` while it is armed of a
        checkpoint that keeps no ``extra["step"]`` is refused too (the count would go on
        from a step the run is not at).

        Args:
            root: the folder (path or fsspec URL) of the ``step-<N>`` checkpoints. None
                (and no ``in_memory``): change nothing, return where the running autosave is (each rank's step
                count, last committed save and a save in flight; a suspended one says so;
                None when off). Calling again replaces it; :meth:`stop_autosave` stops it.
            every: optimizer steps between saves (required with ``root``; without
                ``root``, with ``in_memory=True``, a TypeError: the copies are taken after
                every step).
            model: the ``ShardedModel`` (or engine global name) saved.
            optimizer: the engine global name of its optimizer, or a list of them when
                several step the model's parameters (``["opt_emb", "opt_rest"]``), in the
                order the loop steps them: an iteration ends when the last one steps (so a
                loop that steps one, runs a forward, then steps the next, a GAN's, is
                never saved between them), and all are saved.
            state: engine globals with ``state_dict()`` to keep per rank, taken at the
                iteration boundary (a scheduler, ``scaler``); a torch ``DataLoader`` or
                ``Sampler`` here is taken as a loader.
            loaders: engine globals the training loop draws its batches from, with
                ``state_dict()`` and ``load_state_dict()`` (your own loader class, a
                ``StatefulDataLoader``): each rank's position is taken at the end of the
                step, before the loop draws the next batch, so a resume draws it again.
            keep_last: keep the newest this many checkpoints under ``root`` (None: all;
                without ``root`` it has nothing to keep).
            in_memory: also copy the state into host memory after every step, each rank's
                own copy and one on a buddy rank (on another host where the hosts allow),
                two generations each. ``restart(restore="latest")`` then takes the newest
                state wherever it is whole: from memory when the copies are no older than
                the last disk save (a dead engine costs the step in flight, and no disk
                read), else from disk, saying why. With neither ``root`` nor ``every``,
                copies in memory only. Needs 2 ranks or more (ValueError). Arming refuses,
                before anything changes, where a host's memory cannot hold the copies (four
                times a rank's state, per rank; six on a GPU rank, whose own copies are
                pinned: MemoryError).
        """
        self._ctx.check_open()
        from ..autosave.autosave import autosave, describe

        if root is None and in_memory is False:
            if every is not None or state is not None or loaders is not None:
                raise TypeError("sess.autosave() with no root only says where the autosave is; pass root= to arm it "
                                "(or in_memory=True for copies in memory only)")
            return describe(self._ctx)
        if every is None and root is not None:
            raise TypeError("sess.autosave(root, every=N, ...): say after how many optimizer steps it saves")
        return autosave(self._ctx, root, every=every, model=model, optimizer=optimizer, state=state, loaders=loaders,
                        keep_last=keep_last, in_memory=in_memory)

    def stop_autosave(self) -> None:
        """Stop the ranks' autosave (a save under way still finishes), or forget a
        suspended one."""
        self._ctx.check_open()
        from ..autosave.autosave import stop

        stop(self._ctx)
