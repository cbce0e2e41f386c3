"""Python stacks, read on either side: where library code lives (``library_dirs``), and a
faulthandler dump folded to the user's own frames (``fold_stacks``).

The ranks' hang watch names the user's innermost frame by them; the notebook folds the
dumps a rank's stack file holds (a hang's timeout, a dead engine's last words) by them.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig

__all__ = ["fold_stacks", "in_library", "is_cell_file", "library_dirs"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """Where library code lives: the standard library, site-packages and fsdp_nb itself
    (read once: 0.4 ms, most of a question before)."""
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fsdp_nb package
    return tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {here})



@functools.lru_cache(maxsize=4096)
def in_library(filename: str) -> bool:
    """Whether code of ``filename`` is library code (``library_dirs``, a frozen module or
    ``exec``'d text): what a rank's "where is the user" skips."""
    if filename.startswith(("<frozen", "<string>")):
        return True
    return os.path.realpath(filename).startswith(library_dirs())


def is_cell_file(filename: str) -> bool:
    """Whether ``filename`` is the code IPython made of a cell (``/tmp/ipykernel_<pid>/<n>.py``,
    ``<ipython-input-…>``)."""
    return "ipykernel_" in filename or filename.startswith(("<ipython-input", "<cell"))


def fold_stacks(dump: str, libs: tuple[str, ...] | None = None) -> str:
    """A faulthandler dump with each run of library frames (site-packages, the standard
    library, fsdp_nb: ``library_dirs``) folded into one line naming the packages, and the other threads folded
    into one line: what is left is where the user's code is."""
    libs = library_dirs() if libs is None else tuple(os.path.realpath(x) for x in libs)
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    if not blocks:
        return dump
    out: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            pkgs = sorted({_package(f, libs) for f in run})
            out.append(f"  … {len(run)} framework frame{'s' if len(run) > 1 else ''} ({', '.join(pkgs[:5])})")
            run.clear()

    for line in blocks[0].splitlines():
        m = _FRAME.match(line)
        if m and os.path.realpath(m["file"]).startswith(libs):
            run.append(m["file"])
            continue
        flush()
        out.append(line)
    flush()
    if len(blocks) > 1:
        out.append(f"  … {len(blocks) - 1} other thread{'s' if len(blocks) > 2 else ''} (framework)")
    return "\n".join(out) + "\n"


def _package(path: str, libs: tuple[str, ...]) -> str:
    real = os.path.realpath(path)
    for lib in libs:
        if real.startswith(lib + os.sep):
            rest = real[len(lib) + 1:]
            return rest.split(os.sep, 1)[0].removesuffix(".py")
    return os.path.basename(path)
