"""How fsdp_nb launches an ipyparallel cluster: launcher names and their settings, the
engine command, the heartbeat, ipyparallel's log level.

Pure settings, decided before anything starts (``EngineCluster.start`` applies them):
``split_cluster_kwargs`` sorts ``Session(**cluster_kwargs)`` into ``ipyparallel.Cluster``
keywords and launcher config, so a wrong name is a clear error before any process
exists.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

if TYPE_CHECKING:
    from traitlets.config import LoggingConfigurable

__all__ = [
    "HEARTBEAT_MISSES", "HEARTBEAT_MS", "boot_with_torch", "engine_launcher_class",
    "ipp_log_level", "launcher_names", "prepare_batch_job", "quick_heartbeat",
    "split_cluster_kwargs",
]

log = logging.getLogger("fsdp_nb")

_RESERVED = {"n", "engines", "engine_launcher_class"}
"""Cluster arguments that Session sets itself (from ``n`` and ``launcher``)."""


def launcher_names() -> list[str]:
    """Engine launchers ipyparallel knows by name (``local``, ``mpi``, ``slurm``...)."""
    return sorted({e.name for e in entry_points(group="ipyparallel.engine_launchers")})


def engine_launcher_class(launcher: str) -> type[LoggingConfigurable]:
    """The ipyparallel engine-set launcher class named ``launcher`` (``"mpi"``, ``"slurm"``...)."""
    from ipyparallel.cluster.launcher import find_launcher_class

    return find_launcher_class(launcher, "engine")


def split_cluster_kwargs(launcher: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sort ``Session(**cluster_kwargs)`` into ``ipyparallel.Cluster`` arguments.

    ``Cluster`` takes its own traits (``controller_ip``, ``controller_args``,
    ``profile``, ``cluster_id``, ``delay``, ``config``...) as keywords, but an engine
    launcher's settings (``mpi_args``, ``mpi_cmd``, ``batch_template``, ``queue``,
    ``account``, ``timelimit``, ``options``, ``engine_args``, ``ssh_args``...) only as
    config traits (``c.MPIEngineSetLauncher.mpi_args``): those are moved into a
    traitlets ``Config`` under the launcher's class name. Anything else is a
    ``ValueError`` naming what each side accepts, raised before anything starts.

    Slurm's ``options`` (``"--gpus-per-task=1 --nodes=2"``) are checked here and put on
    ``sbatch``'s command line once the cluster's config is whole (``prepare_batch_job``).
    """
    from traitlets.config import Config

    out = dict(kwargs)
    bad = sorted(_RESERVED & set(out))
    if bad:
        raise ValueError(
            f"{', '.join(bad)} cannot be given as cluster settings: use Session(n, launcher=...)"
        )
    config = out.pop("config", None)
    config = copy.deepcopy(Config(config)) if config is not None else Config()  # never edit the caller's
    cls = engine_launcher_class(launcher)
    cluster_traits = set(ipp.Cluster.class_trait_names()) | {"controller", "parent"}
    launcher_traits = set(cls.class_traits(config=True))
    unknown = []
    for key in list(out):
        if key in cluster_traits:
            continue
        if key in launcher_traits:
            config[cls.__name__][key] = out.pop(key)
        else:
            unknown.append(key)
    if unknown:
        cluster_side = sorted(
            k for k, t in ipp.Cluster.class_traits(config=True).items() if not k.startswith("_")
        )
        raise ValueError(
            f"unknown setting(s) {', '.join(sorted(unknown))} for launcher {launcher!r}. "
            f"Cluster settings: {', '.join(cluster_side)}; {cls.__name__} settings: "
            f"{', '.join(sorted(launcher_traits))}"
        )
    if cls.__name__ in config:  # quoting checked before start (no empty section made)
        _sbatch_options(config[cls.__name__].get("options") or "")
    out["config"] = config
    return out


def _sbatch_options(options: str) -> list[str]:
    """``options`` split as a shell would, or a ``ValueError`` naming the setting."""
    try:
        return shlex.split(options)
    except ValueError as exc:
        raise ValueError(f"options={options!r} cannot be split as sbatch arguments: {exc}") from exc


def prepare_batch_job(cluster: ipp.Cluster, launcher: str) -> None:
    """Settle a batch launcher's job before it is submitted; other launchers are left alone.

    Called once ``cluster`` (an ``ipyparallel.Cluster`` not yet started) holds its whole
    config, the profile's ``ipcluster_config.py`` included; ``launcher`` names its engine
    launcher. Two things, each only where the user did not decide it already:

    - the job script is written into the profile's log folder (ipyparallel writes it
      relative to the current directory, i.e. into the notebook's folder) unless a
      ``batch_file_name`` is configured;
    - Slurm's ``options`` go on ``sbatch``'s command line, where they override the
      script's ``#SBATCH`` lines: ipyparallel puts them only where a template says
      ``{options}``, which its default script does not. A template (``batch_template``,
      else ``batch_template_file``) that places ``{options}`` itself keeps them there only.
    """
    from ipyparallel.cluster.launcher import BatchSystemLauncher, SlurmLauncher

    cls = engine_launcher_class(launcher)
    if not issubclass(cls, BatchSystemLauncher):
        return
    # the settings as the launcher will see them: its own section, its base classes' too
    job: Any = cls(parent=cluster, log=cluster.log, profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id)
    config = copy.deepcopy(cluster.config)  # never edit the IPython session's config
    section = config[cls.__name__]
    default = cls.class_traits()["batch_file_name"].default_value
    if job.batch_file_name == default:
        log_dir = os.path.join(cluster.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        section.batch_file_name = os.path.join(log_dir, f"{cluster.cluster_id}-{default}")
    options = job.options if issubclass(cls, SlurmLauncher) else ""
    if options and "{options}" not in _template_text(job):
        section.submit_command = [*job.submit_command, *_sbatch_options(options)]
        log.debug("Slurm options on sbatch's command line: %s", section.submit_command)
    cluster.config = config


def _template_text(job: Any) -> str:
    """The job script a batch launcher will fill in: its ``batch_template``, else the text
    of its ``batch_template_file``, else "" (ipyparallel's default, with no ``{options}``)."""
    if job.batch_template:
        return str(job.batch_template)
    if job.batch_template_file:
        with open(os.path.expanduser(str(job.batch_template_file))) as f:
            return f.read()
    return ""


def boot_with_torch(cluster: ipp.Cluster, overlap: bool) -> None:
    """Launch local engines as ``fsdp_nb.engine.boot`` (torch imported first) unless
    the user set an engine command; ``overlap``: start them with the controller, not
    once its connection files exist (they wait for the files themselves)."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher

    name = LocalEngineSetLauncher.__name__
    if "engine_cmd" in cluster.config.get(name, {}):
        return
    config = copy.deepcopy(cluster.config)  # never edit the IPython session's config
    config[name].engine_cmd = [sys.executable, "-m", "fsdp_nb.engine.boot"]
    cluster.config = config
    if overlap:
        cluster.send_engines_connection_env = False


HEARTBEAT_MS = 200
"""The controller's heartbeat period for clusters fsdp_nb starts (ipyparallel's: 3000).

The controller counts an engine as registered only on the beat after its heart first
answers: 1-2 periods after the engine connects (3-6 s with ipyparallel's period; at
200 ms a 2-rank session was ready 0.8 s sooner than at 500, median of 5 starts each)."""
HEARTBEAT_MISSES = 150
"""Beats an engine may miss before the controller drops it: 30 s, as ipyparallel's.
(Engines quit after 50 of their checks without a beat; local ones, started by
``fsdp_nb.engine.boot``, after 260: about 3 minutes, as with ipyparallel's period.)"""


def quick_heartbeat(cluster_kwargs: dict[str, Any]) -> None:
    """Add the heartbeat period and misses to ``controller_args`` unless the user set them."""
    args = list(cluster_kwargs.get("controller_args") or [])
    if not any(a.startswith("--HeartMonitor.") for a in args):
        args += [f"--HeartMonitor.period={HEARTBEAT_MS}",
                 f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]
    cluster_kwargs["controller_args"] = args


def ipp_log_level() -> int:
    """ipyparallel's log level for the clusters fsdp_nb starts: the ``fsdp_nb`` logger's
    when that is set to INFO or DEBUG (to see the launchers and engines), else ERROR.

    Not WARNING: at WARNING the launcher pastes every engine's whole log into the
    notebook whenever an engine exits non-zero, which stopping it (SIGTERM) counts as.
    ``cluster_kwargs={"log_level": ...}`` still overrides it.
    """
    level = logging.getLogger("fsdp_nb").getEffectiveLevel()
    return level if level <= logging.INFO else logging.ERROR
