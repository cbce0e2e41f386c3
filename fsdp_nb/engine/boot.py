"""An engine process that imports torch while the controller starts.

``python -m fsdp_nb.engine.boot [ipengine arguments]`` is what local sessions launch
instead of ``python -m ipyparallel.engine``: torch (seconds of imports) loads first,
at the same time as the controller comes up, then ipyparallel's engine starts and
waits for the controller's connection file (up to ``FSDP_NB_ENGINE_WAIT`` seconds,
default 120, not ipyparallel's 5), so no engine waits for the controller before its
imports, nor the group for the engines' imports.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    import torch  # noqa: F401 - the point: loaded before registration
    import torch.distributed  # noqa: F401

    wait = os.environ.get("FSDP_NB_ENGINE_WAIT", "120")
    if not any(a.startswith("--IPEngine.wait_for_url_file") for a in sys.argv):
        sys.argv.append(f"--IPEngine.wait_for_url_file={wait}")
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    main()
