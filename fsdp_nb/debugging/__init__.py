"""Debugging ranks while they run: breakpoints in cells (``breakpoints``, its rank half
``rank_breakpoints``) and the collective check (``rank_collective_check``), armed per cell
(``cell_debug``, ``rank_cell_debug``)."""
