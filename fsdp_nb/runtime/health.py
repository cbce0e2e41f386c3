"""The notebook side of the engines' health hooks: stack dumps and the NCCL abort channel.

Neither goes through an engine's task queue, where a request waits behind the
running cell:

- stacks: every engine registers ``faulthandler`` on SIGUSR1 writing to its own file
  (``fsdp_nb.engine.health``); :meth:`RankHealth.stacks` truncates the file, signals
  the engine and reads what was written, from C, so a rank blocked in a collective
  answers too. Engines on other hosts are named with where their file is. The files
  (0600) are in a 0700 folder of this user's, removed at shutdown (``close``).
- where each rank is (``fsdp_nb.hangs.hang_watch``, handed in): a thread per engine
  answers signed requests.
- NCCL abort: on NCCL sessions every engine runs a listener thread
  (``fsdp_nb.engine.nccl_abort``); :meth:`RankHealth.abort` asks it, in a request
  signed with the cluster's key, to abort the rank's communicators, which is what
  frees a rank blocked in an NCCL kernel.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING

from ..engine import health as _health
from ..engine import nccl_abort as _nccl
from ..engine.private_files import private_file
from ..engine.signing import Link
from .listeners import start_listeners

if TYPE_CHECKING:
    from ..hangs.hang_watch import HangWatch
    from .cluster import EngineCluster
    from .dispatch import Dispatcher

__all__ = ["RankHealth", "abort_collectives"]

log = logging.getLogger("fsdp_nb")


class RankHealth:
    """The health hooks of one session's engines: where stacks are written, and the
    abort listeners' endpoints."""

    def __init__(self, cluster: EngineCluster, watch: HangWatch):
        self.cluster = cluster
        """The engines (rank -> pid, host)."""
        self.folder: str | None = None
        """Where engines write their stack dumps (a 0700 folder, made on first ``install``)."""
        self.abort_links: dict[int, tuple[str, Link]] = {}
        """NCCL sessions: rank -> its engine's abort listener (endpoint, signed link)."""
        self.watch = watch
        """Where each rank is while a call waits (its engine's watch thread; ``fsdp_nb.hangs``)."""

    def install(self, dispatcher: Dispatcher, ranks: list[int] | None = None, *, nccl: bool) -> None:
        """Install the hooks on ``ranks``' engines (all by default); ``nccl``: also
        start their abort listeners."""
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="fsdp_nb_stacks_")  # 0700, this user's
        d = dispatcher
        d.gather(d.apply("install health", _health.install, ranks=ranks, args=(self.folder,)), 30)
        self.watch.start(d, ranks)
        if nccl:
            self.start_abort_listeners(d, ranks)

    def start_abort_listeners(self, dispatcher: Dispatcher, ranks: list[int] | None = None) -> None:
        """Start the NCCL abort listener of ``ranks``' engines (all by default; once per
        engine) and keep a signed link to each."""
        self.abort_links.update(start_listeners(self.cluster, dispatcher, "start NCCL abort listener",
                                                _nccl.start, "nccl-abort", ranks))

    def abort(self, ranks: list[int]) -> None:
        """Ask ``ranks``' engines to abort their NCCL communicators (those with a listener)."""
        abort_collectives([self.abort_links[r] for r in ranks if r in self.abort_links])

    def forget(self, rank: int) -> None:
        """``rank`` left the world (``sess.resize``): drop its watch and abort links."""
        self.watch.links.pop(rank, None)
        self.abort_links.pop(rank, None)

    def close(self) -> None:
        """Remove the stack dump folder (the session is over)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def stacks(self, ranks: list[int], wait: float = 2.0) -> dict[int, str]:
        """Every thread's Python stack of each rank in ``ranks`` (engines on this host)."""
        c = self.cluster
        here = socket.gethostname()
        out: dict[int, str] = {}
        paths: dict[int, str] = {}
        for r in ranks:
            pid = c.pids[r]
            if self.folder is None or pid is None:
                out[r] = "(no stack: health hooks not installed on this rank)"
            elif c.hosts[r] != here:
                where = _health.stack_file(self.folder, pid)
                out[r] = f"(rank {r} runs on host {c.hosts[r]}; its stack is in {where} there)"
            else:
                paths[r] = _health.stack_file(self.folder, pid)
                try:
                    os.close(private_file(paths[r]))  # truncated: only the new dump is read
                except OSError as exc:
                    log.debug("could not truncate the stack file of rank %d: %s", r, exc)
        if paths:
            c.signal(list(paths), _health.STACK_SIGNAL)
            deadline = time.monotonic() + wait
            last: dict[int, int] = {}
            while paths and time.monotonic() < deadline:
                time.sleep(0.05)
                for r, p in list(paths.items()):
                    size = os.path.getsize(p) if os.path.exists(p) else 0
                    if size and last.get(r) == size:  # the dump stopped growing
                        out[r] = _main_thread_first(_read(p))
                        del paths[r]
                    last[r] = size
            for r, p in paths.items():
                text = _read(p)
                out[r] = _main_thread_first(text) if text else "(no stack: the rank did not answer SIGUSR1)"
        return out


def abort_collectives(listeners: list[tuple[str, Link]], timeout: float = 2.0) -> None:
    """Ask engines (their abort listeners: endpoint and signed link) to abort their
    NCCL communicators."""
    import zmq

    ctx: zmq.SyncContext = zmq.Context.instance()
    for ep, link in listeners:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            sock.connect(ep)
            sock.send(link.pack(_nccl.ABORT))
        except zmq.ZMQError as exc:
            log.warning("fsdp_nb: could not ask %s to abort NCCL: %s", ep, exc)
        finally:
            sock.close()


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as exc:
        log.debug("could not read stack file %s: %s", path, exc)
        return ""


def _main_thread_first(dump: str) -> str:
    """faulthandler's dump with the thread that took the signal (the main thread) first."""
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    blocks.sort(key=lambda b: not b.startswith("Current thread"))
    return "\n\n".join(blocks).rstrip() + "\n"
