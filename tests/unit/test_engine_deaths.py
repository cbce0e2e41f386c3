"""How a dead engine is explained: its output's tail and the line for each way it ended."""

from __future__ import annotations

import signal
import subprocess
import sys

from fsdp_nb.recovery.engine_deaths import lines_for_exit
from fsdp_nb.runtime.engine_exits import EngineExit, last_words

LOG = """\
2026-11-27 12:33:42.143 [IPEngine] Loading connection file '/x/ipcontroller-engine.json'
2026-11-27 12:33:42.156 [IPEngine] Registering with controller at tcp://127.0.0.1:45335
2026-11-27 12:33:42.630 [IPEngine.1] Starting to monitor the heartbeat signal from the hub every 700 ms.
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 144 vs 4

2026-11-27 12:33:44.033 [IPEngine.1] WARNING | No heartbeat in the last 700 ms (1 time(s) in a row).
2026-11-27 12:33:44.787 [IPEngine.1] CRITICAL | received signal 15, stopping
"""


def test_last_words_keep_what_the_engine_wrote_and_drop_ipyparallels_routine_lines():
    assert last_words(LOG) == [
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 144 vs 4",
        "2026-11-27 12:33:44.787 [IPEngine.1] CRITICAL | received signal 15, stopping",
    ]
    assert last_words(LOG, limit=1) == ["2026-11-27 12:33:44.787 [IPEngine.1] CRITICAL | received signal 15, stopping"]
    assert last_words("") == []
    many = "\n".join(f"line {i}" for i in range(40))
    assert last_words(many) == [f"line {i}" for i in range(28, 40)]


def test_each_way_an_engine_ends_has_its_own_line():
    words = ["Fatal Python error: Aborted"]
    aborted = lines_for_exit(1, EngineExit(-signal.SIGABRT, False, words))
    assert aborted == ["rank 1's engine was ended by SIGABRT (signal 6): it crashed or something signalled it; "
                       "the last it wrote:", "    Fatal Python error: Aborted"]
    assert lines_for_exit(0, EngineExit(3, False, [])) == ["rank 0's engine exited by itself with code 3"]
    assert lines_for_exit(2, EngineExit(-77, False, [])) == [
        "rank 2's engine was ended by an unnamed signal (signal 77): it crashed or something signalled it"]
    running = lines_for_exit(1, EngineExit(None, True, []))
    assert running == ["rank 1's engine process still runs, but the controller dropped it: its heartbeat went "
                       "unanswered (the process stopped, or starved of CPU); sess.restart() replaces it"]
    assert lines_for_exit(1, EngineExit(None, False, words))[0] == (
        "rank 1's engine ended (its exit code is unknown); the last it wrote:")
    assert lines_for_exit(1, EngineExit(None, False, [])) == []  # nothing known: nothing said
    assert EngineExit(-9, False, []).signal == signal.SIGKILL and EngineExit(0, False, []).signal is None


CRASH = """\
import faulthandler, os, threading, time
faulthandler.enable(all_threads=True)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
def all_reduce_step():
    os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n")
    os.abort()
all_reduce_step()
"""


def test_a_crash_is_quoted_from_faulthandlers_report_at_the_crashing_frame(tmp_path):
    """A real process that aborts as C++ does (its message, then SIGABRT) with faulthandler
    on, as engines run: the quote keeps the message, the fatal error and the crashing
    thread's own frame, not the other threads' stacks."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    words = last_words(proc.stderr)
    assert words[:3] == ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
                         "Fatal Python error: Aborted", words[2]] and words[2].startswith("Current thread")
    assert any(f'{script}", line 6 in all_reduce_step' in w for w in words), words
    assert not any("threading.py" in w for w in words), words  # the sleeping thread is left out
