"""Files a run writes for itself (train/step/tensor_files.py): no CRC-32, read back bitwise."""

from __future__ import annotations

import zipfile

import torch

from varbatch_kit.train.step.tensor_files import save_tensors


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
