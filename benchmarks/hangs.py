"""The hang watch: what it costs a training step, and how fast a hang is explained and ended.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/hangs.py [--rounds N] [--steps N]``.
Prints a table and writes benchmarks/out/hangs.json.

- cost: the same ``%%px`` FSDP2 training cell (benchmarks/_train_loop.py) on two
  2-rank sessions side by side, rounds alternating: one with the watch off (no flight
  recorder, ``hang_after=None``), one with it on as shipped (flight recorder on gloo,
  30 s; the watch asks the ranks every 0.2 s while the cell trains), and the second
  again with ``hang_after=1``; the order turns each round. Median tokens/s
  per rank, as a ratio to "off"; "off again" (the same session twice per round) shows
  how far two identical runs fall apart on this machine.
- per collective, inside an engine: microseconds of a 1-member gloo all_reduce with the
  flight recorder off and on (256 records): what each record costs the launching thread
  in the engine process, where gloo's own 2-rank latency (1.6-1.8 ms here) hides it.
- a straggler: seconds from a rank's late arrival being due (``hang_after=2``) to the
  first diagnosis on screen; once with the waiting rank in a synchronous all_reduce
  (gloo, told by the recorder or its frame), once as an NCCL rank waits (an async
  all_reduce issued, then blocked elsewhere, recorder off: told by the groups' counts).
- a stopped rank (SIGSTOP while the ranks loop on all_reduce, ``timeout=10``): seconds
  to the error naming it, then to a usable session (the stopped rank replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))

import psutil  # noqa: E402

import fsdp_nb  # noqa: E402
from fsdp_nb.errors import RankTimeoutError  # noqa: E402
from fsdp_nb.lifetime.start_stop import HANG_AFTER  # noqa: E402

HERE = Path(__file__).parent


def _session(watch: bool) -> fsdp_nb.Session:
    """A 2-rank session with the hang watch on (as shipped) or off (no flight recorder)."""
    old = os.environ.get("TORCH_FR_BUFFER_SIZE")
    if not watch:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # the engines inherit it; fsdp_nb keeps a user's value
    try:
        s = fsdp_nb.Session(2, backend="gloo", activate=False, standby=False,
                            hang_after=HANG_AFTER if watch else None)
    finally:
        if old is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = old
    s.execute((HERE / "_train_loop.py").read_text())
    return s


def _tokens(s: fsdp_nb.Session, steps: int, hang_after: float | None = None) -> float:
    s.execute(f"bm_out = bench_train({steps})", hang_after=hang_after)
    return min(tps for _, tps in s.pull("bm_out"))


def cost(rounds: int, steps: int) -> dict[str, float]:
    off, on = _session(False), _session(True)
    runs = [("off", off, None), ("off again", off, None), ("on", on, None), ("on, hang_after=1", on, 1.0)]
    got: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    try:
        _tokens(off, 3), _tokens(on, 3)  # warm both
        for i in range(rounds):  # the order turns each round: no case always goes first
            for name, s, hang_after in runs[i % len(runs):] + runs[:i % len(runs)]:
                got[name].append(_tokens(s, steps, hang_after))
        asked = on.run(_question_ms)  # on a rank whose flight recorder is full of training
    finally:
        off.shutdown()
        on.shutdown()
    med = {k: statistics.median(v) for k, v in got.items()}
    return {**{f"{k} tokens/s": v for k, v in med.items()},
            **{f"{k} / off": med[k] / med["off"] for k in med if k != "off"},
            "one question on a rank, ms (the watch's, every 0.2 s)": max(a for a, _ in asked),
            "one question on a rank, ms (an error's: every record read)": max(b for _, b in asked)}


def _question_ms(n: int = 200) -> tuple[float, float]:
    """Milliseconds the engine's watch thread spends on one question: the cheap one the
    watch repeats, and the one an error asks (records read)."""
    import time as _t

    from fsdp_nb.hangs import rank_hang_watch as hang_watch

    out = []
    for now in (False, True):
        t0 = _t.perf_counter()
        for _ in range(n):
            hang_watch.watch().state(now=now)
        out.append((_t.perf_counter() - t0) / n * 1e3)
    return out[0], out[1]


def _per_collective_us(n: int = 3000) -> float:
    """Microseconds per all_reduce of 4 floats on a 1-member group of this rank (no
    peer to wait for: what is left is the launching thread's own work, records included)."""
    import time as _t

    import torch as _torch
    import torch.distributed as _dist

    t = _torch.ones(4)
    mine = [_dist.new_group([r]) for r in range(_dist.get_world_size())][_dist.get_rank()]
    for _ in range(200):
        _dist.all_reduce(t, group=mine)
    t0 = _t.perf_counter()
    for _ in range(n):
        _dist.all_reduce(t, group=mine)
    return (_t.perf_counter() - t0) / n * 1e6


def per_collective() -> dict[str, float]:
    """``_per_collective_us`` on sessions with the recorder off and on, alternating."""
    off, on = _session(False), _session(True)
    got: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(3):
            got["off"].append(min(off.run(_per_collective_us)))
            got["on"].append(min(on.run(_per_collective_us)))
    finally:
        off.shutdown()
        on.shutdown()
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"1-member all_reduce in an engine, recorder off, us": med["off"],
            "1-member all_reduce in an engine, recorder on (256), us": med["on"]}


def straggler(s: fsdp_nb.Session, tmp: Path, like_nccl: bool = False) -> float:
    """Seconds past ``hang_after`` (2 s) until the diagnosis is shown. ``like_nccl``: the
    waiting rank issues an async all_reduce and blocks outside torch.distributed, as an
    NCCL rank blocks in a CUDA sync."""
    go = tmp / ("go-nccl" if like_nccl else "go")
    seen: list[float] = []

    def on_event(e) -> None:
        if e.phase == "hang" and not seen:
            seen.append(time.monotonic())
            go.touch()

    s.dispatcher.observers.append(on_event)
    wait = ("w = dist.all_reduce(torch.ones(1), async_op=True)\nwhile not w.is_completed():\n    time.sleep(0.01)\n"
            if like_nccl else "dist.all_reduce(torch.ones(1))\n")
    code = ("import os, time, torch\nimport torch.distributed as dist\n"
            f"while rank == 1 and not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n" + wait)
    t0 = time.monotonic()
    try:
        s.execute(code, hang_after=2)
    finally:
        s.dispatcher.observers.remove(on_event)
    return seen[0] - t0 - 2.0


def stopped(tmp: Path) -> tuple[float, float]:
    s = fsdp_nb.Session(2, backend="gloo", activate=False)
    try:
        s.execute("import torch\nimport torch.distributed as dist")
        victim = psutil.Process(s.ranks[1].pid)
        marker = tmp / "looping"

        def stop() -> None:
            while not marker.exists():
                time.sleep(0.02)
            victim.suspend()

        threading.Thread(target=stop, daemon=True).start()
        code = (f"if rank == 1:\n    open({str(marker)!r}, 'w').close()\n"
                "for _ in range(10 ** 9):\n    dist.all_reduce(torch.ones(1))\n")
        t0 = time.monotonic()
        try:
            s.execute(code, timeout=10)
        except RankTimeoutError as err:
            assert err.diagnosis[0] == "rank 1 is not responding (process stopped)", err.diagnosis
        t_err = time.monotonic()
        s.all_reduce_check()
        return t_err - t0, time.monotonic() - t_err
    finally:
        s.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out: dict[str, float] = cost(args.rounds, args.steps) if args.rounds else {}
    out.update(per_collective())
    with tempfile.TemporaryDirectory() as d:
        s = fsdp_nb.Session(2, backend="gloo", activate=False)
        try:
            out["straggler: diagnosis shown, s after hang_after"] = straggler(s, Path(d))
        finally:
            s.shutdown()
        s = _session(False)  # no recorder: the counts tell it, as on NCCL
        try:
            out["straggler as on NCCL (counts): diagnosis shown, s after hang_after"] = straggler(
                s, Path(d), like_nccl=True)
        finally:
            s.shutdown()
        err, usable = stopped(Path(d))
    out["stopped rank, timeout=10: s to the error"] = err
    out["stopped rank: then s to a usable session"] = usable
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v:10.3f}")
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "hangs.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
