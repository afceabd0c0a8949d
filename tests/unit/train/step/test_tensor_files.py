"""Files a run writes for itself (train/step/tensor_files.py): no CRC-32, read back bitwise,
written in pieces of at most 1 MiB."""

from __future__ import annotations

import os
import pickle
import threading
import zipfile

import pytest
import torch

from varbatch_kit.train.step import tensor_files
from varbatch_kit.train.step.tensor_files import WRITE_PIECE, save_tensors, write_all


def _crcs(path) -> dict[str, int]:
    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/")[-1]: i.CRC for i in z.infolist()
                if "/data/" in i.filename}


def test_saved_without_checksums_and_read_back_bitwise(tmp_path):
    g = torch.Generator().manual_seed(0)
    obj = {"w": torch.randn(100, 7, dtype=torch.float64, generator=g),
           "b": torch.randn(3, generator=g).to(torch.bfloat16), "step": 2}
    out = save_tensors(obj, tmp_path / "params_step2.pt")
    assert out == tmp_path / "params_step2.pt"
    assert [p.name for p in tmp_path.iterdir()] == ["params_step2.pt"]  # no temporary left
    back = torch.load(out, weights_only=True)
    assert back["step"] == 2 and all(torch.equal(back[k], obj[k]) for k in ("w", "b"))
    # the tensors' records carry no CRC-32; torch.save's default writes one
    crcs = _crcs(out)
    assert len(crcs) == 2 and set(crcs.values()) == {0}
    torch.save(obj, tmp_path / "default.pt")
    assert 0 not in _crcs(tmp_path / "default.pt").values()
    # the process-wide default is left as it was
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True


@pytest.fixture
def write_sizes(monkeypatch):
    """The sizes of this thread's ``os.write`` calls, each still done by the real one."""
    sizes, real, me = [], os.write, threading.get_ident()

    def recording(fd, data):
        if threading.get_ident() == me:
            sizes.append(len(memoryview(data).cast("B")))
        return real(fd, data)

    monkeypatch.setattr(tensor_files.os, "write", recording)
    return sizes


def test_write_all_writes_every_byte_in_pieces_of_at_most_a_mebibyte(tmp_path, write_sizes):
    data = os.urandom(2 * WRITE_PIECE + 12345)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert write_all(fd, memoryview(data)) == len(data)
        assert write_all(fd, b"") == 0
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    assert write_sizes == [WRITE_PIECE, WRITE_PIECE, 12345]


def test_a_large_tensor_is_saved_in_pieces_and_read_back_bitwise(tmp_path, write_sizes):
    w = torch.randn(3 * WRITE_PIECE // 8 + 5, dtype=torch.float64)  # 3 MiB and 40 bytes
    out = save_tensors({"w": w}, tmp_path / "p.pt")
    assert torch.equal(torch.load(out, weights_only=True, mmap=True)["w"], w)
    assert max(write_sizes) <= WRITE_PIECE and sum(write_sizes) == out.stat().st_size


def test_a_failed_save_leaves_no_file(tmp_path):
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        save_tensors({"f": lambda: 0}, tmp_path / "p.pt")  # a lambda does not pickle
    assert list(tmp_path.iterdir()) == []
