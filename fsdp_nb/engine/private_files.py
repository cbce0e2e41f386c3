"""Files and folders only this user may read: records, logs, stack dumps.

Session records, watchdog logs and stack dumps name pids, addresses and cluster files,
and a stack dump shows the code a rank runs. fsdp_nb creates them 0600 in 0700
folders, and never through a link: on a shared node another user could otherwise
read them, or plant a link where one is about to be written and have fsdp_nb write
(or truncate) a file of the user's choosing. Used on both sides: the notebook
(records, logs) and the engines (their stack dump files).
"""

from __future__ import annotations

import os
import stat

__all__ = ["private_file", "private_folder"]


def private_folder(path: str) -> str:
    """Make ``path`` (and missing parents) a folder only this user may enter: 0700, owned
    by this user, not a link. One that exists with wider modes is narrowed; one that is a
    link or another user's raises ``PermissionError``. Returns ``path``."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} is not a folder of this user's (a link, or another user's): fsdp_nb keeps "
            "its records, logs and stack dumps only in folders of the user's own; remove it, "
            "or point fsdp_nb elsewhere (IPYTHONDIR, TMPDIR)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def private_file(path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """Open ``path`` with ``flags`` as a 0600 file, never through a link (``O_NOFOLLOW``);
    a file descriptor. An existing file is narrowed to 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd
