"""A DCP item (a ``torch.save`` archive) read as a tensor over the bytes already read:
the zip's directory read from its last bytes, what each pickle says kept by its bytes,
and ``zipfile`` then ``torch.load`` for anything else."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from fsdp_nb.formats import item_tensor
from fsdp_nb.formats.item_tensor import item_layout, tensor_from_item


def _item(t: torch.Tensor) -> bytearray:
    raw = io.BytesIO()
    torch.save(t, raw)
    return bytearray(raw.getvalue())


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert got.storage_offset() == want.storage_offset() and torch.equal(got, want)


@pytest.mark.parametrize("t", [
    torch.randn(5, 7), torch.randn(8, 3).t().contiguous().t(), torch.arange(10), torch.tensor(3.5),
    torch.empty(0, 4), torch.randn(4, 4).to(torch.bfloat16), torch.randn(3, 2).t(), torch.arange(12.0)[3:9],
], ids=["f32", "strided", "i64", "scalar", "empty", "bf16", "transposed", "offset"])
def test_item_tensor_is_built_over_the_bytes_read(t):
    """The same tensor as torch.load gives, sharing the buffer it was read into (no copy),
    found through the directory read by hand (not zipfile)."""
    buf = _item(t)
    assert item_tensor._records(memoryview(buf)) is not None
    got = tensor_from_item(memoryview(buf))
    _same(got, torch.load(io.BytesIO(bytes(buf)), weights_only=True))
    if got.numel():
        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        assert base <= got.data_ptr() < base + len(buf)


def test_the_directory_read_by_hand_is_zipfiles():
    buf = _item(torch.randn(6, 5))
    records = item_tensor._records(memoryview(buf))
    with zipfile.ZipFile(io.BytesIO(bytes(buf))) as zf:
        assert sorted(records) == sorted(zf.namelist())
        for name, (start, n) in records.items():
            assert bytes(buf[start:start + n]) == zf.read(name)


def test_a_kept_layout_serves_the_next_item_of_that_shape_with_its_own_bytes():
    """Each shape's pickle is parsed once (the cache's misses), then served from the cache
    (its hits), each item's tensor still over its own bytes."""
    item_layout.cache_clear()
    a, b = torch.randn(16, 4), torch.randn(16, 4)
    got_a, got_b = (tensor_from_item(memoryview(_item(t))) for t in (a, b))
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    assert (item_layout.cache_info().misses, item_layout.cache_info().hits) == (1, 1)
    tensor_from_item(memoryview(_item(torch.randn(4, 16))))  # another shape: parsed once more
    assert (item_layout.cache_info().misses, item_layout.cache_info().currsize) == (2, 2)


def test_a_record_shorter_than_its_pickle_says_is_not_read_past(caplog):
    """A pickle that promises more bytes than its record holds (here: a real archive
    whose tensor record was cut to a quarter) goes to zipfile and torch.load, which refuse
    it as torch.load of the archive does; nothing is read outside the record."""
    raw = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(bytes(_item(torch.randn(64))))) as src, zipfile.ZipFile(raw, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:len(data) // 4] if info.filename.endswith("data/0") else data)
    buf = bytearray(raw.getvalue())
    with pytest.raises(Exception) as torch_says:  # noqa: B017 - whatever torch.load raises
        torch.load(io.BytesIO(bytes(buf)), weights_only=True)
    with caplog.at_level("DEBUG", logger="fsdp_nb"), pytest.raises(type(torch_says.value)):
        tensor_from_item(memoryview(buf))
    assert "the storage record holds 64 bytes, its pickle says 256" in caplog.text


@pytest.mark.parametrize("change", ["comment", "deflated"])
def test_an_archive_the_directory_reader_does_not_take_goes_to_zipfile(change):
    t = torch.randn(3, 3)
    raw = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(bytes(_item(t)))) as src, zipfile.ZipFile(raw, "w") as dst:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if change == "deflated" and info.filename.endswith("data.pkl") else 0
            dst.writestr(info.filename, src.read(info), compress_type=method)
        if change == "comment":
            dst.comment = b"made elsewhere"
    buf = bytearray(raw.getvalue())
    assert item_tensor._records(memoryview(buf)) is None
    _same(tensor_from_item(memoryview(buf)), t)


def test_a_directory_pointing_outside_the_item_is_refused_as_torch_load_refuses_it():
    buf = _item(torch.randn(5))
    records = item_tensor._records(memoryview(buf))
    start, _ = records["archive/data/0"]
    entry = next(i for i in range(len(buf) - 46) if bytes(buf[i:i + 4]) == b"PK\x01\x02"
                 and bytes(buf[i + 46:i + 46 + 14]) == b"archive/data/0")
    assert int.from_bytes(buf[entry + 42:entry + 46], "little") < start  # its local header offset...
    buf[entry + 42:entry + 46] = (len(buf) + 100).to_bytes(4, "little")  # ...now past the end
    with pytest.raises(struct.error):
        item_tensor._records(memoryview(buf))
    with pytest.raises(Exception) as torch_says:  # noqa: B017 - whatever torch.load raises
        torch.load(io.BytesIO(bytes(buf)), weights_only=True)
    with pytest.raises(type(torch_says.value)):
        tensor_from_item(memoryview(buf))
    assert records  # the intact item was read by hand
