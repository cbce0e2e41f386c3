"""The DCP storage reader every fsdp_nb read goes through: safe and checked.

- ``.metadata`` is unpickled with the restricted unpickler (``restricted``), or taken
  as already read and checked; only planners that unpickle BYTE_IO items (an
  optimizer's ``param_groups``) weights-only are taken (``pickles``), unless the caller
  trusts the checkpoint (``open_sharded`` has checked every such item already);
- each stored item is checked against its recorded checksum as it is read, and its
  tensor built over the bytes read (``item_tensor``), not copied again by ``torch.load``;
- ``before_commit`` (a session load into a live model): every item of this process's
  plan is read and checked first, then ``before_commit`` learns whether this process
  read everything and answers whether every rank did; only then are the tensors copied
  into their targets. A load can then write straight into the model's own tensors and
  still leave every rank's model as it was when any rank's read fails. The check
  reads each item through a small window and keeps only its ends (``item_scan``);
  the copy reads the items again, from the page cache the check just filled, straight
  into each target where the stored bytes are the target's (a contiguous CPU tensor of
  the same dtype, the usual FSDP shard): one copy, where ``dcp.load`` makes two (into
  the tensor ``torch.load`` allocates, then into the target). Holding every item in a
  buffer of its own instead took memory the size of the rank's share, and faulting it
  in made loads 10-20% slower than plain ``dcp.load``; reading the items again through
  a buffer and copying them from it made the load 0.7x ``dcp.load``; checking whole
  items read into two item-sized buffers made it 0.9x. Both passes cut the items into
  runs that ``MIN_READERS`` to ``MAX_READERS`` threads read at once, one per core this
  rank has to itself (``MIN_READERS`` on a host whose cores the ranks fill). Without
  ``before_commit`` (offline consolidate, export) items stream through one reused
  buffer, checked and copied at once.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..torch_compat import fsspec_reader, narrow_tensor_by_index
from .checksums import ChecksumMismatch
from .helper_threads import LazyPool
from .item_scan import ItemScanner, unwritten_buffer

__all__ = ["MAX_READERS", "can_stage", "read_items", "safe_reader"]

log = logging.getLogger("fsdp_nb")

MAX_READERS = 4
"""At most this many threads read one process's share of a local checkpoint at once."""
MIN_READERS = 2
"""At least this many, even where the ranks fill the host's cores: a reader of the check
pass waits on the disk most of the time (``item_scan``), so a second one keeps another
request in flight. Two ranks on two cores loaded 805 MB in 0.50 s with two readers a
rank, 0.52-0.58 s with one (cold, medians of 12)."""
_reader_pool = LazyPool("fsdp_nb-read", MAX_READERS - 1)
_COUNTING = threading.Lock()


def can_stage(md: Any) -> bool:
    """Whether every item of DCP metadata ``md`` can be read by the checked paths (none
    carries a stream transform, such as compression, which only DCP's own reader undoes)."""
    return not any(getattr(info, "transform_descriptors", None) for info in (md.storage_data or {}).values())


def safe_reader(fs: Any, path: str, so: dict[str, Any], *, metadata: Any = None,
                checks: dict[tuple[str, int], tuple[int, int, str]] | None = None,
                on_read: Any = None, before_commit: Callable[[bool], bool] | None = None,
                weights_only: bool = True) -> Any:
    """A DCP storage reader for folder ``path`` on ``fs`` that unpickles ``.metadata`` safely.

    ``metadata``: the ``.metadata`` already read (and checked), so it is not read again.
    ``checks``: ``(file, offset) -> (length, checksum, algorithm)`` of the stored items
    (``checksums.item_checksums``): each item is checked as it is read, and one without
    a record is refused. ``on_read(n)`` is told each item's size as it is read.
    ``before_commit(read_all) -> every_rank_read_all``: read everything before copying
    anything (see the module's docstring); called once per load on every rank.
    ``weights_only``: BYTE_IO items only through the weights-only unpickler, and only
    with a planner that loads them so (``pickles.load_planner``); False trusts the
    checkpoint (it can then run code).
    """
    from torch.distributed.checkpoint import FileSystemReader

    from .storage import is_local, to_url

    if is_local(fs):
        base: Any = FileSystemReader
        args: tuple = (path,)
        kw: dict[str, Any] = {}
    else:
        base, args, kw = fsspec_reader(), (to_url(fs, path),), dict(so)

    reader = type("SafeReader", (_SafeReading, base), {})(*args, **kw)
    reader.metadata, reader.checks, reader.on_read = metadata, checks, on_read
    reader.before_commit, reader.weights_only = before_commit, weights_only
    return reader


def read_items(fs: Any, path: str, md: Any, keys: list[str], so: dict[str, Any] | None = None,
               weights_only: bool = True) -> dict[str, Any]:
    """The stored items ``keys`` of DCP folder ``path`` (``md``: its metadata, read and
    checked), read in this process alone: a tensor for each stored tensor, the object
    for each pickled item (weights-only unless ``weights_only`` is False). For small
    items such as a trainer's step; the model's tensors go through a load."""
    import warnings

    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from .pickles import load_planner

    sd: dict[str, Any] = {}
    for k in keys:
        item = md.state_dict_metadata[k]
        sd[k] = torch.empty(tuple(item.size), dtype=item.properties.dtype) if hasattr(item, "size") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is there: none is needed
        _load_state_dict(sd, storage_reader=safe_reader(fs, path, so or {}, metadata=md, weights_only=weights_only),
                         planner=load_planner(weights_only, allow_partial_load=True), no_dist=True)
    return sd


class _SafeReading:
    """The checked reading of :func:`safe_reader`, mixed into DCP's local or fsspec reader
    (its options are set on each instance by ``safe_reader``)."""

    metadata: Any = None
    checks: dict[tuple[str, int], tuple[int, int, str]] | None = None
    on_read: Any = None
    before_commit: Callable[[bool], bool] | None = None
    weights_only: bool = True

    def read_metadata(self, *a: Any, **k: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from .restricted import load_dcp_metadata, max_metadata_bytes

        if self.metadata is not None and k.get("rank") is None:
            md = self.metadata
        else:
            mpath = self._get_metadata_path(k.get("rank"))
            with self.fs.create_stream(mpath, "rb") as f:
                md = load_dcp_metadata(f.read(max_metadata_bytes() + 1), self.weights_only)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        import torch.futures

        from .pickles import is_weights_only

        if self.weights_only and not is_weights_only(planner):
            raise TypeError(f"{type(planner).__name__} would unpickle this checkpoint's items "
                            "without restriction: use fsdp_nb.formats.pickles.load_planner")
        items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
        if any(md.transform_descriptors for _, md in items):
            if self.before_commit is not None:  # the loader reads into fresh tensors then
                self.before_commit(True)
            return super().read_data(plan, planner)
        if self.before_commit is None:
            if self.checks is None:
                return super().read_data(plan, planner)
            self._stream(items, planner)
        else:
            self._check_then_copy(items, planner)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _opened(self, items: list[tuple[Any, Any]]) -> Iterator[tuple[Any, Any, Any]]:
        """``(open file, request, stored item)`` for every item, file by file, each
        file read front to back."""
        per_file: dict[str, list[tuple[Any, Any]]] = {}
        for req, md in sorted(items, key=lambda rm: (rm[1].relative_path, rm[1].offset)):
            per_file.setdefault(md.relative_path, []).append((req, md))
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req, md in reqs:
                    yield stream, req, md

    def _stream(self, items: list[tuple[Any, Any]], planner: Any, direct: dict[int, int] | None = None) -> None:
        """Each item read into one reused buffer, checked and copied into its target at
        once: one copy less than ``torch.load`` of the checked bytes, and no new
        allocation per item. ``direct`` (the items were checked already): each request
        (by ``id``) whose stored bytes start there in the item is read straight into its
        target; the rest are read again through the buffer."""
        scanner, buf = ItemScanner(), unwritten_buffer(0)
        for stream, req, md in self._opened(items):
            start = None if direct is None else direct.get(id(req))
            if start is not None:
                _read_into_target(planner, req, md, stream, start)
                continue
            if direct is None:
                self._count(md)
                view = scanner.scan(stream, md, self._check_of((md.relative_path, int(md.offset))), whole=True)
            else:
                if len(buf) < md.length:
                    buf = unwritten_buffer(md.length)
                view = _read_again(stream, md, buf[:md.length])
            _commit(planner, req, _item(planner, req, md, view))

    def _check_then_copy(self, items: list[tuple[Any, Any]], planner: Any) -> None:
        """Every item read, checked and its shape matched; every rank told; then
        the items read again and copied into their targets. Nothing is copied when
        any rank failed (a failure here raises, DCP reports it on every rank). Both
        passes split the items into runs that as many threads read at once
        (``_readers``)."""
        runs = _runs(items, self._readers())
        failure: BaseException | None = None
        direct: dict[int, int] = {}
        try:
            for found in _each(self._check_all, runs, planner):
                direct.update(found)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            failure = exc
        everyone = self.before_commit(failure is None)  # type: ignore[misc]
        if failure is not None:
            raise failure
        if not everyone:
            log.info("another rank could not read its part of the checkpoint: nothing loaded here")
            return
        _each(self._stream, runs, planner, direct)

    def _readers(self) -> int:
        """How many threads read this process's items at once: one per core it has to
        itself (its cores over the ranks on this host), at least ``MIN_READERS`` and at
        most ``MAX_READERS``; one from a remote store, whose client keeps its own
        connections."""
        from torch.distributed.checkpoint import FileSystemReader

        if not isinstance(self, FileSystemReader):
            return 1
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        return max(MIN_READERS, min(MAX_READERS, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))))

    def _check_all(self, items: list[tuple[Any, Any]], planner: Any) -> dict[int, int]:
        """Read and check every item, and match the shapes its requests ask for;
        raise at the first failure. Each item goes through an ``ItemScanner``, which
        keeps only what the shapes need. Returns, for each request (by ``id``) that can
        be read straight into its target, where in the item its bytes start
        (``_direct_start``)."""
        from torch.distributed.checkpoint.planner import LoadItemType

        scanner = ItemScanner()
        direct: dict[int, int] = {}
        at, view = None, memoryview(b"")
        for stream, req, md in self._opened(items):
            key = (md.relative_path, int(md.offset))
            if key != at:  # not another request for the item just read
                self._count(md)
                view = scanner.scan(stream, md, self._check_of(key), whole=req.type == LoadItemType.BYTE_IO)
                at = key
            start = _direct_start(planner, req, _item(planner, req, md, view), view)
            if start is not None:
                direct[id(req)] = start
        return direct

    def _count(self, sinfo: Any) -> None:
        """Tell ``on_read`` that stored item ``sinfo`` is being read."""
        if self.on_read is not None:
            with _COUNTING:  # reader threads count at once
                self.on_read(int(sinfo.length))

    def _check_of(self, key: tuple[str, int]) -> tuple[int, int, str] | None:
        """The recorded ``(length, checksum, algorithm)`` of the item at ``key``; None
        when the checkpoint records none; ChecksumMismatch when it records others only."""
        if self.checks is None:
            return None
        want = self.checks.get(key)
        if want is None:
            raise ChecksumMismatch(f"file {key[0]!r}: no checksum was recorded for the item at byte {key[1]}")
        return want

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._count(sinfo)
        if self.checks is None:
            return super()._slice_file(file, sinfo)
        key = (sinfo.relative_path, int(sinfo.offset))
        return io.BytesIO(ItemScanner().scan(file, sinfo, self._check_of(key), whole=True))


def _runs(items: list[tuple[Any, Any]], k: int) -> list[list[tuple[Any, Any]]]:
    """``items`` (request, stored item) in file order, cut into at most ``k`` runs of
    about equal bytes, never between two requests for one stored item."""
    order = sorted(items, key=lambda rm: (rm[1].relative_path, rm[1].offset))
    sizes = {(md.relative_path, int(md.offset)): int(md.length) for _, md in order}
    share = sum(sizes.values()) / max(1, k)
    runs: list[list[tuple[Any, Any]]] = [[]]
    done, at = 0, None
    for req, md in order:
        key = (md.relative_path, int(md.offset))
        if key != at:
            if runs[-1] and len(runs) < k and done >= share * len(runs):
                runs.append([])
            done, at = done + sizes[key], key
        runs[-1].append((req, md))
    return runs


def _each(fn: Callable[..., Any], runs: list[Any], *args: Any) -> list[Any]:
    """``fn(run, *args)`` for every run, the first on this thread and the others on the
    reader pool at once; their results once all have ended (none is left running, even
    after Ctrl-C), or the first failure."""
    others = [_reader_pool().submit(fn, run, *args) for run in runs[1:]]
    results: list[Any] = []
    failure: BaseException | None = None
    try:
        results.append(fn(runs[0], *args))
    except BaseException as exc:  # noqa: BLE001 - raised once the other runs have ended
        failure = exc
    for other in others:
        try:
            results.append(other.result())
        except BaseException as exc:  # noqa: BLE001 - the first failure is raised
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


def _read_again(file: Any, sinfo: Any, into: memoryview) -> memoryview:
    """Item ``sinfo`` read into ``into`` once more, after its check passed (the same
    bytes: a committed checkpoint's files never change in place)."""
    from .storage import read_into

    file.seek(sinfo.offset)
    got = into[:read_into(file, into)]
    if len(got) != len(into):
        raise ChecksumMismatch(f"file {sinfo.relative_path!r} is shorter than when it was checked")
    return got


def _direct_start(planner: Any, req: Any, item: Any, view: memoryview) -> int | None:
    """Where in the item (read into ``view``) the bytes of request ``req``'s tensor
    ``item`` start, when they are its target's bytes as they stand: both contiguous,
    the same dtype and size, the target in CPU memory. Else None."""
    import torch

    if not isinstance(item, torch.Tensor) or not len(view) or not item.is_contiguous():
        return None
    target = planner.resolve_tensor(req).detach()
    if (target.device.type != "cpu" or target.dtype != item.dtype or target.shape != item.shape
            or not target.is_contiguous()):
        return None
    start = item.data_ptr() - torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    end = start + item.numel() * item.element_size()
    return start if 0 <= start <= end <= len(view) else None


def _read_into_target(planner: Any, req: Any, sinfo: Any, file: Any, start: int) -> None:
    """Request ``req``'s bytes, at ``start`` in item ``sinfo`` (checked already), read
    from ``file`` straight into its target, then committed."""
    import torch

    from .storage import read_into

    target = planner.resolve_tensor(req).detach()
    raw = target.reshape(-1).view(torch.uint8)
    if raw.numel():
        file.seek(sinfo.offset + start)
        if read_into(file, memoryview(raw.numpy())) != raw.numel():
            raise ChecksumMismatch(f"file {sinfo.relative_path!r} is shorter than when it was checked")
    planner.commit_tensor(req, target)


def _item(planner: Any, req: Any, md: Any, view: memoryview) -> Any:
    """What read item ``view`` holds for request ``req``: its bytes, or (a tensor item)
    the requested slice of its tensor, built over ``view`` and matched against the
    planner's target."""
    from torch.distributed.checkpoint.planner import LoadItemType

    from .item_tensor import tensor_from_item

    if req.type == LoadItemType.BYTE_IO:
        return bytes(view)
    tensor = narrow_tensor_by_index(tensor_from_item(view), req.storage_offsets, req.lengths)
    want = planner.resolve_tensor(req).size()
    if want != tensor.size():
        raise ChecksumMismatch(
            f"file {md.relative_path!r}: the item at byte {md.offset} holds {tuple(tensor.size())}, "
            f"not the {tuple(want)} its metadata promised")
    return tensor


def _commit(planner: Any, req: Any, item: Any) -> None:
    """Hand ``item`` (from ``_item``) to DCP's planner: bytes loaded, a tensor copied
    into its target."""
    if isinstance(item, bytes):
        planner.load_bytes(req, io.BytesIO(item))
        return
    target = planner.resolve_tensor(req).detach()
    target.copy_(item)
    planner.commit_tensor(req, target)
