"""A real IPython kernel driven through jupyter_client, for tests of a session and its kernel."""

from __future__ import annotations

import ast
import os

import pytest
from jupyter_client.manager import KernelManager

START_S = 180
"""A kernel cell that starts a session gets this long."""


class Kernel:
    """A real IPython kernel and a blocking client; ``run`` returns a cell's stdout."""

    def __init__(self, ipythondir: str):
        env = dict(os.environ, IPYTHONDIR=ipythondir, OMP_NUM_THREADS="1")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def run(self, code: str, timeout: float = 120, answers: list[str] | None = None) -> str:
        """Run ``code``; its stdout (stderr too). A cell that raises fails the test
        with the kernel's traceback. ``answers`` reply to ``input()`` prompts in order."""
        out: list[str] = []
        errors: list[str] = []
        pending = list(answers or [])

        def on_output(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                errors.append("\n".join(content["traceback"]))

        def on_stdin(msg):
            out.append(msg["content"]["prompt"])
            self.kc.input(pending.pop(0) if pending else "q")

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=on_output, stdin_hook=on_stdin,
            allow_stdin=answers is not None,
        )
        if reply["content"]["status"] != "ok":
            pytest.fail(f"kernel cell failed:\n{code}\n{''.join(out)}\n" + "\n".join(errors))
        return "".join(out)

    def value(self, expr: str) -> object:
        """A Python literal computed in the kernel."""
        return ast.literal_eval(self.run(f"print(repr(({expr})))").strip().splitlines()[-1])

    def restart(self) -> None:
        """Kill the kernel process and start a new one (as Jupyter's restart does)."""
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
