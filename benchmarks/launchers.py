"""Time to a ready session for each launcher, side by side in one run.

"Ready" means: engines registered, probed, ordered, and the gloo process group
formed (the moment ``Session(...)`` / ``Session.connect(...)`` returns), then one
all_reduce checked. Launchers:

- local   ``Session(2)`` (the baseline)
- netns   two network-namespace hosts: controller + one ipengine per host started
          outside the notebook, then ``Session.connect`` (total, and connect alone)
- mpi     ``Session(2, launcher="mpi", mpi_args=[...])`` through Open MPI
- slurm   ``Session(2, launcher="slurm")`` against a one-node Slurm on loopback
          (daemon start-up reported separately)

Needs root, Open MPI + mpi4py, slurm-wlm + munge for the last three (skipped
otherwise). Usage: ``PYTHONPATH=. python benchmarks/launchers.py [--repeat N]``.
Writes benchmarks/out/launchers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_ipython_"))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import netns_hosts  # noqa: E402
import slurm_local  # noqa: E402

import fsdp_nb  # noqa: E402

N = 2


def _ready(make) -> dict[str, float]:
    t0 = time.perf_counter()
    sess = make()
    ready = time.perf_counter() - t0
    try:
        assert sess.all_reduce_check() == sum(range(sess.world_size))
    finally:
        t1 = time.perf_counter()
        sess.shutdown()
        stop = time.perf_counter() - t1
    return {"ready_s": ready, "shutdown_s": stop}


def bench_local() -> dict[str, float]:
    return _ready(lambda: fsdp_nb.Session(N, backend="gloo", activate=False))


def bench_netns() -> dict[str, float]:
    with netns_hosts.NetnsHosts(n_hosts=N) as hosts:
        t0 = time.perf_counter()
        client, engine = hosts.start_controller()
        for host in hosts.hosts:
            hosts.start_engine(host, engine)
        t1 = time.perf_counter()
        holder = {}

        def make():
            holder["t"] = time.perf_counter()
            return fsdp_nb.Session.connect(str(client), n=N, timeout=120, activate=False)

        out = _ready(make)
        # connect alone includes waiting for the engines to register
        out["connect_s"] = out["ready_s"]
        out["ready_s"] = out["ready_s"] + (holder["t"] - t0)
        out["processes_started_s"] = t1 - t0
        return out


def bench_mpi() -> dict[str, float]:
    return _ready(lambda: fsdp_nb.Session(
        N, launcher="mpi", mpi_args=["--allow-run-as-root", "--oversubscribe"],
        timeout=120, activate=False,
    ))


def bench_slurm() -> dict[str, float]:
    t0 = time.perf_counter()
    with slurm_local.LocalSlurm() as slurm:
        daemons = time.perf_counter() - t0
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(slurm.conf)
        try:
            out = _ready(lambda: fsdp_nb.Session(N, launcher="slurm", timeout=120, activate=False))
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
    out["slurm_daemons_s"] = daemons
    return out


def _skip_reason(name: str) -> str | None:
    import importlib.util
    import shutil

    if name == "netns":
        return netns_hosts.missing_requirements()
    if name == "mpi":
        if os.geteuid() != 0:
            return "needs root (--allow-run-as-root)"
        if shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None:
            return "needs openmpi-bin and mpi4py"
    if name == "slurm":
        return slurm_local.missing_requirements()
    return None


BENCHES = {"local": bench_local, "netns": bench_netns, "mpi": bench_mpi, "slurm": bench_slurm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", nargs="*", choices=list(BENCHES), default=list(BENCHES))
    args = ap.parse_args()
    results: dict[str, dict] = {}
    for name in args.only:
        reason = _skip_reason(name)
        if reason:
            results[name] = {"skipped": reason}
            continue
        runs = [BENCHES[name]() for _ in range(args.repeat)]
        keys = runs[0].keys()
        results[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        results[name]["runs"] = runs
    print(f"time to a ready {N}-rank gloo session (median of {args.repeat}; "
          f"{os.cpu_count()} cores, {platform.machine()})")
    print(f"{'launcher':<9}{'ready s':>9}{'shutdown s':>12}  notes")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<9}{'-':>9}{'-':>12}  skipped: {r['skipped']}")
            continue
        notes = []
        if "connect_s" in r:
            notes.append(f"Session.connect alone {r['connect_s']:.1f} s; "
                         f"controller+engines spawned in {r['processes_started_s']:.2f} s")
        if "slurm_daemons_s" in r:
            notes.append(f"munged+slurmctld+slurmd up in {r['slurm_daemons_s']:.1f} s (not counted)")
        print(f"{name:<9}{r['ready_s']:>9.1f}{r['shutdown_s']:>12.1f}  {'; '.join(notes)}")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "launchers.json").write_text(json.dumps(
        {"n": N, "repeat": args.repeat, "cpus": os.cpu_count(), "results": results}, indent=2))
    print(f"wrote {out / 'launchers.json'}")


if __name__ == "__main__":
    main()
