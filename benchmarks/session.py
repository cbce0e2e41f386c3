"""Session benchmarks, side by side with torchrun in one run.

- time to a ready session (engines up, process group formed) vs torchrun's time from
  launch to its first collective, same N: medians of ``--ready-reps`` + 1 starts
  each, alternating which goes first;
- per call, p50, interleaved call by call on the same engines: ``sess.execute("pass")``
  vs ipyparallel's own ``view.execute``; ``sess.run(int)`` (the direct call channel)
  vs ``view.apply_sync(int)``; and ``sess.run`` with the channel off (the ipyparallel
  path) vs ``view.apply_sync`` again; at N = 2 and 8;
- the phases of the session start (``Session.start_phases``);
- ``restart(restore=)`` after kill -9 of rank 0 vs the sum of its parts measured on
  the same session: one more engine started and registered, ``restart()`` of a
  healthy session (the group re-formed), a second ``wrap`` of the model, a ``load``
  (target <= 1.0), with the restart's own phases (``Session.restart_phases``): with
  the session's standby engine taking the dead rank's place (the default), and
  without one, called at once and called once the engine launched at the death has
  registered (as when the error is read before the restart);
- what signing costs the direct channel: one ``signing.Link`` signature and one check
  of a call-sized message (p50, microseconds), beside the call it is part of;
- with ``--train``: training throughput of the same FSDP2 loop
  (benchmarks/_train_loop.py) in a session cell vs under torchrun (target >= 0.98).

    python benchmarks/session.py [--sizes 2 8] [--repeats 100] [--steps 20] [--train] [--ready-reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"


RESTARTS = ("restart_restore", "restart_no_standby", "restart_after_replacement_up")
"""The three restarts ``bench_restart`` times: keys of its results (``_s``, ``_ratio``...)."""


def torchrun(n: int, mode: str, extra: list[str]) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
         str(HERE / "_torchrun_worker.py"), mode, out, *extra],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    res = json.loads(Path(out).read_text())
    res["to_first_collective_s"] = res["first_collective_unix"] - t0
    os.unlink(out)
    return res


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def p50_pair(ours, theirs, repeats: int) -> tuple[float, float]:
    """Median ms of ``ours()`` and ``theirs()``, interleaved call by call."""
    a, b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ours()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        theirs()
        b.append(time.perf_counter() - t)
    return percentile(a, 50) * 1e3, percentile(b, 50) * 1e3


def small_model():
    """The model the restart measurement wraps, saves and restores (33 MB of fp32)."""
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_restart(sess, folder: str) -> dict:
    """``restart(restore=)`` of a killed rank 0 against its parts, each timed alone."""
    import fsdp_nb
    from fsdp_nb.runtime.cluster import wait_until

    sess.wrap(small_model, name="warm_model")  # first-wrap imports, on every rank
    res: dict = {}
    res["wrap_s"], model = timed(lambda: sess.wrap(small_model, name="restart_model"))
    path = os.path.join(folder, "restart_ck")
    sess.save(path, model)
    res["load_s"], _ = timed(lambda: sess.load(path, model))
    res["rejoin_s"], _ = timed(sess.restart)
    cluster, client = sess.cluster.cluster, sess.cluster.client

    def one_engine() -> str:
        want = len(client.ids) + 1
        esid = cluster.start_engines_sync(n=1)
        client.wait_for_engines(want, timeout=120, interactive=False)
        return esid

    res["one_engine_s"], esid = timed(one_engine)
    cluster.stop_engines_sync(esid)
    res["restart_parts_s"] = res["one_engine_s"] + res["rejoin_s"] + res["wrap_s"] + res["load_s"]

    def kill_rank_0() -> float:
        os.kill(sess.ranks[0].pid, signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            sess.all_reduce_check()
        except fsdp_nb.DeadRankError:
            pass
        return t0

    def restart(key: str, **kwargs) -> None:
        res[key + "_s"], _ = timed(lambda: sess.restart(restore=path, **kwargs))
        res[key + "_phases"] = dict(sess.restart_phases)
        res[key + "_ratio"] = res[key + "_s"] / res["restart_parts_s"]

    # the default: the standby engine (its imports done) takes the dead rank's place
    standby = sess.cluster.standby
    if standby is None or not wait_until(standby.waiting, 120):
        raise TimeoutError("the session's standby engine is not waiting")
    kill_rank_0()
    restart("restart_restore", drop=["warm_model"])
    res["restart_took_standby"] = sess.ranks[0].pid == standby.pid
    # without a standby: the engine started at the death, restart() called at once...
    sess.cluster.wants_standby = False
    cluster.stop_engines_sync(sess.cluster.standby.engine_set)
    sess.cluster.standby = None
    kill_rank_0()
    restart("restart_no_standby")
    # ...and called once that engine has registered (as after reading the error)
    before = set(client.ids)
    t0 = kill_rank_0()
    if not wait_until(lambda: set(client.ids) - before, 120):
        raise TimeoutError("the replacement engine launched at the death did not register")
    res["replacement_up_after_error_s"] = time.perf_counter() - t0
    restart("restart_after_replacement_up")
    return res


def signing_us(repeats: int = 20000) -> dict:
    """p50 microseconds to sign and to check a call-sized message (a 24-byte head and a
    300-byte pickled call), as the notebook and each engine do once per call and reply."""
    import os as _os

    from fsdp_nb.engine.signing import Link, new_nonce

    key, nonce = _os.urandom(32), new_nonce()
    client, server = Link(key, "call", nonce, "client"), Link(key, "call", nonce, "server")
    frames = [b"h" * 24, _os.urandom(300)]
    sign, check, signed = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        signed.append(client.sign(frames))
        sign.append(time.perf_counter() - t)
    for msg in signed:
        t = time.perf_counter()
        server.check(msg)
        check.append(time.perf_counter() - t)
    return {"sign_p50_us": statistics.median(sign) * 1e6, "check_p50_us": statistics.median(check) * 1e6}


def ready_samples(n: int, reps: int) -> tuple[list[float], list[float]]:
    """``reps`` more session starts (each shut down) and torchrun starts, alternating
    which goes first: the start of one sample is what a busy host varies most."""
    import fsdp_nb

    ours, theirs = [], []

    def session() -> None:
        t0 = time.perf_counter()
        s = fsdp_nb.Session(n, backend="gloo", activate=False)
        ours.append(time.perf_counter() - t0)
        s.shutdown()

    def torchrun_start() -> None:
        theirs.append(torchrun(n, "start", [])["to_first_collective_s"])

    for i in range(reps):
        for turn in (session, torchrun_start) if i % 2 else (torchrun_start, session):
            turn()
    return ours, theirs


def bench_size(n: int, repeats: int, steps: int, train: bool, ready_reps: int) -> dict:
    import fsdp_nb

    ready_s, torchrun_s = ready_samples(n, ready_reps)
    t0 = time.perf_counter()
    sess = fsdp_nb.Session(n, backend="gloo", activate=False)
    ready_s.append(time.perf_counter() - t0)
    res: dict = {"n": n, "session_ready_samples_s": ready_s, "phases": dict(sess.start_phases)}
    try:
        view = sess.view()
        view.block = True
        sess.run(int)  # the direct channel's sockets
        res["execute_p50_ms"], res["ipyparallel_execute_p50_ms"] = p50_pair(
            lambda: sess.execute("pass"), lambda: view.execute("pass", block=True), repeats)
        res["run_p50_ms"], res["ipyparallel_apply_p50_ms"] = p50_pair(
            lambda: sess.run(int), lambda: view.apply_sync(int), repeats)
        sess.context.channel.enabled = False
        res["run_via_ipyparallel_p50_ms"], res["ipyparallel_apply_p50_ms_2"] = p50_pair(
            lambda: sess.run(int), lambda: view.apply_sync(int), repeats)
        sess.context.channel.enabled = True
        if train:
            sess.execute((HERE / "_train_loop.py").read_text())
            out = sess.run(lambda s: bench_train(s), steps)  # noqa: F821 - defined on engines
            res["session_tokens_per_s_per_rank"] = statistics.mean(t[1] for t in out)
        with tempfile.TemporaryDirectory(prefix="fsdp_nb_bench_restart_") as folder:
            res.update(bench_restart(sess, folder))
    finally:
        sess.shutdown()
    torchrun_s.append(torchrun(n, "start", [])["to_first_collective_s"])
    res["torchrun_first_collective_samples_s"] = torchrun_s
    res["session_ready_s"] = statistics.median(ready_s)
    res["torchrun_first_collective_s"] = statistics.median(torchrun_s)
    res["ready_ratio"] = res["session_ready_s"] / res["torchrun_first_collective_s"]
    res["execute_ratio"] = res["execute_p50_ms"] / res["ipyparallel_execute_p50_ms"]
    res["run_ratio"] = res["run_p50_ms"] / res["ipyparallel_apply_p50_ms"]
    res["run_via_ipyparallel_ratio"] = res["run_via_ipyparallel_p50_ms"] / res["ipyparallel_apply_p50_ms_2"]
    if train:
        tr = torchrun(n, "train", [str(steps)])
        res["torchrun_tokens_per_s_per_rank"] = tr["tokens_per_s"]
        res["throughput_ratio"] = res["session_tokens_per_s_per_rank"] / tr["tokens_per_s"]
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8])
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--train", action="store_true", help="also compare training throughput")
    p.add_argument("--ready-reps", type=int, default=2,
                   help="extra session and torchrun starts, alternating (medians of these + 1)")
    a = p.parse_args(argv)
    rows = [bench_size(n, a.repeats, a.steps, a.train, a.ready_reps) for n in a.sizes]
    hdr = ("N", "ready s", "torchrun s", "ratio", "exec ms", "ipp exec ms", "ratio",
           "run ms (direct)", "ipp apply ms", "ratio", "run via ipp ms", "ratio")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join([
            str(r["n"]), f"{r['session_ready_s']:.2f}", f"{r['torchrun_first_collective_s']:.2f}",
            f"{r['ready_ratio']:.2f}", f"{r['execute_p50_ms']:.2f}", f"{r['ipyparallel_execute_p50_ms']:.2f}",
            f"{r['execute_ratio']:.2f}", f"{r['run_p50_ms']:.2f}", f"{r['ipyparallel_apply_p50_ms']:.2f}",
            f"{r['run_ratio']:.2f}", f"{r['run_via_ipyparallel_p50_ms']:.2f}",
            f"{r['run_via_ipyparallel_ratio']:.2f}",
        ]))
        if "throughput_ratio" in r:
            print(f"  training: {r['session_tokens_per_s_per_rank']:.0f} vs torchrun "
                  f"{r['torchrun_tokens_per_s_per_rank']:.0f} tok/s/rank ({r['throughput_ratio']:.3f})")
    print("\nrestart(restore=) after kill -9 of rank 0 vs its parts (s):")
    print("  N | parts (one engine + rejoin + wrap + load) | with the standby | ratio "
          "| no standby, at once | ratio | no standby, once the replacement is up | ratio")
    for r in rows:
        parts = " + ".join(f"{r[k]:.2f}" for k in ("one_engine_s", "rejoin_s", "wrap_s", "load_s"))
        print(f"  {r['n']} | {parts} = {r['restart_parts_s']:.2f} | " + " | ".join(
            f"{r[k + '_s']:.2f} | {r[k + '_ratio']:.2f}" for k in RESTARTS))
    for r in rows:
        print(f"  N={r['n']}: the standby took rank 0: {r['restart_took_standby']}; the replacement "
              f"was up {r['replacement_up_after_error_s']:.2f} s after the error")
        for k in RESTARTS:
            print(f"    {k} phases: " + ", ".join(f"{p} {v:.2f}" for p, v in r[k + "_phases"].items()))
    sig = signing_us()
    for r in rows:
        r.update(sig)
    print(f"\nsigning a call-sized message: {sig['sign_p50_us']:.1f} us, checking it "
          f"{sig['check_p50_us']:.1f} us (p50; twice each per call and rank, against "
          f"{rows[0]['run_p50_ms'] * 1000:.0f} us for the whole call at N={rows[0]['n']})")
    print("\nsession start phases (s):")
    names = list(rows[0]["phases"])
    print("  " + " | ".join(["phase", *(f"N={r['n']}" for r in rows)]))
    for name in names:
        print("  " + " | ".join([name, *(f"{r['phases'].get(name, 0):.2f}" for r in rows)]))
    OUT.mkdir(exist_ok=True)
    (OUT / "session.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
