"""The memory side channel, engine side: a sampler thread publishing over its own socket.

A request sent through the engines' task queue waits behind the cell that is running
(2.6 s measured), so live memory cannot be polled that way while ``%%px`` trains.
Instead ``start`` (called once through the task queue) binds a zmq XPUB socket on the
engine's routable address and starts a daemon thread that publishes one JSON sample
per interval. The thread stops when its last subscriber goes away
(XPUB sees the unsubscribe when the notebook closes its SUB socket or dies), or when
nobody subscribed within ``wait_subscriber`` seconds: it never outlives its widget.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from typing import Any

__all__ = ["running", "sample", "start"]

_LOCK = threading.Lock()
_SAMPLERS: dict[str, _Sampler] = {}
_RAM_TOTAL: int | None = None


def _ram_total() -> int:
    global _RAM_TOTAL
    if _RAM_TOTAL is None:
        import psutil

        _RAM_TOTAL = int(psutil.virtual_memory().total)
    return _RAM_TOTAL


def sample(rank: int, device: str = "cpu", seq: int = 0, _proc: Any = None) -> dict[str, Any]:
    """One memory sample of this process as a JSON-ready dict.

    CPU: resident set size, its peak (``ru_maxrss``) and the host's RAM. CUDA (only if
    this process already initialised CUDA, never initialising it from here): allocated,
    reserved and peak allocated bytes on ``device`` and the device's total memory.
    """
    import psutil

    proc = _proc or psutil.Process(os.getpid())
    rss = int(proc.memory_info().rss)
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    out: dict[str, Any] = {
        "rank": rank,
        "seq": seq,
        "t": time.time(),
        "device": device,
        "rss": rss,
        "rss_peak": max(peak, rss),
        "ram_total": _ram_total(),
        "cuda_allocated": None,
        "cuda_reserved": None,
        "cuda_peak": None,
        "cuda_total": None,
    }
    if device.startswith("cuda"):
        torch = _torch_if_cuda_initialized()
        if torch is not None:
            dev = torch.device(device)
            out["cuda_allocated"] = int(torch.cuda.memory_allocated(dev))
            out["cuda_reserved"] = int(torch.cuda.memory_reserved(dev))
            out["cuda_peak"] = int(torch.cuda.max_memory_allocated(dev))
            out["cuda_total"] = int(torch.cuda.get_device_properties(dev).total_memory)
    return out


def _torch_if_cuda_initialized():
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


class _Sampler(threading.Thread):
    """One publishing thread (daemon): owns its zmq context and XPUB socket."""

    def __init__(self, token: str, rank: int, addr: str, device: str, interval: float,
                 wait_subscriber: float):
        super().__init__(name=f"fsdp_nb-memory-sampler-{token[:8]}", daemon=True)
        self.token, self.rank, self.addr, self.device = token, rank, addr, device
        self.interval, self.wait_subscriber = interval, wait_subscriber
        self.endpoint: str | None = None
        self.error: BaseException | None = None
        self.samples_sent = 0
        self._bound = threading.Event()

    def run(self) -> None:
        import psutil
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100)
            port = sock.bind_to_random_port(f"tcp://{self.addr}")
            self.endpoint = f"tcp://{self.addr}:{port}"
        except BaseException as exc:
            self.error = exc
            self._bound.set()
            sock.close(0)
            ctx.term()
            return
        self._bound.set()
        proc = psutil.Process(os.getpid())
        subscribers, ever = 0, False
        started = time.monotonic()
        next_tick = time.monotonic()
        try:
            while True:
                wait_ms = max(0, int((next_tick - time.monotonic()) * 1000))
                if sock.poll(wait_ms, zmq.POLLIN):
                    msg = sock.recv()
                    if msg[:1] == b"\x01":
                        if not ever:
                            next_tick = time.monotonic()  # first sample right away
                        subscribers, ever = subscribers + 1, True
                    elif msg[:1] == b"\x00":
                        subscribers -= 1
                    if ever and subscribers <= 0:
                        return  # the widget went away
                    continue
                if not ever and time.monotonic() - started > self.wait_subscriber:
                    return  # nobody came
                if ever:
                    s = sample(self.rank, self.device, self.samples_sent, proc)
                    sock.send(json.dumps(s).encode())
                    self.samples_sent += 1
                next_tick += self.interval
                if next_tick < time.monotonic():  # fell behind (suspended): do not burst
                    next_tick = time.monotonic() + self.interval
        finally:
            sock.close(0)
            ctx.term()
            with _LOCK:
                if _SAMPLERS.get(self.token) is self:
                    del _SAMPLERS[self.token]


def start(token: str, rank: int, addr: str, device: str = "cpu", interval: float = 1.0,
          wait_subscriber: float = 60.0) -> str:
    """Start (or find) the sampler ``token`` on this engine; return its zmq endpoint.

    ``addr``: the engine's routable address (``RankInfo.addr``), where the notebook
    can reach it. Idempotent per token.
    """
    if not (isinstance(interval, (int, float)) and interval > 0):
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    with _LOCK:
        s = _SAMPLERS.get(token)
        if s is not None and s.is_alive() and s.endpoint:
            return s.endpoint
        s = _Sampler(token, rank, addr, device, float(interval), float(wait_subscriber))
        _SAMPLERS[token] = s
    s.start()
    s._bound.wait(10)
    if s.error is not None or not s.endpoint:
        with _LOCK:
            _SAMPLERS.pop(token, None)
        raise RuntimeError(f"memory sampler could not bind on {addr}: {s.error!r}")
    return s.endpoint


def running() -> list[str]:
    """Tokens of the samplers alive on this engine."""
    with _LOCK:
        return [t for t, s in _SAMPLERS.items() if s.is_alive()]
