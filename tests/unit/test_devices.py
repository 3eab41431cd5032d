"""The device a run uses: ``auto`` resolved and said, ``cuda`` checked before any preparation (devices.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hsextract.cli import main
from hsextract.devices import Cuda, Gpu, check_gpus, detect_cuda
from hsextract.errors import HsextractError

GiB = 2**30
H200 = 140 * GiB


def _gpus(*used_gib: float) -> Cuda:
    return Cuda(tuple(Gpu(i, "NVIDIA H200", int(u * GiB), H200) for i, u in enumerate(used_gib)))


def test_shards_that_fit_on_free_gpus_pass():
    check_gpus(2, None, _gpus(0.5, 0.5))
    check_gpus(2, (3, 1), _gpus(0.5, 0.5, 139, 0.5))  # GPU 2 is full but not named


def test_no_cuda_says_to_pass_device_cpu():
    with pytest.raises(HsextractError, match=r"--device cuda, but torch 2.6\+cpu is .*pass --device cpu"):
        check_gpus(1, None, Cuda((), "torch 2.6+cpu is a CPU-only build"))


def test_more_shards_than_gpus_names_both_counts():
    with pytest.raises(
        HsextractError, match=r"--shards 4 needs 4 GPUs .* shows 2 GPU\(s\) \(0..1\): pass --shards 2"
    ):
        check_gpus(4, None, _gpus(0, 0))


def test_gpus_naming_a_gpu_that_is_not_there_says_which():
    with pytest.raises(HsextractError, match=r"--gpus 0,5 names GPU 5, but .* 2 GPU\(s\).*indices below 2"):
        check_gpus(2, (0, 5), _gpus(0, 0))


def test_a_full_gpu_is_refused_naming_the_free_ones():
    with pytest.raises(
        HsextractError, match=r"GPU 0 \(NVIDIA H200\) already has 135.0 of 140.0 GiB .*--gpus .*1,2"
    ):
        check_gpus(1, None, _gpus(135, 1, 1))


def test_unknown_memory_is_not_taken_for_full():
    check_gpus(1, None, Cuda((Gpu(0),)))


def _run(tmp_path, *extra):
    args = ["run", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl")]
    args += ["--output", str(tmp_path / "out"), *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.mark.skipif(detect_cuda().missing is None, reason="this machine has CUDA")
def test_run_on_cuda_without_cuda_is_refused_before_preparation_and_leaves_no_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _run(tmp_path, "--device", "cuda")
    assert result.exit_code == 2, result.output
    assert "--device cuda, but" in result.output and "pass --device cpu" in result.output
    assert "Traceback" not in result.output and "plan:" not in result.output
    assert not (tmp_path / "runs").exists(), "a refused run left its run dir behind"


@pytest.mark.skipif(detect_cuda().missing is None, reason="this machine has CUDA")
def test_run_without_device_picks_cpu_here_and_says_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _run(tmp_path)  # the model does not exist: refused after the device is chosen
    assert "device: cpu (--device auto: " in result.output, result.output
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists(), "a refused run left its run dir behind"


def test_fp8_compute_on_a_gpu_without_fp8_gemms_is_refused_before_preparation():
    from hsextract.devices import check_fp8_compute

    hopper = Gpu(0, "NVIDIA H200", 0, H200, (9, 0))
    ampere = Gpu(1, "NVIDIA A100", 0, H200, (8, 0))
    check_fp8_compute(1, None, Cuda((hopper, ampere)))
    check_fp8_compute(1, (1,), Cuda((hopper, Gpu(1))))  # capability not known: the worker decides
    with pytest.raises(HsextractError, match=r"--compute fp8 needs .* GPU 1 \(NVIDIA A100\) has 8.0"):
        check_fp8_compute(2, None, Cuda((hopper, ampere)))
