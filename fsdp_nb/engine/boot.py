"""An engine process that imports torch while the controller starts.

``python -m fsdp_nb.engine.boot [ipengine arguments]`` is what local sessions launch
instead of ``python -m ipyparallel.engine``: torch (seconds of imports) loads first,
at the same time as the controller comes up, then ipyparallel's engine starts and
waits for the controller's connection file (up to ``FSDP_NB_ENGINE_WAIT`` seconds,
default 120, not ipyparallel's 5), so no engine waits for the controller before its
imports, nor the group for the engines' imports. It then waits 30 s, not ipyparallel's
5, for the controller's answer to its registration (5 s ran out on a loaded host). The controller fsdp_nb starts beats
faster than ipyparallel's (``launch_settings.HEARTBEAT_MS``); an engine still waits about
3 minutes for a silent controller before it quits, as with ipyparallel's period.

A standby engine (``STANDBY_ENV`` set; ``fsdp_nb.runtime.standby``) imports torch and
``PRELOAD``, then waits, unregistered, until its go file appears: it registers only
when it takes a dead rank's place, so a restart does not wait for a new process's
imports. It exits once the controller it was started for is gone.

Local engines run without ipyparallel's nanny (a second Python process per engine,
spawned before the engine can register: about a second of CPU each, most of it on
few cores). What it does is done here by pid: ``EngineCluster`` signals local engines
and checks their liveness itself, and the session's waits poll that liveness.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import signal
import sys
import time

from ..torch_compat import TORCH_PRELOAD

PRELOAD = (
    "fsdp_nb.engine.probe", "fsdp_nb.engine.process_group", "fsdp_nb.engine.health",
    "fsdp_nb.engine.call_channel", "torch.distributed.fsdp", "fsdp_nb.models.rank_wrap",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", *TORCH_PRELOAD,
)
"""What a rank imports to join the group and to wrap, save and load (seconds)."""
PRELOAD_ENV = "FSDP_NB_ENGINE_PRELOAD"
"""Set for engines that replace dead ranks (``EngineCluster.replace``) and for standby
engines: they import ``PRELOAD`` before they register, since a restart re-forms the
group and replays the wraps on them at once. Not in a thread during registration: the
restart's own imports would race it, and torch._dynamo's circular imports then fail
half-initialized in one of the two. Not for a session's first engines: on few cores
the imports slow the start, and a wrap may be minutes away."""


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the real import raises it again, in context
            logging.getLogger("fsdp_nb").debug("preloading %s failed: %s", name, exc)


STANDBY_ENV = "FSDP_NB_STANDBY"
"""The go file of a standby engine: it waits for that file before it starts the engine."""
WATCH_ENV = "FSDP_NB_STANDBY_WATCH"
"""The pid a standby engine outlives no longer than ``GO_POLL_S``: the controller's."""
WAITING = ".waiting"
"""Suffix of the file a standby engine keeps beside its go file while it waits."""
GO_POLL_S = 0.02
"""How often a standby engine looks for its go file (a stat; latency it adds to a restart)."""


def _stand_by(go_file: str, watch: int) -> bool:
    """Wait for ``go_file`` (True: it is removed, and the engine starts) or for ``watch``
    to exit (False). ``go_file + WAITING`` exists while it waits, imports done.
    SIGTERM while waiting (the launcher stopping it) exits cleanly."""
    import psutil

    from .process_handles import handle_alive

    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting = go_file + WAITING
    try:
        watched = psutil.Process(watch)
        open(waiting, "w").close()
        while not os.path.exists(go_file):
            if not handle_alive(watched):
                return False
            time.sleep(GO_POLL_S)
    except (psutil.NoSuchProcess, KeyboardInterrupt):
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
        for path in (waiting, go_file):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return True


def main() -> None:
    # a crash (SIGSEGV, SIGABRT from a C++ abort, ...) writes every thread's Python stack
    # to the engine's log, which the notebook quotes when it reports the death; through
    # a copy of the log's descriptor: the kernel later points fd 2 at a pipe its own
    # thread drains, which dies with the process
    faulthandler.enable(os.fdopen(os.dup(2), "w"), all_threads=True)
    import torch  # noqa: F401 - the point: loaded before registration
    import torch.distributed  # noqa: F401

    go_file = os.environ.get(STANDBY_ENV)
    defaults = {
        "wait_for_url_file": os.environ.get("FSDP_NB_ENGINE_WAIT", "120"),
        "max_heartbeat_misses": "260",  # checks every beat + 0.5 s: 0.7 s, so 3 minutes
        "enable_nanny": "False",  # see the module's docstring
        "timeout": "30",  # the controller's answer to registration: ipyparallel's 5 s ran out on a loaded host
    }
    for trait, value in defaults.items():
        if not any(a.startswith(f"--IPEngine.{trait}") for a in sys.argv):
            sys.argv.append(f"--IPEngine.{trait}={value}")
    from ipyparallel.engine.app import main as engine_main

    if go_file or os.environ.get(PRELOAD_ENV):
        _preload()
    if go_file and not _stand_by(go_file, int(os.environ.get(WATCH_ENV) or os.getppid())):
        return
    engine_main()


if __name__ == "__main__":
    main()
