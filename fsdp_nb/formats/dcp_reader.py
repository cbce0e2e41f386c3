"""The DCP storage readers every fsdp_nb read goes through: safe and checked.

- ``.metadata`` is unpickled with the restricted unpickler (``restricted``), or taken
  as already read and checked; only planners that unpickle BYTE_IO items (an
  optimizer's ``param_groups``) weights-only are taken (``pickles``), unless the caller
  trusts the checkpoint (``open_sharded`` has checked every such item already);
- each stored item is checked against its recorded checksum as it is read, and its
  tensor built over the bytes read (``item_tensor``), not copied again by ``torch.load``.

``CheckedFileSystemReader`` (DCP's ``FileSystemReader``: a local folder, read by
``local_readers()`` threads at once) and ``CheckedFsspecReader`` (DCP's fsspec reader:
a URL, read by one, its client keeping its own connections) hand ``read_metadata`` and
``read_data`` to a ``CheckedRead``: composition, because DCP's fsspec reader subclasses
its local one, and a base of ours shared by both would sit in a diamond.

``read_data`` takes each item of a plan one way:

- with ``before_commit`` (a load into a live model), check, then copy: every item of
  this process's plan is read and checked, then ``before_commit`` learns whether this
  process read everything and answers whether every rank did; only then are the
  tensors copied into their targets. A load can then write straight into the model's
  own tensors and still leave every rank's model as it was when any rank's read fails.
  The check reads each item through a small window and keeps only its ends
  (``item_scan``); the copy reads the items again, from the page cache the check just
  filled, straight into each target that takes the stored bytes as they are (a
  contiguous CPU tensor of the same dtype, the usual FSDP shard): one copy, where
  ``dcp.load`` makes two (into the tensor ``torch.load`` allocates, then the target).
  A remote store has no page cache: its items are fetched once and held (``item_files``).
  Both passes cut the items into runs that the reader threads read at once.
- without it (offline consolidate and export, a resize, ``read_items``), stream: each
  item read into one reused buffer, checked where checksums are recorded, and copied
  into its target at once.
- with a stream transform (compression), which only DCP's own ``read_data`` undoes:
  counted, and its stored bytes checked where checksums are recorded (in the check
  pass, if any), then handed to DCP's read. fsdp_nb never writes such items; DCP
  decodes them after the commit, so a load into a live model reads a checkpoint that
  has them into fresh tensors (``can_stage``).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..torch_compat import dcp_load_into, dcp_metadata_path, fsspec_reader, narrow_tensor_by_index
from .checksums import ChecksumMismatch
from .helper_threads import LazyPool
from .item_files import ItemFiles
from .item_scan import ItemScanner, unwritten_buffer
from .item_tensor import tensor_from_item
from .pickles import is_weights_only, load_planner
from .restricted import load_dcp_metadata, max_metadata_bytes
from .storage import is_local, read_into, to_url

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
    from torch.futures import Future

__all__ = ["MAX_READERS", "MIN_READERS", "CheckedRead", "can_stage", "local_readers",
           "read_items", "reader_classes", "safe_reader"]

log = logging.getLogger("fsdp_nb")

MAX_READERS = 4
"""At most this many threads read one process's share of a local checkpoint at once."""
MIN_READERS = 2
"""At least this many, even where the ranks fill the host's cores: a reader of the check
pass waits on the disk most of the time (``item_scan``), so a second one keeps another
request in flight."""
_reader_pool = LazyPool("fsdp_nb-read", MAX_READERS - 1)
_COUNTING = threading.Lock()

Checks = dict[tuple[str, int], tuple[int, int, str]]  # (file, offset) -> (length, checksum, algorithm)
Requests = list[tuple["ReadItem", Any]]  # DCP's read requests, each with the stored item it reads


def can_stage(md: Any) -> bool:
    """Whether every item of DCP metadata ``md`` can be read by the checked paths (none
    carries a stream transform, such as compression, which only DCP's own reader undoes)."""
    return not any(_transformed(info) for info in (md.storage_data or {}).values())


def safe_reader(fs: Any, path: str, so: dict[str, Any], *, metadata: Any = None,
                checks: Checks | None = None, on_read: Callable[[int], None] | None = None,
                before_commit: Callable[[bool], bool] | None = None, weights_only: bool = True,
                readers: int | None = None) -> Any:
    """A DCP storage reader for folder ``path`` on ``fs`` that unpickles ``.metadata`` safely
    and checks what it reads: a ``CheckedFileSystemReader`` for a local folder, read by
    ``readers`` threads at once (default: ``local_readers()``), else a ``CheckedFsspecReader``
    (``so``: its storage options), read by one. ``metadata``, ``checks``, ``on_read``,
    ``before_commit``, ``weights_only``: as ``CheckedRead`` says."""
    checked = CheckedRead(metadata=metadata, checks=checks, on_read=on_read, before_commit=before_commit,
                          weights_only=weights_only)
    local, remote = reader_classes()
    if is_local(fs):
        return local(path, checked, local_readers() if readers is None else readers)
    return remote(to_url(fs, path), checked, **so)


def read_items(fs: Any, path: str, md: Any, keys: list[str], so: dict[str, Any] | None = None,
               weights_only: bool = True) -> dict[str, Any]:
    """The stored items ``keys`` of DCP folder ``path`` (``md``: its metadata, read and
    checked), read in this process alone: a tensor for each stored tensor, the object
    for each pickled item (weights-only unless ``weights_only`` is False). For small
    items such as a trainer's step; the model's tensors go through a load."""
    import torch

    sd: dict[str, Any] = {}
    for k in keys:
        item = md.state_dict_metadata[k]
        sd[k] = torch.empty(tuple(item.size), dtype=item.properties.dtype) if hasattr(item, "size") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is there: none is needed
        dcp_load_into(sd, safe_reader(fs, path, so or {}, metadata=md, weights_only=weights_only),
                      load_planner(weights_only, allow_partial_load=True))
    return sd


def local_readers(cores: int | None = None, ranks: int | None = None) -> int:
    """How many threads read one process's share of a local checkpoint at once: one per
    core it has to itself (its ``cores``, default the ones it may run on, over the ``ranks``
    on this host, default ``LOCAL_WORLD_SIZE``), at least ``MIN_READERS`` and at most
    ``MAX_READERS``."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    if ranks is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks = int(raw) if raw.isdigit() else 1
    return max(MIN_READERS, min(MAX_READERS, cores // max(1, ranks)))


@functools.cache
def reader_classes() -> tuple[type, type]:
    """(``CheckedFileSystemReader``, ``CheckedFsspecReader``), defined on the first call:
    their bases are torch's, and fsdp_nb's modules import torch only when they use it."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckedFileSystemReader(FileSystemReader):
        """DCP's reader of a local folder, reading through ``checked`` with ``readers``
        threads at once."""

        remote = False
        """Read through the page cache: a second pass costs no transfer."""

        def __init__(self, path: str, checked: CheckedRead, readers: int) -> None:
            super().__init__(path)
            self.checked, self.readers = checked, readers

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.checked.read_metadata(self, kwargs.get("rank"))

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            return self.checked.read_data(self, plan, planner, super().read_data)

    class CheckedFsspecReader(fsspec_reader()):  # type: ignore[misc]  # torch's class, found at run time
        """DCP's reader of a URL (``storage_options``: its file system's), reading through
        ``checked`` with one thread (``readers``): a remote store's client keeps its own
        connections."""

        remote = True
        """Each item fetched once per read (``item_files``), as no page cache keeps it."""

        def __init__(self, url: str, checked: CheckedRead, **storage_options: Any) -> None:
            super().__init__(url, **storage_options)
            self.checked, self.readers = checked, 1

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.checked.read_metadata(self, kwargs.get("rank"))

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            return self.checked.read_data(self, plan, planner, super().read_data)

    return CheckedFileSystemReader, CheckedFsspecReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckedRead:
    """The checked reading that both readers of ``reader_classes`` hand their
    ``read_metadata`` and ``read_data`` to (each call names the reader), and its options."""

    metadata: Any = None
    """The ``.metadata`` already read (and checked), so it is not read again."""
    checks: Checks | None = None
    """The items' records (``checksums.item_checksums``): each item is checked as it is
    read; one without a record is refused. None: the checkpoint records none."""
    on_read: Callable[[int], None] | None = None
    """Told each stored item's size as it is read."""
    before_commit: Callable[[bool], bool] | None = None
    """``(read_all) -> every_rank_read_all``: read everything before copying anything (see
    the module's docstring); called once per load on every rank. None: stream."""
    weights_only: bool = True
    """BYTE_IO items only weights-only, and only with a planner that loads them so
    (``pickles.load_planner``); False trusts the checkpoint (it can then run code)."""

    def read_metadata(self, reader: Any, rank: int | None) -> Any:
        """``reader``'s checkpoint metadata (``rank``: that rank's own, where DCP asks for it):
        the one already read, or the file unpickled with the restricted unpickler."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self.metadata is not None and rank is None:
            md = self.metadata
        else:
            with reader.fs.create_stream(dcp_metadata_path(reader, rank), "rb") as f:
                md = load_dcp_metadata(f.read(max_metadata_bytes() + 1), self.weights_only)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = reader.load_id
        return md

    def read_data(self, reader: Any, plan: LoadPlan, planner: LoadPlanner,
                  dcp_read: Callable[[LoadPlan, LoadPlanner], Future[None]]) -> Future[None]:
        """Read ``plan``'s items from ``reader``'s folder into ``planner``'s targets, each
        item one way (see the module's docstring); ``dcp_read``: DCP's own ``read_data``,
        for the items only it decodes."""
        import torch.futures

        if self.weights_only and not is_weights_only(planner):
            raise TypeError(f"{type(planner).__name__} would unpickle this checkpoint's items "
                            "without restriction: use fsdp_nb.formats.pickles.load_planner")
        items = [(req, reader.storage_data[req.storage_index]) for req in plan.items]
        plain = [(req, md) for req, md in items if not _transformed(md)]
        decoded = [(req, md) for req, md in items if _transformed(md)]
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        files = ItemFiles(reader, keep=self.before_commit is not None)
        try:
            if self.before_commit is None:
                self._check_stored(files, decoded)
                self._stream(files, planner, plain)
            elif not self._check_then_copy(files, planner, plain, decoded, self.before_commit):
                return done
        finally:
            files.close()
        if decoded:
            dcp_read(dataclasses.replace(plan, items=[req for req, _ in decoded]), planner).wait()
        return done

    def _stream(self, files: ItemFiles, planner: LoadPlanner, items: Requests) -> None:
        """Each item read into one reused buffer, checked and copied into its target at
        once: one copy less than ``torch.load`` of the checked bytes, and no new
        allocation per item."""
        scanner = ItemScanner()
        for stream, md, key, reqs in files.opened(items):
            self._count(md)
            view = scanner.scan(stream, md, self._want(key), whole=True)
            for req in reqs:
                _commit(planner, req, _item(planner, req, md, view))

    def _check_then_copy(self, files: ItemFiles, planner: LoadPlanner, plain: Requests, decoded: Requests,
                         before_commit: Callable[[bool], bool]) -> bool:
        """Every item read, checked and (``plain``) its shape matched; every rank told;
        then the ``plain`` items read again and copied into their targets. Nothing is
        copied when any rank failed (a failure here raises, DCP reports it on every rank).
        Whether they were copied. Both passes split the items into runs that
        ``files.readers`` threads read at once."""
        runs = _runs(plain, files.readers)
        failure: BaseException | None = None
        direct: dict[int, int] = {}
        try:
            self._check_stored(files, decoded)
            for found in _each(functools.partial(self._check_run, files, planner), runs):
                direct.update(found)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            failure = exc
        everyone = before_commit(failure is None)
        if failure is not None:
            raise failure
        if not everyone:
            log.info("another rank could not read its part of the checkpoint: nothing loaded here")
            return False
        _each(functools.partial(self._copy_run, files, planner, direct), runs)
        return True

    def _check_run(self, files: ItemFiles, planner: LoadPlanner, run: Requests) -> dict[int, int]:
        """Read and check every item of ``run``, and match the shapes its requests ask
        for; raise at the first failure. Each item goes through an ``ItemScanner``, which
        keeps only what the shapes need. Returns, for each request (by ``id``) that can be
        read straight into its target, where in the item its bytes start (``_direct_start``)."""
        from torch.distributed.checkpoint.planner import LoadItemType

        scanner = ItemScanner()
        direct: dict[int, int] = {}
        for stream, md, key, reqs in files.opened(run):
            self._count(md)
            view = scanner.scan(stream, md, self._want(key), whole=reqs[0].type == LoadItemType.BYTE_IO)
            for req in reqs:
                start = _direct_start(planner, req, _item(planner, req, md, view), view)
                if start is not None:
                    direct[id(req)] = start
        return direct

    def _copy_run(self, files: ItemFiles, planner: LoadPlanner, direct: dict[int, int], run: Requests) -> None:
        """The copy pass over ``run`` (checked already): each request in ``direct`` read
        straight into its target, the others' items read again into one reused buffer
        and copied from it."""
        buf = unwritten_buffer(0)
        for stream, md, _key, reqs in files.opened(run):
            view = None
            for req in reqs:
                start = direct.get(id(req))
                if start is not None:
                    _read_into_target(planner, req, md, stream, start)
                    continue
                if view is None:  # the item read again (the same bytes: a checkpoint's files never change)
                    if len(buf) < md.length:
                        buf = unwritten_buffer(md.length)
                    stream.seek(md.offset)
                    view = buf[:read_into(stream, buf[:md.length])]
                    if len(view) != md.length:
                        raise ChecksumMismatch(f"file {md.relative_path!r} is shorter than when it was checked")
                _commit(planner, req, _item(planner, req, md, view))

    def _check_stored(self, files: ItemFiles, items: Requests) -> None:
        """Count the items DCP's own read decodes, and check their stored bytes where the
        checkpoint records checksums (raise at the first failure)."""
        scanner = ItemScanner()
        for stream, md, key, _reqs in files.opened(items):
            self._count(md)
            if self.checks is not None:
                scanner.scan(stream, md, self._want(key), whole=True)

    def _count(self, sinfo: Any) -> None:
        """Tell ``on_read`` that stored item ``sinfo`` is being read."""
        if self.on_read is not None:
            with _COUNTING:  # reader threads count at once
                self.on_read(int(sinfo.length))

    def _want(self, key: tuple[str, int]) -> tuple[int, int, str] | None:
        """The recorded ``(length, checksum, algorithm)`` of the item at ``key``; None
        when the checkpoint records none; ChecksumMismatch when it records others only."""
        if self.checks is None:
            return None
        want = self.checks.get(key)
        if want is None:
            raise ChecksumMismatch(f"file {key[0]!r}: no checksum was recorded for the item at byte {key[1]}")
        return want


def _transformed(sinfo: Any) -> bool:
    """Whether stored item ``sinfo`` carries a stream transform (older metadata has no field)."""
    return bool(getattr(sinfo, "transform_descriptors", None))


def _runs(items: Requests, k: int) -> list[Requests]:
    """``items`` (request, stored item) in file order, cut into at most ``k`` runs of
    about equal bytes, never between two requests for one stored item."""
    order = sorted(items, key=lambda rm: (rm[1].relative_path, rm[1].offset))
    sizes = {(md.relative_path, int(md.offset)): int(md.length) for _, md in order}
    share = sum(sizes.values()) / max(1, k)
    runs: list[Requests] = [[]]
    done, at = 0, None
    for req, md in order:
        key = (md.relative_path, int(md.offset))
        if key != at:
            if runs[-1] and len(runs) < k and done >= share * len(runs):
                runs.append([])
            done, at = done + sizes[key], key
        runs[-1].append((req, md))
    return runs


def _each(fn: Callable[[Requests], Any], runs: list[Requests]) -> list[Any]:
    """``fn(run)`` for every run, the first on this thread and the others on the reader
    pool at once; their results once all have ended (none is left running, even after
    Ctrl-C), or the first failure."""
    others = [_reader_pool().submit(fn, run) for run in runs[1:]]
    results: list[Any] = []
    failure: BaseException | None = None
    try:
        results.append(fn(runs[0]))
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


def _direct_start(planner: LoadPlanner, req: ReadItem, item: Any, view: memoryview) -> int | None:
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


def _read_into_target(planner: LoadPlanner, req: ReadItem, sinfo: Any, file: Any, start: int) -> None:
    """Request ``req``'s bytes, at ``start`` in item ``sinfo`` (checked already), read
    from ``file`` straight into its target, then committed."""
    import torch

    target = planner.resolve_tensor(req).detach()
    raw = target.reshape(-1).view(torch.uint8)
    if raw.numel():
        file.seek(sinfo.offset + start)
        if read_into(file, raw.numpy().data) != raw.numel():
            raise ChecksumMismatch(f"file {sinfo.relative_path!r} is shorter than when it was checked")
    planner.commit_tensor(req, target)


def _item(planner: LoadPlanner, req: ReadItem, md: Any, view: memoryview) -> Any:
    """What read item ``view`` holds for request ``req``: its bytes, or (a tensor item)
    the requested slice of its tensor, built over ``view`` and matched against the
    planner's target."""
    from torch.distributed.checkpoint.planner import LoadItemType

    if req.type == LoadItemType.BYTE_IO:
        return bytes(view)
    tensor = narrow_tensor_by_index(tensor_from_item(view), req.storage_offsets, req.lengths)
    want = planner.resolve_tensor(req).size()
    if want != tensor.size():
        raise ChecksumMismatch(
            f"file {md.relative_path!r}: the item at byte {md.offset} holds {tuple(tensor.size())}, "
            f"not the {tuple(want)} its metadata promised")
    return tensor


def _commit(planner: LoadPlanner, req: ReadItem, item: Any) -> None:
    """Hand ``item`` (from ``_item``) to DCP's planner: bytes loaded, a tensor copied
    into its target."""
    if isinstance(item, bytes):
        planner.load_bytes(req, io.BytesIO(item))
        return
    target = planner.resolve_tensor(req).detach()
    target.copy_(item)
    planner.commit_tensor(req, target)
