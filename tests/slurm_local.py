"""A one-node Slurm cluster on loopback for tests: munged, slurmctld, slurmd.

Everything lives in a temporary folder (config, munge key and socket, state and
spool dirs, logs); ``SLURM_CONF`` points the client commands (sbatch, squeue,
scancel) at it. Teardown order matters and runs on failure too: cancel our jobs,
wait for the queue to empty, ``scontrol shutdown``, then stop munged.

Needs root and Debian's ``slurm-wlm`` and ``munge`` packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LocalSlurm", "missing_requirements"]

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "srun")


def missing_requirements() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd, munged)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install -y slurm-wlm munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """Start with ``with LocalSlurm() as slurm:``; ``slurm.env`` has SLURM_CONF."""

    def __init__(self, cpus: int = 8):
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="fsdp_nb_slurm_"))
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- start ---------------------------------------------------------------------

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(mode=0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        node = socket.gethostname()
        self.conf.write_text(
            f"""ClusterName=fsdpnb
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self, timeout: float = 60.0) -> None:
        """munged, slurmctld, slurmd; wait until the node is idle."""
        self._write_conf()
        m = self.dir / "munge"
        self._daemon("munged", [
            "munged", "--foreground", "--force", f"--key-file={m}/munge.key",
            f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
            f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log",
        ])
        self._wait(lambda: (m / "munge.socket").exists(), 15, "munged socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, "the Slurm node to become idle")

    def _node_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.logs()}")
        r = self.run("sinfo", "-h", "-o", "%t", check=False)
        return r.returncode == 0 and r.stdout.strip() in ("idle", "mix", "alloc")

    def _wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    # -- use -----------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()}")
        return r

    def queue(self) -> list[str]:
        """Job ids in the queue."""
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    def logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        """scancel, wait for an empty queue, scontrol shutdown, then munged."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            for job in self.queue():
                self.run("scancel", job, check=False)
            deadline = time.monotonic() + 30
            while self.queue() and time.monotonic() < deadline:
                time.sleep(0.3)
            self.run("scontrol", "shutdown", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            try:
                p.wait(15 if name != "munged" else 0.1)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
