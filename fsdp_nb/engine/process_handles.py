"""Process handles that name one process, never a pid that may have been reused.

A pid names a process only while that process lives; after it exits the kernel hands
the number to the next process that starts. fsdp_nb signals and kills local engines,
the controller and its schedulers, and watches a kernel and a watchdog; each through a
handle checked against the process's start time (``process_stamp``), read when the pid
was learnt:

- :class:`ProcessHandle` opens a pidfd (Linux 5.3+) and checks the start time after it
  has the pidfd, so from then on it refers to that one process whatever happens to the
  number: its liveness is a poll of the pidfd (under a microsecond: it is on every
  call's path) and its signals go through ``pidfd_send_signal``. Where there are no
  pidfds it holds a ``psutil.Process``, whose ``send_signal`` checks the start time
  again before it sends anything;
- ``stop_processes`` stops a list of them (SIGTERM, then SIGKILL for those still there),
  what ``shutdown`` and the watchdog use; ``process_tree`` lists a process and its
  descendants (the controller's schedulers).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time

import psutil

__all__ = [
    "ProcessHandle", "handle_alive", "process_alive", "process_stamp", "process_tree",
    "stop_processes", "tcp_sockets",
]

log = logging.getLogger("fsdp_nb")


def process_stamp(pid: int) -> float | None:
    """The start time of process ``pid`` (with the pid, it names one process even
    after the pid is reused); None if it cannot be read (then only the pid is checked)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def process_alive(pid: int | None, stamp: float | None = None) -> bool:
    """True if ``pid`` runs (a zombie does not count) and, given ``stamp``, is the process
    it was taken from. A process we may not look at counts as alive."""
    if not pid:
        return False
    try:
        return handle_alive(psutil.Process(pid), stamp)
    except psutil.NoSuchProcess:
        return False


def handle_alive(p: psutil.Process, stamp: float | None = None) -> bool:
    """:func:`process_alive` for a process handle already held (one status read)."""
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return stamp is None or abs(p.create_time() - stamp) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class ProcessHandle:
    """One process, by a pidfd where there are pidfds (else a psutil handle), taken only
    if the process still has the start time it was known by."""

    def __init__(self, proc: psutil.Process, stamp: float | None, pidfd: int | None):
        self.pid = proc.pid
        """The process id (for messages: the handle, not the number, is what is signalled)."""
        self._proc, self._stamp, self._fd = proc, stamp, pidfd
        self._poll = None
        if pidfd is not None:
            self._poll = select.poll()
            self._poll.register(pidfd, select.POLLIN)

    @classmethod
    def open(cls, pid: int | None, stamp: float | None = None) -> ProcessHandle | None:
        """A handle on process ``pid`` if it runs and (given ``stamp``) is the process that
        start time was read from; None otherwise (gone, or the pid now names another)."""
        if not pid:
            return None
        fd = None
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)  # first: what the check below sees is this process
            except ProcessLookupError:
                return None
            except OSError as exc:  # an old kernel, a sandbox: psutil's checks then
                log.debug("no pidfd for pid %d: %s", pid, exc)
        try:
            proc = psutil.Process(pid)
            if handle_alive(proc, stamp):
                return cls(proc, stamp, fd)
        except psutil.NoSuchProcess:
            pass
        if fd is not None:
            os.close(fd)
        return None

    def alive(self) -> bool:
        """The process has not exited (a zombie has)."""
        if self._poll is not None:
            return not self._poll.poll(0)
        return handle_alive(self._proc, self._stamp)

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP, a debugger, a job control stop)."""
        try:
            return self._proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.NoSuchProcess:
            return False

    def send_signal(self, sig: int) -> bool:
        """Send ``sig`` to this process; False if it has exited already."""
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                self._proc.send_signal(sig)  # psutil checks the start time again first
            return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            return False

    def close(self) -> None:
        """Release the pidfd (the process is not affected)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._poll = None, None

    __del__ = close


def process_tree(pid: int | None) -> list[tuple[int, float | None]]:
    """(pid, start time) of process ``pid`` and all its descendants (empty if it is gone):
    what must stop with it (ipyparallel's controller runs its schedulers as children,
    which outlive a controller killed with SIGKILL)."""
    if not process_alive(pid):
        return []
    try:
        p = psutil.Process(pid)
        return [(q.pid, q.create_time()) for q in (p, *p.children(recursive=True))]
    except psutil.Error as exc:  # it exited meanwhile, or one we may not look at
        log.debug("could not list the processes under pid %s: %s", pid, exc)
        return []


def stop_processes(processes: list[tuple[int, float | None]], wait: float, term: bool = False) -> list[int]:
    """Stop ``processes`` ((pid, start time) pairs), each through a verified handle.

    Args:
        processes: what to stop; a pid that no longer names the process its start time
            was taken from is left alone.
        wait: seconds to wait for them to exit before those still there get SIGKILL.
        term: send SIGTERM first (else they are already being stopped by other means).

    Returns the pids that had to be killed.
    """
    left = [h for h in (ProcessHandle.open(pid, stamp) for pid, stamp in processes) if h is not None]
    try:
        if term:
            for h in left:
                h.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait
        while any(h.alive() for h in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [h.pid for h in left if h.alive() and h.send_signal(signal.SIGKILL)]
    finally:
        for h in left:
            h.close()


def tcp_sockets(pid: int) -> list[tuple[str, int]] | None:
    """The local addresses of process ``pid``'s TCP sockets; None when they cannot be read."""
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except (psutil.Error, OSError) as exc:
        log.debug("no sockets read for pid %d: %s", pid, exc)
        return None
    return sorted({(x.laddr.ip, x.laddr.port) for x in conns if x.laddr})
