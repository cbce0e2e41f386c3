"""Several "hosts" on one machine: network namespaces on a private bridge.

Each host is a network namespace joined to a bridge in the root namespace by a veth
pair, with a private 10.x address and its own hostname (``unshare --uts``), so
engines there see a different ``gethostname()`` and can reach one another only
through the bridge. The controller listens on the bridge address in the root
namespace. Everything is torn down by ``NetnsHosts.close()``: the processes this
object started (by pid), the namespaces, the bridge.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NetnsHosts", "missing_requirements"]

SUBNET = "10.77.{net}.{host}"


def missing_requirements() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    probe = f"fnbp{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


REGISTRATION_TIMEOUT = 30
"""Seconds an engine waits for the controller's answer to its registration (ipyparallel's
default, 5, once ran out on a loaded 2-core machine in the full suite)."""


@dataclass
class Host:
    """One namespace host."""

    name: str
    """Its hostname inside the namespace."""
    ns: str
    """The network namespace name."""
    addr: str
    """Its address on the bridge."""
    ifname: str
    """The veth end inside the namespace."""


@dataclass
class NetnsHosts:
    """A bridge plus ``n_hosts`` namespace hosts; a context manager."""

    n_hosts: int = 2
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    net: int = field(default_factory=lambda: 100 + secrets.randbelow(100))
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    workdir: Path | None = None
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"fnbbr{self.tag}"

    @property
    def bridge_addr(self) -> str:
        """The controller's address (root namespace, on the bridge)."""
        return SUBNET.format(net=self.net, host=1)

    def __enter__(self) -> NetnsHosts:
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        """Make the bridge and the namespaces, each with a veth on the bridge."""
        import tempfile

        self.workdir = Path(tempfile.mkdtemp(prefix="fsdp_nb_netns_"))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n_hosts):
            letter = chr(ord("a") + i)
            ns, outer, inner = f"fnb-{self.tag}-{letter}", f"fnb{self.tag}{letter}0", f"veth{letter}"
            host = Host(
                name=f"host-{letter}", ns=ns, addr=SUBNET.format(net=self.net, host=11 + i),
                ifname=inner,
            )
            _ip("netns", "add", ns)
            self.hosts.append(host)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            self._links.append(outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{host.addr}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)

    # -- processes -----------------------------------------------------------------

    def _spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        assert self.workdir is not None
        out = open(self.workdir / log, "wb")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        out.close()
        self.procs.append(p)
        return p

    def start_controller(self, listen: str = "0.0.0.0", timeout: float = 60.0) -> tuple[Path, Path]:
        """``ipcontroller`` in the root namespace, reachable at the bridge address.

        By default it listens on all interfaces with ``--location`` the bridge
        address, as on a real cluster: the notebook's client then sees 127.0.0.1
        while the engines reach the 10.x address. Returns (client connection file,
        engine connection file).
        """
        assert self.workdir is not None
        profile = self.workdir / "profile"
        self._spawn(
            [sys.executable, "-m", "ipyparallel.controller", f"--ip={listen}",
             f"--location={self.bridge_addr}",
             f"--profile-dir={profile}", "--log-level=WARN"],
            "controller.log",
        )
        sec = profile / "security"
        client, engine = sec / "ipcontroller-client.json", sec / "ipcontroller-engine.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[-1].poll() is not None:
                raise RuntimeError("ipcontroller exited:\n" + self.log("controller.log"))
            if client.exists() and engine.exists():
                try:
                    json.loads(client.read_text())
                    json.loads(engine.read_text())
                    return client, engine
                except ValueError:
                    pass
            time.sleep(0.1)
        raise TimeoutError("ipcontroller wrote no connection files:\n" + self.log("controller.log"))

    def start_engine(self, host: Host, engine_file: Path, env: dict[str, str] | None = None) -> int:
        """One ``ipengine`` inside ``host``'s namespace under its own hostname; its pid.

        ``ip netns exec``, ``unshare`` and ``sh`` all exec, so the pid is the engine's.
        """
        shell = (f'hostname {host.name} && exec "$0" -m ipyparallel.engine --file="$1" --log-level=WARN'
                 f" --timeout={REGISTRATION_TIMEOUT}")
        argv = ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c", shell,
                sys.executable, str(engine_file)]
        p = self._spawn(argv, f"engine-{host.name}-{len(self.procs)}.log", env)
        return p.pid

    def start_engine_here(self, engine_file: Path, location: str) -> int:
        """One ``ipengine`` in the root namespace (the controller's host) that reaches the
        controller at ``location``; its pid."""
        argv = [sys.executable, "-m", "ipyparallel.engine", f"--file={engine_file}",
                f"--location={location}", "--log-level=WARN", f"--timeout={REGISTRATION_TIMEOUT}"]
        return self._spawn(argv, f"engine-here-{len(self.procs)}.log").pid

    def log(self, name: str) -> str:
        assert self.workdir is not None
        try:
            return (self.workdir / name).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def logs(self) -> str:
        """Every log this object's processes wrote (for failure messages)."""
        if self.workdir is None:
            return ""
        return "\n".join(f"--- {p.name}\n{self.log(p.name)}" for p in sorted(self.workdir.glob("*.log")))

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        """Stop our processes (by pid), delete namespaces, veths and the bridge."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        self.hosts.clear()
        for link in reversed(self._links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._links.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
