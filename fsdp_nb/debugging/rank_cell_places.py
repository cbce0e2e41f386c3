"""Where in the user's cells a rank is, in the notebook's own words: ``cell [12] line 4``.

IPython compiles each cell on an engine into a temporary file of its own
(``/tmp/ipykernel_<pid>/<hash>.py``) and numbers cells by the engine's count, which is
not the notebook's. The notebook sends its number of a cell it arms for debugging
(``set_cell_number``, from ``rank_cell_debug.arm``); the first stop or checked
collective in that cell ties the cell's file to it, so later cells calling its
functions name it too. A cell run without debugging options is "the running cell".
Read by the breakpoints (``rank_breakpoints``) and the collective check
(``rank_collective_check``).
"""

from __future__ import annotations

import inspect
import os
from types import FrameType

from ..engine.registry import Part, part
from ..engine.stacks import is_cell_file

__all__ = ["CellPlaces", "caller_frame", "cell_name", "set_cell_number", "stopped_at"]


class CellPlaces(Part):
    """The notebook's numbers of this engine's cells."""

    def __init__(self) -> None:
        self.cell_number: int | None = None
        """The notebook's number of the running cell (None: not told)."""
        self.cell_numbers: dict[str, int] = {}
        """A cell's code file on this engine -> the notebook's number of that cell, for each
        armed cell seen at a stop or a checked collective (later cells' functions keep it)."""


def set_cell_number(number: int | None) -> None:
    """The running cell's number in the notebook (None: the cell ended, or not told)."""
    part(CellPlaces).cell_number = number


def cell_name(filename: str, frame: FrameType | None = None) -> str | None:
    """``cell [12]`` for a cell's code file (the notebook's number of it, when a cell that
    ran it was armed); without a number ``the running cell`` or ``an earlier cell``;
    None for any other file.

    Args:
        filename: a frame's ``co_filename``.
        frame: the frame stopped in; its outermost cell frame is the running cell, which
            gets the armed cell's number.
    """
    if not is_cell_file(filename):
        return None
    places = part(CellPlaces)
    outer = None
    while frame is not None:
        if is_cell_file(frame.f_code.co_filename):
            outer = frame.f_code.co_filename
        frame = frame.f_back  # type: ignore[assignment]
    if places.cell_number is not None and outer is not None:
        places.cell_numbers[outer] = places.cell_number
    number = places.cell_numbers.get(filename)
    if number is not None:
        return f"cell [{number}]"
    return "the running cell" if filename == outer else "an earlier cell"


def stopped_at(frame: FrameType | None) -> str:
    """``cell [12] line 4`` for a frame of a cell (see ``cell_name``; ``line 4 of the
    running cell`` without its number), else ``file.py:12``."""
    if frame is None:
        return "an unknown place"
    filename, line = frame.f_code.co_filename, frame.f_lineno
    name = cell_name(filename, frame)
    if name is None:
        return f"{os.path.basename(filename)}:{line}"
    return f"{name} line {line}" if name.startswith("cell [") else f"line {line} of {name}"


def caller_frame(depth: int) -> FrameType | None:
    """The frame ``depth`` calls above the function calling this (0: that function's own)."""
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        frame = frame.f_back if frame is not None else None
    return frame
