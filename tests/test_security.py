"""Trust, tried as an outsider would: another process on the same machine, without the
cluster's key, against a real 2-rank session.

- each fsdp_nb socket (the direct call channel, the NCCL abort listener, the hang
  watch and the debugger requests it carries, the memory feed) gets the outsider's pickled call, ``b"abort"``, a subscription, random,
  truncated and oversized frames and a captured frame replayed: nothing runs, nothing
  aborts, nothing leaks, and the session answers its next call;
- everything the session listens on is on loopback;
- a poisoned checkpoint (its optimizer item's pickle runs code) is refused by
  ``sess.load``, consolidate, export and the checkpoint browser, with and without a
  valid marker: a clear error, the model unchanged, nothing ran;
- a peer that went bad on the in-memory autosave's copy group: a copy announced far
  larger than a rank's state allocates nothing, and one whose rest would run code as it
  is unpickled is refused by the weights-only reader;
- records, logs and stack dumps are private; a planted link is not followed;
- kill -9 of the controller and then of the kernel leaves nothing of the session
  running 30 s later; a pid whose process changed is never signalled.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid

import cloudpickle
import psutil
import pytest
import torch
import zmq
from helpers import START_S

import fsdp_nb
from fsdp_nb.engine import call_channel, nccl_abort
from fsdp_nb.engine import side_channel as ms
from fsdp_nb.engine.process_handles import (
    ProcessHandle,
    process_alive,
    process_stamp,
    stop_processes,
)
from fsdp_nb.engine.signing import Link, new_nonce
from fsdp_nb.runtime.cluster import wait_until

FUZZ_MESSAGES = 150
"""Random messages sent to each socket by the fuzz test."""


def _marker_code(marker) -> str:
    return f"open({str(marker)!r}, 'a').write('ran')"


def _until(pred, what: str, timeout: float = 30.0) -> None:
    if not wait_until(pred, timeout, 0.05):
        pytest.fail(f"{what}: not seen within {timeout:g} s")


def _call_endpoints(sess) -> list[str]:
    sess.run(os.getpid)  # the call servers start on first use
    return [sess.context.channel.endpoints[r.engine_id] for r in sess.ranks]


def _outsider(kind: int, endpoint: str) -> zmq.Socket:
    sock: zmq.SyncSocket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _nothing_came(sock: zmq.Socket) -> bool:
    return not sock.poll(200)


def test_an_outsider_cannot_run_code_through_the_call_channel(sess, tmp_path):
    """The attack from the issue: a DEALER sends ``[id, cloudpickle((exec, (code, {}), True))]``
    (a well-formed call, as the notebook's: only the signature stops it) to every call
    server; also the same call signed with a key of its own."""
    marker = tmp_path / "ran"
    payload = cloudpickle.dumps((exec, (_marker_code(marker), {}), True))
    before = sess.run(call_channel.dropped)
    wrong_key = Link(os.urandom(32), "call", new_nonce(), "client")
    socks = []
    for ep in _call_endpoints(sess):
        s = _outsider(zmq.DEALER, ep)
        s.send_multipart([uuid.uuid4().bytes, payload])
        s.send_multipart(wrong_key.sign([uuid.uuid4().bytes, payload]))
        socks.append(s)
    _until(lambda: [a - b for a, b in zip(sess.run(call_channel.dropped), before)] == [2, 2],
           "both engines dropping both calls")
    assert not marker.exists()
    assert all(_nothing_came(s) for s in socks)  # no reply, no output: nothing leaks
    assert sess.run(lambda: 41 + 1) == [42, 42]
    for s in socks:
        s.close()


def test_a_captured_call_replayed_is_dropped(sess, tmp_path, monkeypatch):
    """The notebook's own signed call, captured and sent again by an outsider, runs once."""
    log = tmp_path / "calls"
    ep = _call_endpoints(sess)[0]
    sock = sess.context.channel._socks[sess.ranks[0].engine_id]
    link = sess.context.channel._links[sock]
    captured: list[list[bytes]] = []
    sign = link.sign

    def capture(frames, digests=None):
        signed = sign(frames, digests)
        captured.append([bytes(f) for f in signed])
        return signed

    monkeypatch.setattr(link, "sign", capture)
    sess.run(_append_on_rank_0, str(log))
    monkeypatch.undo()
    assert log.read_text() == "x" and len(captured) == 1
    before = sess.run(call_channel.dropped)[0]
    attacker = _outsider(zmq.DEALER, ep)
    attacker.send_multipart(captured[0])
    _until(lambda: sess.run(call_channel.dropped)[0] == before + 1, "the replay dropped")
    assert log.read_text() == "x" and _nothing_came(attacker)
    attacker.close()


def _append_on_rank_0(path: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write("x")


def test_a_call_too_large_for_the_direct_socket_goes_through_ipyparallel(sess, monkeypatch):
    """The servers refuse frames over ``MAX_REQUEST_BYTES`` (zmq drops the sender), so the
    notebook sends such a call through ipyparallel instead: it still runs, nothing is dropped."""
    _call_endpoints(sess)
    before = sess.run(call_channel.dropped)
    sent: list[object] = []
    send = sess.context.channel.send
    monkeypatch.setattr(sess.context.channel, "send", lambda *a, **kw: sent.append(send(*a, **kw)) or sent[-1])
    monkeypatch.setattr(call_channel, "MAX_REQUEST_BYTES", 10_000)  # the notebook's copy
    assert sess.run(len, b"x" * 20_000) == [20_000, 20_000]
    assert sent == [None]  # nothing went over the direct sockets
    assert sess.run(len, b"x" * 100) == [100, 100] and sent[-1] is not None
    assert sess.run(call_channel.dropped) == before


def test_abort_without_the_key_aborts_nothing(sess):
    sess.context.health.start_abort_listeners(sess.context.plain_dispatcher)
    before = sess.run(nccl_abort.received)
    socks = []
    for ep, _ in sess.context.health.abort_links.values():
        s = _outsider(zmq.PUSH, ep)
        s.send(b"abort")
        s.send(Link(os.urandom(32), "nccl-abort", new_nonce(), "client").pack(nccl_abort.ABORT))
        socks.append(s)
    _until(lambda: all(g[2] - b[2] == 2 for g, b in zip(sess.run(nccl_abort.received), before)),
           "both listeners dropping both requests")
    assert [g[0] for g in sess.run(nccl_abort.received)] == [b[0] for b in before]  # none taken
    # the notebook's own request is taken, once: captured and replayed, it is dropped
    captured: list[tuple[str, bytes]] = []
    for ep, link in sess.context.health.abort_links.values():
        pack = link.pack
        link.pack = lambda payload, ep=ep, pack=pack: captured.append((ep, pack(payload))) or captured[-1][1]
    try:
        sess.context.health.abort([0, 1])
    finally:
        for _, link in sess.context.health.abort_links.values():
            del link.pack
    _until(lambda: all(g[0] == b[0] + 1 for g, b in zip(sess.run(nccl_abort.received), before)),
           "the signed abort request")
    for ep, frame in captured:
        s = _outsider(zmq.PUSH, ep)
        s.send(frame)
        socks.append(s)
    _until(lambda: all(g[2] - b[2] == 3 for g, b in zip(sess.run(nccl_abort.received), before)),
           "both listeners dropping the replay")
    assert all(g[0] == b[0] + 1 for g, b in zip(sess.run(nccl_abort.received), before))
    assert sess.all_reduce_check() == 1.0
    for s in socks:
        s.close()


def _watch_dropped() -> int:
    from fsdp_nb.engine.registry import part
    from fsdp_nb.hangs.rank_hang_watch import WatchListener

    return part(WatchListener).state["link"].dropped


def test_the_watch_answers_questions_read_out_of_order_once_each(sess):
    """Each question goes on a socket of its own, so a rank busy in C may read two queued
    questions in either order: it used to drop the older as a replay, and the notebook got
    no answer from that rank ("dropped a message on the hang-watch channel" under a load).
    Read in either order, each is answered; captured and sent again, it is not."""
    from fsdp_nb.hangs import rank_hang_watch as hang_watch

    watch = sess.context.health.watch
    before = sess.run(_watch_dropped)
    replays = []
    for ep, link in watch.links.values():
        early, late = link.pack(hang_watch.QUERY), link.pack(hang_watch.QUERY)
        for frame in (late, early):  # the later question is read first
            s = _outsider(zmq.DEALER, ep)
            s.send(frame)
            assert s.poll(30_000), "a question read out of order got no answer"
            assert json.loads(link.unpack(s.recv()))["pid"] in sess.cluster.pids
            s.close()
        replays.append(_outsider(zmq.DEALER, ep))
        replays[-1].send(early)
    _until(lambda: all(g - b == 1 for g, b in zip(sess.run(_watch_dropped), before)),
           "both watch threads dropping the replay")
    assert all(_nothing_came(s) for s in replays)


def test_an_outsider_can_neither_ask_where_a_rank_is_nor_close_its_connections(sess):
    """The hang watch's threads: a request unsigned, signed with another key, or a
    genuine one captured and replayed gets no answer and closes nothing."""
    from fsdp_nb.hangs import rank_hang_watch as hang_watch

    watch = sess.context.health.watch
    assert all(ep.startswith("tcp://127.0.0.1:") for ep, _ in watch.links.values())  # loopback only
    before = sess.run(_watch_dropped)
    peers = b"[" + b", ".join(b'["127.0.0.1", %d]' % p for es in sess.cluster.tcp_endpoints().values()
                              for _, p in es) + b"]"
    socks = []
    for ep, _ in watch.links.values():
        s = _outsider(zmq.DEALER, ep)
        s.send(hang_watch.QUERY)
        s.send(hang_watch.FREE + peers)
        s.send(Link(os.urandom(32), "hang-watch", new_nonce(), "client").pack(hang_watch.FREE + peers))
        socks.append(s)
    _until(lambda: all(g - b == 3 for g, b in zip(sess.run(_watch_dropped), before)),
           "both watch threads dropping the three requests")
    assert all(_nothing_came(s) for s in socks)
    # the notebook's own question is answered; captured and replayed, it is dropped
    captured: list[tuple[str, bytes]] = []
    for ep, link in watch.links.values():
        pack = link.pack
        link.pack = lambda payload, ep=ep, pack=pack: captured.append((ep, pack(payload))) or captured[-1][1]
    try:
        assert all(st is not None for st in watch.states([0, 1]).values())
    finally:
        for _, link in watch.links.values():
            del link.pack
    for ep, frame in captured:
        s = _outsider(zmq.DEALER, ep)
        s.send(frame)
        socks.append(s)
    _until(lambda: all(g - b == 4 for g, b in zip(sess.run(_watch_dropped), before)),
           "both watch threads dropping the replay")
    assert all(_nothing_came(s) for s in socks[-2:])
    assert sess.all_reduce_check() == 1.0  # no connection of the group was closed
    for s in socks:
        s.close()


def test_an_outsider_cannot_send_commands_to_a_rank_stopped_at_a_breakpoint(sess, tmp_path, monkeypatch, capsys):
    """A rank at a breakpoint runs what its pdb reads, and pdb reads the hang watch's
    debugger requests: one unsigned, or signed with another key, is dropped (rank 1's
    own pdb counts the drops while it stands), and the code it carried never runs."""
    from fsdp_nb.debugging import rank_breakpoints

    sess.execute("def sec_dropped():\n    from fsdp_nb.engine.registry import part\n"
                 "    from fsdp_nb.hangs.rank_hang_watch import WatchListener\n"
                 "    return part(WatchListener).state['link'].dropped")
    before = sess.run(_watch_dropped)[1]
    planted = tmp_path / "pwned"
    attack = rank_breakpoints.SEND + f"!open({str(planted)!r}, 'w').write('ran')".encode()
    ep, _ = sess.context.health.watch.links[1]
    socks = []
    prompts = []

    def at_the_prompt(prompt=""):
        prompts.append(prompt)
        answers.append(capsys.readouterr().out)  # what the console showed so far
        if len(prompts) == 1:  # rank 1 stands: the outsider's requests
            socks.extend(_outsider(zmq.DEALER, ep) for _ in range(2))
            socks[0].send(attack)
            socks[1].send(Link(os.urandom(32), "hang-watch", new_nonce(), "client").pack(attack))
        elif f"'dropped {before + 2}'" in "".join(answers):
            return "c"  # both dropped while it stood
        assert len(prompts) < 400, "rank 1's watch did not drop the outsider's two requests"
        return "p f'dropped {sec_dropped()}'"

    answers: list[str] = []
    monkeypatch.setattr("builtins.input", at_the_prompt)
    sess.execute("import torch, torch.distributed as dist\nbreakpoint()\ndist.all_reduce(torch.ones(1))", debug=[1])
    assert not planted.exists()
    assert all(_nothing_came(s) for s in socks)
    for s in socks:
        s.close()
    assert sess.all_reduce_check() == 1.0


def _spies(endpoint: str, token: str, *replayed: bytes) -> list[zmq.Socket]:
    """Outsiders subscribed to a side-channel sampler: to everything, to a random topic, to
    the feed's token signed with another key, and to each of ``replayed`` (a subscription
    captured on its way)."""
    spies = []
    for topic in (b"", os.urandom(56), *replayed,
                  Link(os.urandom(32), "memory", new_nonce(), "client").pack(token.encode())):
        spy = _outsider(zmq.SUB, endpoint)
        spy.setsockopt(zmq.SUBSCRIBE, topic)
        spies.append(spy)
    return spies


def test_a_subscriber_without_the_key_gets_no_memory_samples(sess, monkeypatch):
    """Subscriptions for everything, for random topics, signed with another key, and the
    notebook's own subscription captured and replayed: none gets a sample."""
    from fsdp_nb.runtime import side_channel as _feed

    packed: list[tuple[bytes, bytes]] = []
    pack = Link.pack

    def capture(self, payload):
        packed.append((bytes(payload), pack(self, payload)))
        return packed[-1][1]

    monkeypatch.setattr(_feed.Link, "pack", capture)
    w = sess.memory(interval=0.1)
    monkeypatch.undo()
    try:
        # the feed's subscriptions: its token signed (the hang watch's questions, asked
        # while the start call runs on a loaded machine, are signed through pack too)
        captured = [signed for payload, signed in packed if payload == w.feed.token.encode()]
        assert len(captured) == len(w.feed.endpoints) == 2
        # a subscription is captured on its way, so it reaches the sampler first: wait for
        # the notebook's own to be applied (its first samples) before the spies replay it
        _until(lambda: min(_seqs(w)) >= 0, "the first sample of every rank")
        spies = [spy for ep, mine in zip(w.feed.endpoints, captured) for spy in _spies(ep, w.feed.token, mine)]
        _until(lambda: sum(sess.run(ms.dropped)) >= 4 * len(w.feed.endpoints),
               "the samplers refusing every outsider's subscription")
        start = _seqs(w)
        _until(lambda: all(now >= n + 3 for now, n in zip(_seqs(w), start)),
               "three more samples reaching the notebook")
        assert all(_nothing_came(s) for s in spies)
        for s in spies:
            s.close()
    finally:
        w.close()


def test_a_subscriber_without_the_key_gets_no_step_times(sess):
    """The step view's samples go over the same signed side channel: subscriptions for
    everything, for a random topic, and the view's token signed with another key get
    nothing, while the notebook's own view is fed."""
    view = sess.steps(window=5, interval=0.1)
    spies = []
    try:
        spies = [spy for ep in view.feed.endpoints for spy in _spies(ep, view.feed.token)]
        _until(lambda: sum(sess.run(ms.dropped)) >= 2 * len(view.feed.endpoints),
               "the samplers refusing the outsiders' signed-looking subscriptions")
        # with no forward between them, one cell's optimizer steps are one iteration: a call each
        sess.execute("_o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)")
        for _ in range(5):
            sess.run(_one_step)
        sess.execute("del _o")
        _until(lambda: len(view.ranks) == 2 and all(p.steps == 5 for p in view.ranks.values()),
               "the notebook's view fed with every rank's 5 steps")
        assert all(_nothing_came(spy) for spy in spies)
    finally:
        for spy in spies:
            spy.close()
        view.stop()


def _one_step() -> None:
    _o.step()  # type: ignore[name-defined]  # noqa: F821 - an engine global


def _seqs(w) -> list[int]:
    """Each rank's newest memory sample's number (-1 before the first)."""
    return [-1 if x is None else x.seq for x in w.feed.latest()]


def _fuzz_frames(rng: random.Random, signed: list[bytes]) -> list[list[bytes]]:
    """Random messages, and truncated or reordered copies of a signed one."""
    out = []
    for _ in range(FUZZ_MESSAGES):
        out.append([rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 6))])
    for cut in range(1, len(signed)):
        out.append(signed[:cut])
    out.append([f[: len(f) // 2] for f in signed])
    out.append(list(reversed(signed)))
    return out


def test_a_bounded_fuzz_leaves_every_engine_serving(sess, tmp_path):
    """Random, truncated, reordered and oversized frames at every socket; the session's
    calls, abort requests and memory samples still go through afterwards."""
    rng = random.Random(28)
    marker = tmp_path / "ran"
    sess.context.health.start_abort_listeners(sess.context.plain_dispatcher)
    w = sess.memory(interval=0.1)
    try:
        key = sess.cluster.key
        dropped_before = sum(sess.run(call_channel.dropped))
        stranger = Link(key, "call", new_nonce(), "client")  # right key, wrong link
        call = stranger.sign([b"id", cloudpickle.dumps((exec, (_marker_code(marker), {}), True))])
        socks = []
        for ep in _call_endpoints(sess):
            s = _outsider(zmq.DEALER, ep)
            for frames in _fuzz_frames(rng, call):
                s.send_multipart(frames)
            socks.append(s)
        for ep, _ in sess.context.health.abort_links.values():
            s = _outsider(zmq.PUSH, ep)
            for frames in _fuzz_frames(rng, [Link(key, "nccl-abort", new_nonce(), "client").pack(b"abort")]):
                s.send_multipart(frames)
            s.send(bytes(nccl_abort.MAX_FRAME_BYTES + 1))  # oversized: zmq drops the sender
            socks.append(s)
        for ep in w.feed.endpoints:
            for frames in _fuzz_frames(rng, [b"x"])[-40:]:
                s = _outsider(zmq.SUB, ep)
                s.setsockopt(zmq.SUBSCRIBE, frames[0])
                socks.append(s)
        big = _outsider(zmq.DEALER, _call_endpoints(sess)[1])
        big.send_multipart([b"id", bytes(call_channel.MAX_REQUEST_BYTES + 1)], copy=False)
        socks.append(big)
        # every call message the servers could read was dropped, and they still serve
        sent = 2 * len(_fuzz_frames(rng, call))
        _until(lambda: sum(sess.run(call_channel.dropped)) == dropped_before + sent, "the fuzzed calls dropped")
        assert sess.run(lambda: "still here") == ["still here"] * 2
        assert not marker.exists()
        before = sess.run(nccl_abort.received)
        sess.context.health.abort([0, 1])
        _until(lambda: all(g[0] == b[0] + 1 for g, b in zip(sess.run(nccl_abort.received), before)),
               "a signed abort after the fuzz")
        start = _seqs(w)
        _until(lambda: all(now > n for now, n in zip(_seqs(w), start)), "samples after the fuzz")
        assert sess.all_reduce_check() == 1.0
        for s in socks:
            s.close()
    finally:
        w.close()


def _listening(pids: list[int]) -> set[str]:
    out = set()
    for pid in pids:
        for c in psutil.Process(pid).net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN:
                out.add(c.laddr.ip)
    return out


def test_a_local_session_listens_on_loopback_only(sess):
    """The engines' sockets (ipyparallel's, fsdp_nb's, the group's store and gloo's) and
    the controller's: nothing on another interface, nothing on all of them."""
    sess.context.health.start_abort_listeners(sess.context.plain_dispatcher)
    w = sess.memory(interval=0.5)
    try:
        _call_endpoints(sess)
        assert sess.run(lambda: (os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"])) == \
            [("127.0.0.1", "lo")] * 2
        engines = [r.pid for r in sess.ranks]
        controller = [p for p, _ in sess.cluster.controller_pids]
        assert _listening(engines) == {"127.0.0.1"}
        assert _listening(controller) == {"127.0.0.1"}
        port = int(sess.run(lambda: os.environ["MASTER_PORT"])[0])
        store = [c for c in psutil.Process(engines[0]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [c.laddr.ip for c in store] == ["127.0.0.1"]  # the TCPStore itself
    finally:
        w.close()


_EVIL = """
import torch

class RunsCode:
    def __reduce__(self):
        return (exec, ({code!r},))

sec_opt = torch.optim.AdamW(sec_m.parameters(), lr=0.1)
sec_m(torch.randn(4, 8)).sum().backward()
sec_opt.step()
sec_opt.zero_grad()
sec_opt.param_groups[0]["evil"] = RunsCode()
"""


def _state(sess) -> tuple[list, list]:
    """The model's full weights and each rank's optimizer moments (sums)."""
    return [v.clone() for v in sess.models["sec_m"].state_dict().values()], sess.run(_moments)


def _moments() -> list:
    from fsdp_nb.engine.namespace import user_ns

    state = user_ns()["sec_opt"].state_dict()["state"]
    return sorted((k, float(v["exp_avg"].to_local().sum())) for k, v in state.items())


def test_a_poisoned_checkpoint_is_refused_by_every_reader(sess, tmp_path):
    marker = tmp_path / "ran"
    model = sess.wrap(torch.nn.Linear(8, 8), name="sec_m")
    sess.execute(_EVIL.format(code=_marker_code(marker)))
    path = tmp_path / "ckpts" / "poisoned"
    sess.save(str(path), model, optimizer="sec_opt")  # the attacker's own save: valid marker
    assert fsdp_nb.inspect(str(path)).source == "fsdp_nb" and not marker.exists()
    sess.execute("del sec_opt.param_groups[0]['evil']\nsec_m(torch.randn(4, 8)).sum().backward()\n"
                 "sec_opt.step()\nsec_opt.zero_grad()")
    before = _state(sess)
    plain = tmp_path / "plain"  # the same files with no fsdp_nb marker: a plain dcp.save folder
    shutil.copytree(path, plain)
    for name in os.listdir(plain):
        if (plain / name).is_dir():
            shutil.rmtree(plain / name)  # each rank's own state: not dcp.save's
        elif not name.endswith((".distcp", ".metadata")):
            os.remove(plain / name)
    refused = r"item 'optim\.param_groups\.0\.evil' in file '__\d_0\.distcp' holds a pickle .*could run code"
    for where in (path, plain):
        with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=refused):
            sess.load(str(where), model, optimizer="sec_opt")
        after = _state(sess)
        assert all(torch.equal(a, b) for a, b in zip(after[0], before[0])) and after[1] == before[1]
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=refused):
        fsdp_nb.consolidate(str(path), str(tmp_path / "full.pt"))
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=refused):
        fsdp_nb.export_safetensors(str(plain), str(tmp_path / "hf"))
    browser = sess.checkpoints(str(tmp_path / "ckpts"), model=model, optimizer="sec_opt")
    browser.select("poisoned")
    browser.load_selected()
    assert browser.last_message[0] == "error" and "could run code" in browser.last_message[1]
    browser.consolidate_selected()
    assert browser.last_message[0] == "error" and "could run code" in browser.last_message[1]
    assert not marker.exists() and not (tmp_path / "full.pt").exists() and not (tmp_path / "hf").exists()
    after = _state(sess)
    assert all(torch.equal(a, b) for a, b in zip(after[0], before[0])) and after[1] == before[1]
    # the documented opt-in is what runs it, on every rank: the poison is real (loaded
    # once the optimizer has that param group key again, so DCP asks for the item)
    sess.execute("sec_opt.param_groups[0]['evil'] = None")
    sess.load(str(plain), model, optimizer="sec_opt", weights_only=False)
    assert marker.read_text() == "ran" * sess.world_size


def test_records_logs_and_stack_dumps_are_private_and_links_are_not_followed(session_factory, tmp_path):
    s = session_factory(2, private=True)
    try:
        record = s.context.keeper.record.path
        folder = os.path.dirname(record)
        assert _mode(folder) == 0o700 and _mode(record) == 0o600
        assert _mode(record.removesuffix(".json") + ".watchdog.log") == 0o600
        stacks = s.context.health.folder
        assert all(s.context.health.stacks([0, 1]).values())  # a stack dump of every rank
        dumps = sorted(os.listdir(stacks))
        assert len(dumps) == 2 and _mode(stacks) == 0o700
        assert all(_mode(os.path.join(stacks, d)) == 0o600 for d in dumps)
        # a link planted where the record is about to be written is not followed
        victim = tmp_path / "victim"
        victim.write_text("keep me")
        tmp = f"{record}.{os.getpid()}.tmp"
        os.symlink(victim, tmp)
        with pytest.raises(OSError):
            s.context.keeper.record.write()
        assert victim.read_text() == "keep me"
        os.remove(tmp)
        s.context.keeper.record.write()  # and once the link is gone, it writes as before
        # a stack file turned into a link is not truncated through it
        one = os.path.join(stacks, dumps[0])
        os.remove(one)
        os.symlink(victim, one)
        s.context.health.stacks([0, 1], wait=0.5)
        assert victim.read_text() == "keep me"
    finally:
        s.shutdown()
    assert not os.path.exists(stacks)  # stack dumps are removed at shutdown
    assert not os.path.exists(record)


def _mode(path: str) -> int:
    return os.lstat(path).st_mode & 0o777


def test_a_reused_pid_is_never_signalled(tmp_path):
    """A process handle (what shutdown, the watchdog and the session's signals use) takes
    a pid only for the process its start time was read from, and once taken it follows
    that process, not the number."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        stamp = process_stamp(child.pid)
        assert ProcessHandle.open(child.pid, stamp - 5.0) is None  # "the pid was reused"
        assert stop_processes([(child.pid, stamp - 5.0)], wait=0.2, term=True) == []
        assert child.poll() is None  # not signalled
        handle = ProcessHandle.open(child.pid, stamp)
        assert handle is not None and handle.alive()
        stop_processes([(child.pid, stamp)], wait=10, term=True)
        assert child.wait(10) == -signal.SIGTERM
        assert not handle.alive() and not handle.send_signal(signal.SIGTERM)  # gone: nothing sent
        handle.close()
    finally:
        if child.poll() is None:
            child.kill()


def test_killing_the_controller_then_the_kernel_leaves_nothing_running(kernel):
    k = kernel
    k.run("import fsdp_nb\nsess = fsdp_nb.Session(2, backend='gloo')", timeout=START_S)
    files = k.value("[sess.cluster.cluster.cluster_file, sess.context.health.folder]")
    security = os.path.dirname(files[0])
    assert len(os.listdir(security)) == 3  # the cluster file and the controller's two
    engines = k.value("[r.pid for r in sess.ranks]")
    tree = k.value("[p for p, _ in sess.cluster.controller_pids]")
    standby = k.value("sess.cluster.standby.pid")
    assert len(tree) > 1, "the controller's schedulers are what used to be left behind"
    everything = [*engines, *tree, standby]
    os.kill(tree[0], signal.SIGKILL)  # the controller
    _until(lambda: not process_alive(tree[0]), "the controller's death")
    assert any(process_alive(p) for p in tree[1:])  # its schedulers live on by themselves
    k.restart()  # kill -9 of the kernel, and a fresh one for the fixture
    if not wait_until(lambda: not any(process_alive(p) for p in everything), 30, 0.2):
        left = [p for p in everything if process_alive(p)]
        pytest.fail(f"pids {left} of the session still run 30 s after the kernel died")
    assert fsdp_nb.sessions() == []
    # the watchdog also removed the cluster's files and the stack dumps
    assert os.listdir(security) == [] and not os.path.exists(files[1])


def _peer_attack(marker: str) -> str:
    """On the ranks: rank 1 plays a peer that went bad on the copy group. First it
    announces a copy far larger than a rank's state; then a copy of a plausible size whose
    rest is a pickle that would run code. Rank 0 receives each as its buddy would, and
    says what happened."""
    import io
    import pickle

    import torch as t

    from fsdp_nb.autosave import rank_copy_transfer as ct
    from fsdp_nb.autosave import rank_memory_copies as mc
    from fsdp_nb.engine.checkpoint_group import copy_group
    from fsdp_nb.errors import UnsafeCheckpointError

    class Payload:
        def __reduce__(self):
            return (io.open, (marker, "w"))

    buf = io.BytesIO()
    pickle.dump({"state": {}, "x": Payload()}, buf)
    group = copy_group()
    if rank == 1:  # type: ignore[name-defined]  # noqa: F821 - an engine global
        t.distributed.send(t.tensor([7, 1 << 40, 16], dtype=t.int64), 0, group=group, tag=ct.HEADER_TAG)
        bad = ct.Generation(7, t.zeros(64, dtype=t.uint8), buf.getvalue(), 64)
        ct.transfer(group, [(0, bad)], None, limit=None)
        return "sent"
    said = []
    got, failed = ct.transfer(group, [], 1, limit=1 << 20)
    said.append(f"{got} {failed}")
    got, failed = ct.transfer(group, [], 1, expect=7, limit=1 << 20)
    assert got is not None and failed is None
    try:
        mc.apply(got, None, [], (), "rank 1's copy of step 7")
    except UnsafeCheckpointError as exc:
        said.append(type(exc).__name__)
    return " | ".join(said)


def test_a_bad_peer_on_the_copy_group_allocates_nothing_and_runs_nothing(sess, tmp_path):
    """The in-memory autosave's copies travel on a gloo group of their own: a rank that
    announces a copy of 1 TiB is refused before anything is allocated, and a copy whose
    rest would run code as it is unpickled is refused by the weights-only reader, before
    any model is touched (none is passed here: the refusal comes first)."""
    marker = tmp_path / "ran"
    said = sess.run(_peer_attack, str(marker))
    assert said[1] == "sent"
    assert said[0].startswith("None ") and "announced a copy of 1099511627776 + 16 bytes" in said[0], said[0]
    assert "refused before anything was allocated" in said[0], said[0]
    assert said[0].endswith("UnsafeCheckpointError"), said[0]
    assert not marker.exists()
    assert sess.all_reduce_check() == 1.0  # the session answers its next call
