"""Checkpoint files written past the page cache: the bytes, the fallbacks, the errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from helpers import page_cache

from fsdp_nb.formats.direct_io import (
    ALIGN,
    BLOCK_BYTES,
    DirectFile,
    create,
    enabled,
    open_direct,
)
from fsdp_nb.formats.writeback import WrittenBackFile

pytestmark = pytest.mark.skipif(not enabled(), reason="no O_DIRECT here, or FSDP_NB_DIRECT_IO=0")


def _open(path) -> DirectFile:
    f = open_direct(str(path))
    if f is None:
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")
    return f


def test_a_direct_file_holds_every_byte_in_order_and_none_in_the_page_cache(tmp_path):
    """Writes of every size (tiny, across blocks, larger than several blocks) land in
    order; whole blocks never enter the page cache; fileno() first writes out all given
    so far (an fsync of it covers every byte), and writes after it still land."""
    rng = random.Random(0)
    data = rng.randbytes(3 * BLOCK_BYTES + 12_345)
    sizes = [1, 7, ALIGN - 8, ALIGN, 3 * ALIGN + 5, BLOCK_BYTES - 1, 2 * BLOCK_BYTES + 3]
    f = _open(tmp_path / "a")
    pos = 0
    while pos < len(data):
        n = min(rng.choice(sizes), len(data) - pos)
        assert f.write(memoryview(data)[pos:pos + n]) == n
        pos += n
    f.flush()  # a no-op: the partial block waits
    cached = page_cache(f._fd)  # before fileno(): only whole blocks were written
    fd = f.fileno()
    os.fsync(fd)
    assert os.path.getsize(tmp_path / "a") == len(data)
    f.write(b"after the fsync")
    f.close()
    assert (tmp_path / "a").read_bytes() == data + b"after the fsync"
    if cached is not None:
        assert cached[0] == 0, cached


def test_an_empty_file_and_one_of_whole_blocks(tmp_path):
    with _open(tmp_path / "empty"):
        pass
    assert (tmp_path / "empty").read_bytes() == b""
    data = os.urandom(2 * BLOCK_BYTES)
    with _open(tmp_path / "whole") as f:
        f.write(data)
    assert (tmp_path / "whole").read_bytes() == data


def test_direct_io_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_NB_DIRECT_IO", "0")
    assert not enabled()
    assert open_direct(str(tmp_path / "b")) is None
    assert not (tmp_path / "b").exists()
    with create(str(tmp_path / "b")) as f:  # a checkpoint file then goes through the cache
        assert isinstance(f, WrittenBackFile)
    monkeypatch.setenv("FSDP_NB_DIRECT_IO", "1")
    with create(str(tmp_path / "b")) as f:
        assert isinstance(f, DirectFile)


WRITE_PAST_LIMIT = """
import os, resource, signal, sys
from fsdp_nb.formats.direct_io import BLOCK_BYTES, open_direct
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2 * BLOCK_BYTES, 2 * BLOCK_BYTES))
f = open_direct(sys.argv[1])
try:
    for _ in range(6):
        f.write(bytes(BLOCK_BYTES))
    f.close()
except OSError as exc:
    print("raised", exc.errno, f.closed)
    f.close()  # after an error, close() still releases the file
    print("closed", f.closed)
"""


def test_a_failed_disk_write_reaches_the_writer(tmp_path):
    """A write the kernel refuses (here: past the file size limit), done by a helper
    thread, raises in the writer at its next write, and the file still closes."""
    out = subprocess.run([sys.executable, "-c", WRITE_PAST_LIMIT, str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import errno

    assert out.stdout.split() == ["raised", str(errno.EFBIG), "False", "closed", "True"], out.stdout


POOL_AFTER_FORK = """
import os
from fsdp_nb.formats.helper_threads import LazyPool
pool = LazyPool("fsdp_nb-test")
assert pool().submit(lambda: 1).result(timeout=10) == 1  # the parent's threads are up
pid = os.fork()
if pid == 0:
    try:
        ok = pool().submit(lambda: 2).result(timeout=10) == 2
    except Exception:
        ok = False
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_gets_helper_threads_of_its_own():
    """A child forked after a save (a DataLoader worker, say) inherits the pool but not
    its threads: a job it sends must still run, not wait forever."""
    out = subprocess.run([sys.executable, "-c", POOL_AFTER_FORK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0"], out.stdout + out.stderr


def test_helper_threads_keep_the_priority_of_the_thread_that_asks():
    """A background save (at a lower CPU priority) and a foreground one share no helper
    thread: a worker keeps its starter's priority, and could not raise it again."""
    from concurrent.futures import ThreadPoolExecutor

    from fsdp_nb.formats.helper_threads import LazyPool, lower_priority, priority

    pool, main = LazyPool("fsdp_nb-test-nice"), priority()

    def from_background() -> int:
        lower_priority(5)
        return pool().submit(priority).result(timeout=10)

    with ThreadPoolExecutor(1) as other:  # lowered for good: a thread of its own
        assert other.submit(from_background).result(timeout=10) == min(19, main + 5)
        assert pool().submit(priority).result(timeout=10) == main
        assert other.submit(lambda: pool().submit(priority).result(timeout=10)).result(timeout=10) == min(19, main + 5)
