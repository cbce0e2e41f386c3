"""Failures never freeze the notebook: hung collectives, Ctrl-C, timeouts, dead engines.

``RecoveringPolicy`` is the ``FailurePolicy`` every Session installs. The one move it
relies on (measured, REFERENCE.md): when the ranks that are not blocked call
``destroy_process_group()``, a rank blocked in a gloo collective with them gets
"Connection closed by peer" and returns to Python, its variables intact. So:

1. ranks that returned (or were idle) leave the process group; ranks that come back
   leave too (with 3+ ranks a rank unblocked by one peer may still hold others);
2. ranks still running after ``nudge`` seconds get SIGINT (for Python code that is
   not in a collective); after ``wedge_timeout`` they count as wedged: killed (only
   engines this session started, by pid) and replaced as for a dead engine;
   On NCCL, a rank blocked in a kernel is freed by aborting its communicators from
   its listener thread (``fsdp_nb.engine.nccl_abort``; one GPU shows abort and
   re-form, several GPUs blocking each other have not been run);
3. every rank joins a new group on a fresh port (``reform``) and every DeviceMesh /
   FSDP2 module on the ranks is re-pointed at the new groups
   (``fsdp_nb.engine.health.rebind_groups``): trained weights and optimizers stay.

``status`` reads busy / idle from the controller (never through a busy engine's
queue) and a busy rank's stack from a faulthandler dump (``engine/health.py``).
``restart`` replaces dead engines under the same ranks, re-forms the group and
replays recorded wraps.
"""

from __future__ import annotations

import html
import logging
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import rendezvous
from .dispatch import Dispatcher, FailurePolicy, Pending
from .engine import health as _health
from .engine import nccl_abort as _nccl
from .errors import DeadRankError, RankError, RankFailure, RankTimeoutError

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("fsdp_nb")

__all__ = [
    "RankStatus",
    "RecoveringPolicy",
    "SessionStatus",
    "abort_collectives",
    "install_health",
    "reform",
    "restart",
    "stacks",
    "status",
]


# -- engine health: stack files ----------------------------------------------------


def install_health(sess: Session, ranks: list[int] | None = None) -> None:
    """Make the given ranks' engines dump their stacks on SIGUSR1 into the session's
    folder; on NCCL sessions also start their abort listeners (``engine.nccl_abort``)."""
    folder = getattr(sess, "_stack_dir", None)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="fsdp_nb_stacks_")
        sess._stack_dir = folder
    d = _plain(sess)
    d.gather(d.apply("install health", _health.install, ranks=ranks, args=(folder,)), 30)
    if sess.backend == "nccl":
        who = list(range(sess.world_size)) if ranks is None else list(ranks)
        endpoints = d.gather(d.apply("start NCCL abort listener", _nccl.start, ranks=who), 30)
        sess._policy.abort_endpoints.update(zip(who, endpoints))


def abort_collectives(endpoints: list[str], timeout: float = 2.0) -> None:
    """Ask engines (their abort listeners' endpoints) to abort their NCCL communicators."""
    import zmq

    ctx = zmq.Context.instance()
    for ep in endpoints:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            sock.connect(ep)
            sock.send(b"abort")
        except zmq.ZMQError as exc:
            log.warning("fsdp_nb: could not ask %s to abort NCCL: %s", ep, exc)
        finally:
            sock.close()


def _signal(sess: Session, ranks: list[int], sig: int) -> None:
    """Send ``sig`` to the engines of ``ranks``: by pid for engines this session started
    on this host, otherwise through the controller (``client.send_signal``)."""
    c = sess._cluster
    here = socket.gethostname()
    remote = []
    for r in ranks:
        pid, host = c.pids[r], c.hosts[r]
        if pid is not None and host == here and c.owns_pid(pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        else:
            remote.append(c.engine_ids[r])
    if remote:
        try:
            c.client.send_signal(sig, targets=remote, block=False)
        except Exception:  # noqa: BLE001 - best effort: no nanny, old controller
            pass


def stacks(sess: Session, ranks: list[int], wait: float = 2.0) -> dict[int, str]:
    """Every thread's Python stack of each rank in ``ranks`` (engines on this host).

    Does not go through the engines' task queues: truncate the rank's stack file,
    send SIGUSR1, read what faulthandler wrote (from C, so a rank blocked in a
    collective answers too).
    """
    folder = getattr(sess, "_stack_dir", None)
    c = sess._cluster
    here = socket.gethostname()
    out: dict[int, str] = {}
    paths: dict[int, str] = {}
    for r in ranks:
        pid = c.pids[r]
        if folder is None or pid is None:
            out[r] = "(no stack: health hooks not installed on this rank)"
        elif c.hosts[r] != here:
            out[r] = f"(rank {r} runs on host {c.hosts[r]}; its stack is in {_health.stack_file(folder, pid)} there)"
        else:
            paths[r] = _health.stack_file(folder, pid)
            try:
                with open(paths[r], "w"):
                    pass
            except OSError:
                pass
    if paths:
        _signal(sess, list(paths), _health.STACK_SIGNAL)
        deadline = time.monotonic() + wait
        last: dict[int, int] = {}
        while paths and time.monotonic() < deadline:
            time.sleep(0.05)
            for r, p in list(paths.items()):
                size = os.path.getsize(p) if os.path.exists(p) else 0
                if size and last.get(r) == size:
                    out[r] = _main_thread_first(_read(p))
                    del paths[r]
                last[r] = size
        for r, p in paths.items():
            text = _read(p)
            out[r] = _main_thread_first(text) if text else "(no stack: the rank did not answer SIGUSR1)"
    return out


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _main_thread_first(dump: str) -> str:
    """faulthandler's dump with the thread that took the signal (the main thread) first."""
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    blocks.sort(key=lambda b: not b.startswith("Current thread"))
    return "\n\n".join(blocks).rstrip() + "\n"


def _peer_endpoints(sess: Session) -> dict[int, list[tuple[str, int]]]:
    """Each local engine's TCP socket addresses, read from its pid (no engine round trip)."""
    import psutil

    c = sess._cluster
    here = socket.gethostname()
    out: dict[int, list[tuple[str, int]]] = {}
    for r in range(c.world_size):
        pid = c.pids[r]
        if pid is None or c.hosts[r] != here:
            continue
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except (psutil.Error, OSError):
            continue
        out[r] = sorted({(x.laddr.ip, x.laddr.port) for x in conns if x.laddr})
    return out


# -- status ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """One rank's state right now."""

    rank: int
    """The rank."""
    engine_id: int
    """Its current ipyparallel engine id."""
    host: str
    """Host the engine runs on."""
    pid: int | None
    """Engine process id."""
    state: str
    """``"busy"`` (running or queued work), ``"idle"`` or ``"dead"``."""
    queued: int
    """Tasks the controller has sent this engine that have not finished (running included)."""
    stack: str | None = None
    """For a busy rank: every thread's Python stack, the main thread first."""

    @property
    def where(self) -> str | None:
        """The innermost frame of the main thread ("File ..., line N in fn"), if known."""
        if not self.stack:
            return None
        first = self.stack.split("\n\n", 1)[0].splitlines()
        frames = [line.strip() for line in first if line.strip().startswith("File ")]
        return frames[0] if frames else None


@dataclass(frozen=True)
class SessionStatus:
    """Per-rank busy / idle / dead, with stacks for busy ranks (``sess.status()``)."""

    state: str
    """The session's state (``ready``, ``degraded``, ``closed``...)."""
    backend: str
    """Process-group backend."""
    ranks: list[RankStatus] = field(default_factory=list)
    """One entry per rank, in rank order."""

    def _ranks_in(self, state: str) -> list[int]:
        return [r.rank for r in self.ranks if r.state == state]

    @property
    def busy(self) -> list[int]:
        """Ranks running or queued work."""
        return self._ranks_in("busy")

    @property
    def idle(self) -> list[int]:
        """Ranks waiting for work."""
        return self._ranks_in("idle")

    @property
    def dead(self) -> list[int]:
        """Ranks whose engine process is gone."""
        return self._ranks_in("dead")

    def __repr__(self) -> str:
        lines = [f"<fsdp_nb.SessionStatus {self.state}, backend={self.backend}>"]
        for r in self.ranks:
            where = f"  at {r.where}" if r.where else ""
            lines.append(f"  rank {r.rank}: {r.state:<4}  engine {r.engine_id}  pid {r.pid}  {r.host}{where}")
        for r in self.ranks:
            if r.stack:
                lines.append(f"\n--- rank {r.rank} stack\n{r.stack.rstrip()}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = {"busy": "#b58900", "idle": "#2aa198", "dead": "#dc322f"}
        rows = []
        for r in self.ranks:
            stack = (
                f"<details><summary>{html.escape(r.where or 'stack')}</summary>"
                f"<pre>{html.escape(r.stack)}</pre></details>"
                if r.stack else ""
            )
            rows.append(
                f"<tr><td>{r.rank}</td><td style='color:{colour.get(r.state, '')}'><b>{r.state}</b></td>"
                f"<td>{r.engine_id}</td><td>{r.pid}</td><td>{html.escape(r.host)}</td><td>{stack}</td></tr>"
            )
        return (
            f"<div><b>fsdp_nb status</b> &mdash; <code>{html.escape(self.state)}</code>, "
            f"backend <code>{html.escape(self.backend)}</code><table><thead><tr><th>rank</th>"
            "<th>state</th><th>engine</th><th>pid</th><th>host</th><th>where</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>"
        )


def status(sess: Session, *, with_stacks: bool = True) -> SessionStatus:
    """Which rank is busy, idle or dead, and where busy ranks are.

    Asks the controller (``queue_status``) and the engines' pids, never an engine's
    task queue, so it answers while a cell runs (from another thread or a widget).
    """
    c = sess._cluster
    dead = set(c.dead_ranks()) if sess.state != "closed" else set(range(c.world_size))
    try:
        queues = c.client.queue_status(targets=list(c.engine_ids), verbose=False)
    except Exception:  # noqa: BLE001 - a dead engine id may be refused
        queues = {}
    queued, states = [], []
    for r, eid in enumerate(c.engine_ids):
        q = queues.get(eid, {}) if isinstance(queues, dict) else {}
        queued.append(int(q.get("queue", 0)) if isinstance(q, dict) else 0)
        states.append("dead" if r in dead else ("busy" if queued[r] > 0 else "idle"))
    busy = [r for r, s in enumerate(states) if s == "busy"]
    found = stacks(sess, busy) if (with_stacks and busy) else {}
    ranks = [
        RankStatus(
            rank=r,
            engine_id=eid,
            host=c.hosts[r] or "?",
            pid=c.pids[r],
            state=states[r],
            queued=queued[r],
            stack=found.get(r),
        )
        for r, eid in enumerate(c.engine_ids)
    ]
    return SessionStatus(sess.state, sess.backend, ranks)


# -- the policy ----------------------------------------------------------------------


def _plain(sess: Session) -> Dispatcher:
    """A dispatcher on the session's cluster with the reporting-only policy, no echo
    (recovery's own calls must not recurse into recovery)."""
    d = getattr(sess, "_plain_dispatch", None)
    if d is None or d.cluster is not sess._cluster:
        d = Dispatcher(sess._cluster, FailurePolicy())
        d.echo = False
        sess._plain_dispatch = d
    return d


class RecoveringPolicy(FailurePolicy):
    """Turns failures into errors and a usable session, keeping every live rank's state."""

    def __init__(
        self,
        sess: Session,
        *,
        grace: float = 3.0,
        nudge: float = 2.0,
        wedge_timeout: float = 20.0,
    ):
        self.sess = sess
        self.grace = grace
        """Seconds ranks may keep running after another rank failed before recovery starts."""
        self.nudge = nudge
        """Seconds after leaving the group before still-running ranks get SIGINT."""
        self.wedge_timeout = wedge_timeout
        """Seconds to wait for stopped ranks to return before they count as wedged."""
        self.abort_endpoints: dict[int, str] = {}
        """NCCL sessions: rank -> its engine's abort listener (``engine.nccl_abort``)."""

    # hooks -------------------------------------------------------------------------

    def on_partial_failure(
        self, pending: Pending, failures: list[RankFailure], running: list[int]
    ) -> None:
        first = {f.rank for f in failures}
        note = self._recover(pending, running, interrupt=False, cause="partial failure")
        d = self.sess._dispatch
        collateral = [f for f in d._failures(pending) if f.rank not in first]
        err = RankError(pending.what, list(failures) + collateral, self.sess.world_size)
        err.collateral = [f.rank for f in collateral]  # type: ignore[attr-defined]
        err.add_note(note)
        raise err

    def on_interrupt(self, pending: Pending, running: list[int]) -> None:
        if not running:
            return
        note = self._recover(pending, running, interrupt=True, cause="Ctrl-C")
        print(f"fsdp_nb: interrupted {pending.what}; {note}", flush=True)

    def on_dead(self, pending: Pending, dead: list[int]) -> None:
        sess = self.sess
        all_dead = sorted(set(dead) | set(sess._cluster.dead_ranks()))
        running = [r for r, ar in pending.results.items() if not ar.ready() and r not in all_dead]
        wedged = self._unblock(pending, running, interrupt=bool(running), skip=set(all_dead))
        if wedged:
            self._kill(wedged)
        sess._state = "degraded"
        others = [f for f in sess._dispatch._failures(pending) if f.rank not in all_dead]
        err = DeadRankError(
            sorted(set(all_dead) | set(wedged)),
            f"while running {pending.what}. The other ranks were stopped and left the "
            "process group (their state is kept); sess.restart() replaces the dead "
            "engine(s) under the same rank(s) and re-forms the group.",
        )
        if others:
            err.add_note("Other ranks failed as a consequence:\n" + "\n".join(map(str, others)))
        raise err

    def on_timeout(self, pending: Pending, running: list[int], timeout: float) -> None:
        found = stacks(self.sess, running)
        note = self._recover(pending, running, interrupt=True, cause="timeout")
        err = RankTimeoutError(pending.what, timeout, running)
        err.stacks = found  # type: ignore[attr-defined]
        text = "\n".join(f"\n--- rank {r} was at:\n{s.rstrip()}" for r, s in sorted(found.items()))
        err.args = (f"{err.args[0]}\n{text}",)
        err.add_note(note)
        raise err

    # the dance ---------------------------------------------------------------------

    def _recover(self, pending: Pending, running: list[int], *, interrupt: bool, cause: str) -> str:
        """Stop ``running`` ranks, re-form the group on every rank; a note saying what happened."""
        try:
            return self._recover_or_raise(pending, running, interrupt=interrupt, cause=cause)
        except Exception as exc:  # noqa: BLE001 - the original error must still reach the user
            self.sess._state = "degraded"
            return (
                f"fsdp_nb could not recover the session ({cause}): {type(exc).__name__}: {exc}. "
                "Call sess.restart()."
            )

    def _recover_or_raise(
        self, pending: Pending, running: list[int], *, interrupt: bool, cause: str
    ) -> str:
        sess = self.sess
        dead = set(sess._cluster.dead_ranks())
        wedged = self._unblock(pending, running, interrupt=interrupt, skip=dead)
        if wedged or dead:
            self._kill(wedged)
            restart(sess)
            note = (
                f"fsdp_nb recovered the session ({cause}): rank(s) "
                f"{', '.join(map(str, sorted(set(wedged) | dead)))} did not return and "
                "were replaced (their state is lost; recorded wraps were replayed); the "
                "other ranks kept their state."
            )
        else:
            reform(sess)
            note = (
                f"fsdp_nb recovered the session ({cause}): every rank returned and joined a "
                "new process group; variables, models and optimizers are kept."
            )
        return note

    def _unblock(
        self, pending: Pending, running: list[int], *, interrupt: bool, skip: set[int]
    ) -> list[int]:
        """Bring ``running`` ranks back to Python; return those that did not come back."""
        sess = self.sess
        c = sess._cluster
        running = [r for r in running if r not in skip]
        if interrupt and running:
            _signal(sess, running, signal.SIGINT)
        left: set[int] = set()

        def leave(ranks: list[int]) -> None:
            ranks = [r for r in ranks if r not in left and r not in skip]
            if not ranks:
                return
            left.update(ranks)
            d = _plain(sess)
            peers = _peer_endpoints(sess)
            args = [([e for q, es in peers.items() if q != r for e in es],) for r in ranks]
            try:
                d.gather(d.apply("leave process group", _health.leave_group, args, ranks=ranks), 30)
            except Exception:  # noqa: BLE001 - a rank that cannot leave is handled as wedged
                pass

        leave([r for r in range(c.world_size) if r not in running])
        if sess.backend == "nccl" and running:
            # a rank blocked in an NCCL kernel returns only when its own communicators
            # are aborted (from its listener thread): closing peers' sockets is not enough
            abort_collectives([self.abort_endpoints[r] for r in running if r in self.abort_endpoints])
        start = time.monotonic()
        nudged = interrupt
        next_liveness = start + 0.5
        still = list(running)
        while True:
            still = [r for r in still if not pending.results[r].ready()]
            leave([r for r in running if r not in still])
            if not still:
                return []
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + 0.5
                gone = set(c.dead_ranks())
                skip |= gone
                still = [r for r in still if r not in gone]
                if not still:
                    return []
            if not nudged and now - start > self.nudge:
                _signal(sess, still, signal.SIGINT)
                nudged = True
            if now - start > self.wedge_timeout:
                return still
            c.client.wait([pending.results[r] for r in still], timeout=0.05)

    def _kill(self, ranks: list[int]) -> None:
        """SIGKILL wedged engines this session started; refuse others."""
        c = self.sess._cluster
        here = socket.gethostname()
        for r in ranks:
            pid = c.pids[r]
            if pid is not None and c.hosts[r] == here and c.owns_pid(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                raise RuntimeError(
                    f"rank {r} (engine {c.engine_ids[r]}, pid {pid} on {c.hosts[r]}) is wedged "
                    "and is not an engine this session started, so fsdp_nb will not kill it; "
                    "restart it with the launcher that started it, then call sess.restart()."
                )
        if ranks:
            from .cluster import wait_until

            wait_until(lambda: set(ranks) <= set(c.dead_ranks()), 10)


# -- re-forming the group, restart ---------------------------------------------------


def reform(sess: Session) -> None:
    """Every rank joins a new process group on a fresh port, keeping the rank order,
    then DeviceMeshes and FSDP2 modules on the ranks are re-pointed at the new groups."""
    d = _plain(sess)
    probes = rendezvous.probe_engines(sess._cluster, d, timeout=60)
    ranks = rendezvous.join_group(
        sess._cluster, d, probes, sess.backend,
        pg_timeout=sess.pg_timeout, threads=sess._threads, timeout=120,
    )
    parts = d.gather(d.apply("list mesh groups", _health.mesh_partitions), 60)
    union = sorted({rows for ps in parts for rows in ps})
    d.gather(d.apply("rebind meshes", _health.rebind_groups, args=(union,)), 120)
    sess._ranks = ranks


def _replace_dead(sess: Session, dead: list[int], timeout: float = 120.0) -> None:
    """Start one engine per dead rank and map it to that rank."""
    c = sess._cluster
    known = set(c.client.ids) | set(c.engine_ids)
    if c.cluster is None:
        raise DeadRankError(
            dead,
            "This session attached to a running cluster (Session.connect), so it cannot start "
            "engines: restart them with the cluster's launcher, then call sess.restart().",
        )
    c.cluster.start_engines_sync(n=len(dead))
    deadline = time.monotonic() + timeout
    while True:
        new = sorted(set(c.client.ids) - known)
        if len(new) >= len(dead):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"replacement engine(s) for rank(s) {dead} did not register within {timeout:g} s"
            )
        time.sleep(0.1)
    ids, pids, hosts = list(c.engine_ids), list(c.pids), list(c.hosts)
    for r, eid in zip(dead, new):
        ids[r], pids[r], hosts[r] = eid, None, None
    c.set_rank_order(ids, pids, hosts)
    d = _plain(sess)
    who = d.gather(d.apply("whoami", _health.whoami, ranks=dead), 60)
    for r, (pid, host) in zip(dead, who):
        c.pids[r], c.hosts[r] = pid, host
    install_health(sess, dead)


def restart(sess: Session, restore: str | None = None, drop: tuple[str, ...] = ()) -> Session:
    """Bring back the same ranks and rebuild the session.

    Dead engines are replaced (new engine, same rank), every rank joins a new process
    group, and models wrapped with ``sess.wrap`` are wrapped again on every rank
    (``fsdp_nb.sharding.replay_wraps``). On a healthy session this only re-forms the
    group, keeping every rank's state. ``restore``: a checkpoint loaded into the
    last wrapped model afterwards (``sess.load``). A model wrapped from a notebook
    instance can only come back through ``restore`` (no copy of its weights is kept);
    ``drop`` names wraps to forget instead of replaying them. A replay that cannot be
    done is refused before anything changes (``sharding.check_replayable``).
    """
    from .sharding import check_replayable, replay_wraps

    drop = tuple(drop)
    dead = sess._cluster.dead_ranks()
    check_replayable(sess, restore, drop, replaying=bool(dead))
    if dead:
        _replace_dead(sess, dead)
    reform(sess)
    if dead and sess._wraps:
        replay_wraps(sess, drop)
    sess._state = "ready"
    if restore is not None:
        names = list(sess._wraps)
        if not names:
            raise ValueError(
                f"restart(restore={restore!r}) needs a model to load into, but this session "
                "has no wrapped model; call sess.wrap(...) then sess.load(path, model)."
            )
        sess.load(restore, names[-1])
    return sess
