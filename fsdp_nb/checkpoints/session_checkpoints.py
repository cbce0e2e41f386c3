"""``sess.save`` and ``sess.load``: the façade's checkpoint methods, checked and delegated.

Mixed into :class:`fsdp_nb.Session`; each method hands the session context to
``fsdp_nb.checkpoints.save`` / ``load``, imported at the first call (a session that
never saves does not import them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..formats.info import CheckpointInfo
    from ..models.sharded_model import ShardedModel
    from .async_saves import AsyncCheckpoint

__all__ = ["SessionCheckpoints"]


class SessionCheckpoints:
    """The checkpoint methods of a ``Session``."""

    _ctx: SessionContext

    def save(
        self,
        path: str,
        model: ShardedModel | str | list[ShardedModel | str],
        *,
        optimizer: str | list[str | None] | tuple[str, ...] | None = None,
        state: list[str] | tuple[str, ...] | None = None,
        extra: dict[str, Any] | None = None,
        sharded: bool = True,
        overwrite: bool = False,
        async_save: bool = False,
        keep_last: int | None = None,
        progress: bool | None = None,
        layout: str = "fsdp_nb",
    ) -> CheckpointInfo | AsyncCheckpoint:
        """Write a checkpoint of ``model`` (and engine global ``optimizer``) atomically.

        Returns its ``CheckpointInfo``, or an ``AsyncCheckpoint`` handle with ``async_save``.

        Args:
            path: a local path or fsspec URL (``s3://...``); written under a temporary
                name and renamed into place, so it is either complete or absent.
            model: the ``ShardedModel`` from ``wrap``, or the engine global name of an
                FSDP2 module; or a list of them (a teacher and a student, a GAN's two),
                each stored under its own name in one sharded checkpoint.
            optimizer: the engine global name of its ``torch.optim`` optimizer; for one
                model whose parameters several optimizers step, a list of their names
                (kept together, loaded back with the same list); with a list of models, a
                list of as many (None for a model without one).
            state: engine globals with ``state_dict()`` / ``load_state_dict()`` to keep
                (an LR scheduler, the ``scaler``, a ``StatefulDataLoader``, your own
                object). In fsdp_nb's layout each rank's copy goes in its own file
                (``train/rank{r}.pt``) with the rank's random state, which a sharded save
                there always keeps. ``layout="lightning"`` keeps rank 0's under each name
                in ``meta.pt`` and refuses a loader (its position is a rank's own);
                ``"torchtitan"`` keeps engine globals named as its states: ``lr_scheduler``,
                ``train_state`` (rank 0's) and ``dataloader`` (each rank's own). A full file
                (``sharded=False``) refuses ``state``.
            extra: small values to keep with it (a step, a config); ``load`` returns them.
            sharded: one file per rank (a DCP folder, reshardable); False: one full file
                (``.pt`` or ``.safetensors`` by ``path``'s suffix).
            overwrite: replace a checkpoint already at ``path`` (else it is refused).
            async_save: return once the ranks hold a copy; write and commit in the
                background (the next save, load or shutdown waits for it).
            keep_last: keep the newest this many checkpoints in the folder, this one among them.
            progress: a bar of the bytes written (default: in a notebook, for more than
                a few hundred MB).
            layout: whose trainer resumes from it: ``"fsdp_nb"``; ``"lightning"``, Lightning
                Fabric's (``fabric.load`` with ``{"model", "optimizer"}``; ``extra`` in
                ``meta.pt``); ``"torchtitan"``, a ``step-<N>`` folder of the model's own
                keys, ``optimizer`` and each ``extra`` entry (``train_state``) as a state.
        """
        self._ctx.check_open()
        from .save import save

        return save(self._ctx, path, model, optimizer=optimizer, state=state, extra=extra, sharded=sharded,
                    overwrite=overwrite, async_save=async_save, keep_last=keep_last, progress=progress,
                    layout=layout)

    def load(
        self,
        path: str,
        model: ShardedModel | str | list[ShardedModel | str],
        *,
        optimizer: str | list[str | None] | tuple[str, ...] | None = None,
        state: list[str] | tuple[str, ...] | None = None,
        rng: bool | None = None,
        strict: bool = True,
        verify: bool = True,
        progress: bool | None = None,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint onto this world size (resharded as needed); returns its ``extra``.

        Args:
            path: an fsdp_nb checkpoint (sharded folder, full file), a folder of plain
                ``dcp.save``, or safetensors weights (a file, or a Hugging Face folder).
            model: the ``ShardedModel`` (or engine global name) to load into; of a
                checkpoint holding several models, the one saved under its name. A list
                loads several, one after another (a failure leaves the earlier loaded).
            optimizer: the engine global name of the optimizer to load too; the list of
                them a model was saved with (several optimizers of one model); with a list
                of models, a list of as many (None for a model without one).
            state: engine globals that take back their saved ``state_dict`` (each rank
                its own copy): names the save's ``state=`` kept.
            rng: put back each rank's random state as saved, so dropout and shuffling go
                on as in the run that was saved. None (default): for a resume (the load
                names ``optimizer`` or ``state``), where the checkpoint keeps it and this
                session has the world size that wrote it; a load of weights alone leaves
                the ranks' own. True: required; False: each rank keeps its own. Per-rank state asked for
                (``state``, ``rng=True``) from another world size is refused by name
                (``CheckpointError``) before anything loads: the model and optimizer
                reshard, a rank's loader position or random state does not.
            strict: every key must match (else: load the keys both have).
            verify: refuse a checkpoint whose files cannot be verified (no completion
                marker, missing files, checksums); False loads it anyway.
            progress: a bar of the bytes read (default: in a notebook, for more than a
                few hundred MB).
            weights_only: unpickle the checkpoint's pickles (optimizer ``param_groups``,
                ``.pt`` files) with torch's weights-only unpickler only; one that could
                run code is refused (``fsdp_nb.UnsafeCheckpointError``) before anything
                is loaded. False trusts them, as plain ``torch.load`` does: arbitrary code.

        While an autosave is armed, a checkpoint that keeps no ``extra["step"]`` is refused
        (``CheckpointError``) before anything loads: the autosave counts on from the loaded
        step (``check_autosave_step``).
        """
        self._ctx.check_open()
        from .load import check_autosave_step, load

        check_autosave_step(self._ctx, path)
        return load(self._ctx, path, model, optimizer=optimizer, state=state, rng=rng, strict=strict, verify=verify,
                    progress=progress, weights_only=weights_only)
