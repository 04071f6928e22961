"""write_basic_config writes Accelerate's file, where Accelerate looks for it, and nbaccel's
resolve reads it back; compared byte for byte with Accelerate's own on this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nbaccel.config.resolve import resolve
from nbaccel.utils import PrecisionType, write_basic_config
from nbaccel.utils import basic_config as module


@pytest.fixture
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "visible_gpu_count", lambda env: 0)


@pytest.mark.parametrize("precision", ["no", "bf16", "FP16"])
def test_the_file_is_accelerates(tmp_path: Path, precision: str) -> None:
    default = pytest.importorskip("accelerate.commands.config.default")
    if default.torch.cuda.is_available():
        pytest.skip("compared on a machine without GPUs, where both write one CPU process")
    ours, theirs = tmp_path / "ours.yaml", tmp_path / "theirs.yaml"
    assert write_basic_config(precision, save_location=ours) == ours
    assert default.write_basic_config(precision, save_location=str(theirs)) == theirs
    assert ours.read_bytes() == theirs.read_bytes()


def test_gpus_give_one_process_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "visible_gpu_count", lambda env: 4)
    written = json.loads(Path(write_basic_config(save_location=tmp_path / "c.yaml")).read_text())
    assert (written["distributed_type"], written["num_processes"], written["use_cpu"]) == (
        "MULTI_GPU",
        4,
        False,
    )
    # One GPU, as Accelerate writes it: a single process, not distributed, on the GPU.
    one = module.basic_config("no", gpus=1)
    assert (one["distributed_type"], one["num_processes"], one["use_cpu"]) == ("NO", 1, False)


def test_the_default_location_is_accelerates_and_resolve_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_gpus: None
) -> None:
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    path = write_basic_config(PrecisionType.BF16)
    assert path == hf_home / "accelerate" / "default_config.yaml"
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    theirs = config_args.load_config_from_file(str(path))  # Accelerate reads it as its own
    assert (theirs.mixed_precision, theirs.num_processes, theirs.use_cpu) == ("bf16", 1, True)
    resolved = resolve({}, env={"HF_HOME": str(hf_home)})
    assert (resolved.config.mixed_precision, resolved.config.use_cpu) == ("bf16", True)
    assert resolved.config.num_processes == 1
    assert resolved.sources["mixed_precision"] == f"file:{path}"


def test_a_gpu_file_resolves_to_ddp_over_every_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "visible_gpu_count", lambda env: 2)
    write_basic_config("fp16", save_location=tmp_path / "accelerate" / "default_config.yaml")
    config = resolve({}, env={"HF_HOME": str(tmp_path)}).config
    assert (config.strategy, config.num_processes, config.use_cpu) == ("ddp", 2, False)
    assert config.mixed_precision == "fp16"


def test_an_existing_file_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_gpus: None
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("distributed_type: MULTI_CPU\n")
    assert write_basic_config("bf16", save_location=path) is False
    assert path.read_text() == "distributed_type: MULTI_CPU\n"
    assert "already exists" in capsys.readouterr().out


def test_bad_precisions_are_refused_before_writing(tmp_path: Path, no_gpus: None) -> None:
    with pytest.raises(ValueError, match="'no', 'fp16', 'bf16'"):
        write_basic_config("fp32", save_location=tmp_path / "a.yaml")
    with pytest.raises(NotImplementedError, match="fp8 training"):
        write_basic_config("fp8", save_location=tmp_path / "b.yaml")
    assert not os.listdir(tmp_path)
