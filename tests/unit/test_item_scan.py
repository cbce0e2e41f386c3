"""A load's check pass reads each stored item through a small window: every byte is
checksummed, only the item's ends are kept, and the tensor built from them is the one
``torch.load`` gives. Real files, real ``torch.save`` items, real CRC-32C."""

from __future__ import annotations

import io
import zipfile
from types import SimpleNamespace

import psutil
import pytest
import torch

from fsdp_nb.formats.checksums import ALGORITHM, ChecksumMismatch, checksum
from fsdp_nb.formats.item_scan import CHUNK, EDGE, ItemScanner
from fsdp_nb.formats.item_tensor import kept_edges_suffice, tensor_from_item

PAD = 4096  # the item sits this far into its file, as items of a DCP file do


def _stored(tmp_path, raw: bytes, name: str = "__0_0.distcp"):
    """``raw`` written at ``PAD`` into a file; (path, stored item, its checksum record)."""
    path = tmp_path / name
    path.write_bytes(b"\0" * PAD + raw + b"\0" * 100)
    sinfo = SimpleNamespace(relative_path=name, offset=PAD, length=len(raw))
    return path, sinfo, (len(raw), checksum(raw, 0, ALGORITHM), ALGORITHM)


def _saved(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(t, out)
    return out.getvalue()


def _scan(path, sinfo, want, whole=False, scanner=None):
    with open(path, "rb") as f:
        return (scanner or ItemScanner()).scan(f, sinfo, want, whole)


def test_a_large_item_is_checked_whole_but_only_its_ends_are_kept(tmp_path):
    t = torch.randn(1024, 600)  # 2.4 MB: several windows between the ends
    raw = _saved(t)
    assert len(raw) > 2 * EDGE + 2 * CHUNK
    path, sinfo, want = _stored(tmp_path, raw)
    view = _scan(path, sinfo, want)
    assert len(view) == len(raw)
    assert bytes(view[:EDGE]) == raw[:EDGE] and bytes(view[-EDGE:]) == raw[-EDGE:]
    assert bytes(view[EDGE:-EDGE]) != raw[EDGE:-EDGE]  # the middle was checksummed, not kept
    assert kept_edges_suffice(view, EDGE)
    got, whole = tensor_from_item(view), torch.load(io.BytesIO(raw), weights_only=True)
    assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
        whole.dtype, whole.shape, whole.stride(), whole.storage_offset())
    # where its bytes start in the item: what the copy pass reads straight into a target
    base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    start = got.data_ptr() - base
    assert raw[start:start + t.numel() * 4] == t.numpy().tobytes()


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
def test_a_flipped_byte_anywhere_in_the_item_is_named(tmp_path, where):
    raw = bytearray(_saved(torch.randn(1024, 600)))
    _, sinfo, want = _stored(tmp_path, bytes(raw))
    at = {"head": 10, "middle": len(raw) // 2, "tail": len(raw) - 30}[where]
    raw[at] ^= 0x01
    path, _, _ = _stored(tmp_path, bytes(raw))
    with pytest.raises(ChecksumMismatch, match=rf"__0_0.distcp' is corrupt in bytes {PAD}-{PAD + len(raw)} "):
        _scan(path, sinfo, want)


@pytest.mark.parametrize("cut", [EDGE // 2, EDGE + CHUNK + 7, -EDGE // 2])
def test_an_item_cut_short_is_named_truncated_with_or_without_a_checksum(tmp_path, cut):
    raw = _saved(torch.randn(1024, 600))
    path, sinfo, want = _stored(tmp_path, raw)
    keep = PAD + (cut if cut > 0 else len(raw) + cut)
    path.write_bytes(path.read_bytes()[:keep])
    for record in (want, None):
        with pytest.raises(ChecksumMismatch, match="truncated"):
            _scan(path, sinfo, record)


def test_checking_a_large_item_adds_no_item_sized_memory(tmp_path):
    raw = _saved(torch.randn(64 << 20 >> 2))  # 64 MiB
    path, sinfo, want = _stored(tmp_path, raw)
    scanner = ItemScanner()
    _scan(path, sinfo, want, scanner=scanner)  # the buffers exist from here on
    before = psutil.Process().memory_info().rss
    for _ in range(3):
        _scan(path, sinfo, want, scanner=scanner)
    assert psutil.Process().memory_info().rss - before < 8 << 20
    whole, other = psutil.Process().memory_info().rss, ItemScanner()
    _scan(path, sinfo, want, whole=True, scanner=other)  # the other way round: all of it
    assert psutil.Process().memory_info().rss - whole > 48 << 20


def test_an_item_whose_pickle_lies_in_its_middle_is_read_whole(tmp_path):
    """A zip laid out otherwise (here: the tensor's bytes, its pickle, then a large
    record) cannot be read from its ends: the scan reads all of it, and the tensor is
    still the one torch.load gives."""
    t = torch.randn(512, 512)
    with zipfile.ZipFile(io.BytesIO(_saved(t))) as saved:
        parts = {n: saved.read(n) for n in saved.namelist()}
    data = next(n for n in parts if "/data/" in n)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(data, parts[data])
        for n, b in parts.items():
            if n != data:
                z.writestr(n, b)
        z.writestr("archive/padding", b"\0" * (2 * EDGE))
    raw = out.getvalue()
    path, sinfo, want = _stored(tmp_path, raw)
    view = _scan(path, sinfo, want)
    assert bytes(view) == raw
    assert torch.equal(tensor_from_item(view), t)
    sparse = bytearray(raw)
    sparse[EDGE:-EDGE] = bytes(len(raw) - 2 * EDGE)
    assert not kept_edges_suffice(memoryview(sparse), EDGE)


def test_a_small_item_and_a_whole_read_keep_every_byte(tmp_path):
    small = _saved(torch.randn(64, 64))
    assert len(small) <= 2 * EDGE + CHUNK
    big = _saved(torch.randn(1024, 600))
    for raw, whole in ((small, False), (big, True)):
        path, sinfo, want = _stored(tmp_path, raw)
        assert bytes(_scan(path, sinfo, want, whole=whole)) == raw
