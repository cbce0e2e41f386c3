"""Where checkpoints meet a store and the progress count, on real engines (issue 56): a
load from S3 (moto's server on loopback, whose GET bytes are counted) reads each stored
item once, and an async save's progress never shows more bytes written than its total.

Their pure halves are in ``tests/unit/test_formats_meets.py``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fsdp_nb
from fsdp_nb.checkpoints.async_saves import AsyncCheckpoint
from fsdp_nb.formats.storage import set_storage_options
from fsdp_nb.runtime.cluster import wait_until

BUILD = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

def meets_build(name, dim, layers=2):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    m = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))
    for b in m:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    globals()[name] = m
    globals()[name + "_opt"] = torch.optim.AdamW(m.parameters(), lr=1e-2)
    meets_step(name)

def meets_step(name):
    m, opt = globals()[name], globals()[name + "_opt"]
    m(torch.randn(4, m[0].in_features)).square().mean().backward()
    opt.step()
    opt.zero_grad()

def meets_weights(name):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(globals()[name], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
"""


class CountingS3:
    """moto's S3 server on loopback behind a WSGI layer that counts the bytes each GET
    sent, by object path (``/bucket/key``)."""

    def __init__(self, app: Any) -> None:
        self.app, self.lock = app, threading.Lock()
        self.sent: collections.Counter[str] = collections.Counter()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        body = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return body
        path = environ.get("PATH_INFO", "")

        def counted() -> Iterator[bytes]:
            try:
                for chunk in body:
                    with self.lock:
                        self.sent[path] += len(chunk)
                    yield chunk
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()

        return counted()

    def sent_for(self, suffix: str) -> int:
        """Bytes sent so far for objects whose path ends with ``suffix``."""
        with self.lock:
            return sum(n for p, n in self.sent.items() if p.endswith(suffix))


@pytest.fixture
def counted_s3() -> Iterator[tuple[str, CountingS3, Any]]:
    """(bucket URL, the byte counter, a boto3 client) of an S3 API on loopback; fsdp_nb's
    storage options for ``s3://`` point at it for the test."""
    import boto3
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    counter = CountingS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        set_storage_options("s3", key="testing", secret="testing", endpoint_url=endpoint,
                            client_kwargs={"region_name": "us-east-1"})
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="meets")
        yield "s3://meets", counter, client
    finally:
        set_storage_options("s3")
        server.shutdown()
        thread.join(timeout=30)


def test_an_s3_load_reads_each_stored_item_once(sess: fsdp_nb.Session, counted_s3, tmp_path):
    bucket, counter, client = counted_s3
    sess.execute(BUILD + "\nmeets_build('mt_s3', 512)\n")
    try:
        url = f"{bucket}/once/step1"
        sess.save(url, "mt_s3", optimizer="mt_s3_opt", extra={"step": 1})
        saved = sess.run(lambda: meets_weights("mt_s3"))[0]  # type: ignore[name-defined]  # noqa: F821 - engine global
        sess.execute("meets_step('mt_s3')")
        stored = sum(o["Size"] for o in client.list_objects_v2(Bucket="meets", Prefix="once/step1/")["Contents"]
                     if o["Key"].endswith(".distcp"))
        before = counter.sent_for(".distcp")
        assert sess.load(url, "mt_s3", optimizer="mt_s3_opt") == {"step": 1}
        sent = counter.sent_for(".distcp") - before
        # each rank reads its own shards' items, and the replicated ones (param groups,
        # step counts) another rank wrote: a few KB over the files' bytes, once each
        assert stored <= sent < stored * 1.05, f"{sent} bytes of items sent for {stored} stored"
        back = sess.run(lambda: meets_weights("mt_s3"))[0]  # type: ignore[name-defined]  # noqa: F821
        assert saved.keys() == back.keys() and all(saved[k].equal(back[k]) for k in saved)
        # read offline in one process (no second pass): each item once too, and the same weights
        before = counter.sent_for(".distcp")
        fsdp_nb.consolidate(url, str(tmp_path / "full.pt"))
        assert stored <= counter.sent_for(".distcp") - before < stored * 1.05
        full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
        assert all(saved[k].equal(full[k]) for k in saved)
    finally:
        sess.execute("del mt_s3, mt_s3_opt")


def test_an_async_saves_progress_never_shows_more_written_than_its_total(sess: fsdp_nb.Session, tmp_path):
    # many small tensors: each stored item's framing is a large share of the files' bytes
    sess.execute(BUILD + "\nmeets_build('mt_prog', 8, layers=12)\n")
    try:
        h = sess.save(str(tmp_path / "ck"), "mt_prog", optimizer="mt_prog_opt", async_save=True)
        assert isinstance(h, AsyncCheckpoint)
        seen = [h.progress()]

        def written() -> bool:  # each progress seen on the way
            seen.append(h.progress())
            return h.done()

        assert wait_until(written, timeout=120, interval=0.1)
        last = h.progress()  # written on every rank, not yet collected by the notebook
        for p in [*seen, last]:
            assert p.written <= p.total, f"{p.phase}: {p.written} bytes written of {p.total}"
        assert last.total > 0 and last.written == last.total
        assert h.wait().valid
    finally:
        sess.execute("del mt_prog, mt_prog_opt")


_ASKS = """
import torch

class AsksForMemory:
    def __reduce__(self):
        return (bytearray, ({count},))

mt_opt = torch.optim.AdamW(mt_m.parameters(), lr=0.1)
mt_m(torch.randn(4, 8)).sum().backward()
mt_opt.step()
mt_opt.zero_grad()
mt_opt.param_groups[0]["asks"] = AsksForMemory()
"""


def test_a_load_refuses_an_item_that_asks_for_memory_by_a_count(sess: fsdp_nb.Session, tmp_path):
    """torch's weights-only unpickler allows ``bytearray``: a param group's item of a few
    hundred bytes made every rank allocate what it said before the load went on."""
    from helpers import forget_models

    count = 256 << 20
    model = sess.wrap(torch.nn.Linear(8, 8), name="mt_m")
    try:
        sess.execute(_ASKS.format(count=count))
        path = tmp_path / "asks"
        sess.save(str(path), model, optimizer="mt_opt")  # the attacker's own save: a valid marker
        sess.execute("mt_opt.param_groups[0]['asks'] = None")
        before = [v.clone() for v in model.state_dict().values()]
        refused = (rf"item 'optim\.param_groups\.0\.asks' in file '__\d_0\.distcp' holds a pickle that asks for "
                   rf"memory by a count \(builtins\.bytearray\({count}\)\)")
        with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=refused):
            sess.load(str(path), model, optimizer="mt_opt")
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before))
        assert sess.run(lambda: mt_opt.param_groups[0]["asks"]) == [None, None]  # type: ignore[name-defined]  # noqa: F821
    finally:
        forget_models(sess, "mt_m", optimizers=("mt_opt",))
