"""Signed frames (``fsdp_nb.engine.signing``), with no engines: what a receiver takes and
what it drops before reading a byte of the payload."""

from __future__ import annotations

import logging
import os

import pytest

from fsdp_nb.engine.signing import AUTH_BYTES, HEADER_BYTES, Link, Refused, new_nonce

KEY = os.urandom(32)


def _pair(purpose: str = "call", key: bytes = KEY) -> tuple[Link, Link]:
    nonce = new_nonce()
    return Link(key, purpose, nonce, "client"), Link(key, purpose, nonce, "server")


def test_a_signed_message_is_taken_once_both_ways():
    client, server = _pair()
    assert server.check(client.sign([b"id", b"payload"])) == [b"id", b"payload"]
    assert client.check(server.sign([b"id", b"ok", b"result"])) == [b"id", b"ok", b"result"]
    assert server.unpack(client.pack(b"subscribe")) == b"subscribe"
    # frames arriving as buffers (zmq copy=False) are checked without a copy
    signed = client.sign([b"x", bytearray(b"y" * 1000)])
    assert server.check([memoryview(bytes(f)) for f in signed])[1].tobytes() == b"y" * 1000


@pytest.mark.parametrize("change", [
    "payload", "header", "signature", "swap", "join", "cut", "extra",
])
def test_any_change_to_a_signed_message_is_refused(change):
    client, server = _pair()
    auth, a, b = client.sign([b"call-id", b"x" * 64])
    header, mac = auth[:HEADER_BYTES], auth[HEADER_BYTES:]
    frames = {
        "payload": [auth, a, b[:-1] + b"y"],
        "header": [header[:-1] + bytes([header[-1] ^ 1]) + mac, a, b],
        "signature": [header + bytes(32), a, b],
        "swap": [auth, b, a],
        "join": [auth, a + b],  # frame boundaries are signed too
        "cut": [auth[:40], a, b],
        "extra": [auth, a, b, b"more"],
    }[change]
    with pytest.raises(Refused):
        server.check(frames)
    assert server.check(client.sign([a, b])) == [a, b]  # the link still works afterwards


def test_replays_reflections_other_links_and_other_keys_are_refused():
    client, server = _pair()
    first = client.sign([b"1", b"call"])
    assert server.check(first)
    with pytest.raises(Refused, match="replayed"):
        server.check(first)
    second, third = client.sign([b"2"]), client.sign([b"3"])
    assert server.check(third)
    with pytest.raises(Refused, match="replayed"):  # an older counter, held back
        server.check(second)
    # a request sent back to the client as if it were the server's reply
    with pytest.raises(Refused, match="bad signature"):
        client.check(client.sign([b"id", b"ok", b"x"]))
    # the same key on another link (another server's nonce) or for another purpose
    other_client, other_server = _pair()
    with pytest.raises(Refused, match="bad signature"):
        other_server.check(client.sign([b"id", b"x"]))
    abort_client, _ = _pair("nccl-abort")
    with pytest.raises(Refused, match="bad signature"):
        server.check(abort_client.sign([b"id", b"x"]))
    stranger, _ = _pair(key=os.urandom(32))
    with pytest.raises(Refused, match="bad signature"):
        other_server.check(stranger.sign([b"id", b"x"]))
    # senders are told apart: another client on the same link has its own counter
    again = Link(KEY, "call", b"", "client")
    assert Link(KEY, "call", b"", "server").check(again.sign([b"a"])) == [b"a"]


def test_a_link_with_a_window_takes_messages_out_of_order_once_and_never_a_replay():
    """The hang watch asks each question on a socket of its own: two queued questions may
    be read in either order. Within the window a late message is taken once; a replay,
    or a message older than the window, is still refused."""
    client = Link(KEY, "hang-watch", b"n", "client", window=4)
    server = Link(KEY, "hang-watch", b"n", "server", window=4)
    sent = [client.pack(str(i).encode()) for i in range(1, 9)]
    assert server.unpack(sent[1]) == b"2"
    assert server.unpack(sent[0]) == b"1"  # held back one: taken
    for again in (sent[0], sent[1]):
        with pytest.raises(Refused, match="replayed"):
            server.unpack(again)
    assert server.unpack(sent[6]) == b"7"
    assert server.unpack(sent[3]) == b"4"  # 3 behind the highest: inside the window
    with pytest.raises(Refused, match="replayed"):
        server.unpack(sent[2])  # 4 behind: outside it
    with pytest.raises(Refused, match="replayed"):
        server.unpack(sent[3])
    assert server.unpack(sent[7]) == b"8" and server.unpack(sent[4]) == b"5"


def test_unsigned_and_short_messages_are_refused():
    _, server = _pair()
    for frames in ([], [b"x"], [b"x", b"y"], [b"\0" * AUTH_BYTES, b"\0" * 32]):
        with pytest.raises(Refused):
            server.check(frames)
    for frame in (b"", b"abort", os.urandom(AUTH_BYTES - 1), os.urandom(200)):
        with pytest.raises(Refused):
            server.unpack(frame)


def test_a_link_needs_a_key_and_a_side():
    with pytest.raises(ValueError, match="no key|has none"):
        Link(b"", "call", new_nonce(), "server")
    with pytest.raises(ValueError, match="side must be one of"):
        Link(KEY, "call", new_nonce(), "peer")


def test_a_cluster_without_a_key_is_refused():
    """ipyparallel with an empty key signs nothing: fsdp_nb refuses such a cluster when it
    takes its client, before any channel opens."""
    from types import SimpleNamespace

    from fsdp_nb.engine.signing import cluster_key as signing_key
    from fsdp_nb.runtime.cluster import EngineCluster

    unsigned = SimpleNamespace(session=SimpleNamespace(key=b""), ids=[0, 1])
    with pytest.raises(ValueError, match="no key, so its messages are not signed"):
        EngineCluster(unsigned)
    signed = SimpleNamespace(session=SimpleNamespace(key=KEY), ids=[0, 1])
    assert signing_key(signed) == KEY and EngineCluster(signed).key == KEY


def test_drops_are_counted_and_the_first_one_per_link_is_a_warning(caplog):
    _, server = _pair()
    with caplog.at_level(logging.DEBUG, logger="fsdp_nb"):
        for _ in range(3):
            try:
                server.unpack(b"abort")
            except Refused as why:
                server.refused(why, "tcp://127.0.0.1:1")
    levels = [r.levelno for r in caplog.records if "dropped a message" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert server.dropped == 3


def test_only_engines_started_on_this_host_count_as_ours_to_kill():
    """A Slurm session started every engine, but one on another node may share a pid with
    one here: only the pid on this host is ours to signal by pid (another node's engine is
    signalled through the controller); an engine of a cluster attached to is never killed."""
    import socket
    from types import SimpleNamespace

    from fsdp_nb.runtime.cluster import EngineCluster

    c = EngineCluster(SimpleNamespace(session=SimpleNamespace(key=KEY), ids=[0, 1]), cluster=object())
    c.pids, c.hosts = [4242, 4343], [socket.gethostname(), "node-7"]
    assert c.owned_here(0) and not c.owned_here(1)
    c.pids = [4242, 4242]  # the same pid on both hosts: only rank 0's is here
    assert c.owned_here(0) and not c.owned_here(1)
    c.hosts = ["node-6", "node-7"]
    assert not c.owned_here(0)
    attached = EngineCluster(SimpleNamespace(session=SimpleNamespace(key=KEY), ids=[0, 1]))
    attached.pids, attached.hosts = [4242, 4343], [socket.gethostname(), "node-7"]
    assert not attached.owned_here(0)
    with pytest.raises(RuntimeError, match=r"rank 1 .*on node-7\) is wedged and is not an engine this session started"):
        attached.kill([1])
