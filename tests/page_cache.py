"""How much of a file the page cache holds, by Linux's ``cachestat`` (kernel 6.5+)."""

from __future__ import annotations

import ctypes


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


def page_cache(fd: int) -> tuple[int, int] | None:
    """(pages of file ``fd`` in the page cache, of which not yet handed to the disk);
    None where this kernel lacks the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    st = _Stat()
    if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) != 0:  # cachestat
        return None
    return st.cache, st.dirty
