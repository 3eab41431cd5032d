"""Recorded autotune choices (startup/warmup/tables.py): recorded from the autotuners of a process, merged, and handed back
to a fresh one so that it times nothing. GPU-free: a stand-in for Triton's ``Autotuner`` whose ``run`` looks its
cache up as Triton 3.6's does (``key in cache``, then ``cache[key]``, else time every candidate); the real kernels
are covered on the GPU (tests/gpu/test_gpu.py)."""

import json
import os
import sys
import types

from hsextract.startup.warmup import tables as tuned


class Config:
    def __init__(self, kwargs, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None, pre_hook=None):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages
        self.num_ctas, self.maxnreg, self.pre_hook = num_ctas, maxnreg, pre_hook


class JITFunction:
    def __init__(self, module, src):
        self.module, self.src = module, src


class Autotuner:
    def __init__(self, module, src, keys, configs):
        self.fn = JITFunction(module, src)
        self.keys, self.configs, self.cache, self.timed = keys, configs, {}, []

    def run(self, key, best=0):
        if key not in self.cache:  # Triton: time every candidate, keep the fastest
            self.timed.append(key)
            self.cache[key] = self.configs[best]
        return self.cache[key]


CONFIGS = [Config({"BT": 64}, 4), Config({"BT": 128}, 8), Config({"BT": 64}, 8, 2)]


def _module(name, src="def kernel(): pass"):
    module = types.ModuleType(name)
    module.chunk_kernel = Autotuner(name, src, ["H", "K", "T"], list(CONFIGS))
    module.norm_kernel = types.SimpleNamespace(fn=Autotuner(name, "def norm(): pass", ["D"], list(CONFIGS)))
    return module


def test_a_fresh_process_times_nothing_the_table_holds_and_gets_the_same_configs(monkeypatch, tmp_path):
    first = _module("fla.fake_ops")
    monkeypatch.setitem(sys.modules, "fla.fake_ops", first)
    first.chunk_kernel.run((32, 128, 4096, "torch.bfloat16"), best=1)
    first.chunk_kernel.run((32, 128, 65536, "torch.bfloat16"), best=2)
    first.norm_kernel.fn.run((128,), best=1)
    path = tmp_path / tuned.TABLE_NAME
    assert tuned.record(path, "NVIDIA H200") == 2
    table = json.loads(path.read_text())
    assert table["gpu"] == "NVIDIA H200" and set(table["kernels"]) == {
        "fla.fake_ops:chunk_kernel",
        "fla.fake_ops:norm_kernel",
    }

    fresh = _module("fla.fake_ops")  # a new process: same kernels, empty caches
    monkeypatch.setitem(sys.modules, "fla.fake_ops", fresh)
    assert tuned.install("NVIDIA H200", str(tmp_path)) == 2
    k = fresh.chunk_kernel
    assert (
        k.run((32, 128, 4096, "torch.bfloat16")) is k.configs[1]
    )  # the tuner's own candidate, pre-hook and all
    assert k.run((32, 128, 65536, "torch.bfloat16")) is k.configs[2]
    assert fresh.norm_kernel.fn.run((128,)) is fresh.norm_kernel.fn.configs[1]
    # A token count never recorded takes the nearest recorded one (log scale): no timing either.
    assert k.run((32, 128, 50000, "torch.bfloat16")) is k.configs[2]
    assert k.run((32, 128, 3000, "torch.bfloat16")) is k.configs[1]
    assert k.timed == [] and fresh.norm_kernel.fn.timed == []
    # A number the table never saw vary (a head dim), or another dtype, must match: those are timed.
    k.run((32, 64, 4096, "torch.bfloat16"))
    k.run((32, 128, 4096, "torch.float16"))
    fresh.norm_kernel.fn.run((256,))
    assert k.timed == [(32, 64, 4096, "torch.bfloat16"), (32, 128, 4096, "torch.float16")]
    assert fresh.norm_kernel.fn.timed == [(256,)]


def test_a_kernel_whose_source_changed_or_whose_config_is_gone_is_timed_again(monkeypatch, tmp_path):
    first = _module("fla.fake_ops2")
    monkeypatch.setitem(sys.modules, "fla.fake_ops2", first)
    first.chunk_kernel.run((32, 128, 4096), best=1)
    first.norm_kernel.fn.run((128,), best=1)
    tuned.record(tmp_path / tuned.TABLE_NAME, "NVIDIA H200")

    fresh = _module("fla.fake_ops2", src="def kernel(): return 1")  # FLA changed the chunk kernel
    fresh.norm_kernel.fn.configs = [CONFIGS[0]]  # and the norm kernel's candidates
    monkeypatch.setitem(sys.modules, "fla.fake_ops2", fresh)
    assert tuned.install("NVIDIA H200", str(tmp_path)) == 1
    fresh.chunk_kernel.run((32, 128, 4096))
    fresh.norm_kernel.fn.run((128,))
    assert fresh.chunk_kernel.timed == [(32, 128, 4096)] and fresh.norm_kernel.fn.timed == [(128,)]


def test_disabled_by_environment_or_without_a_table_nothing_is_answered(monkeypatch, tmp_path):
    first = _module("fla.fake_ops3")
    monkeypatch.setitem(sys.modules, "fla.fake_ops3", first)
    first.chunk_kernel.run((1, 2, 3))
    tuned.record(tmp_path / tuned.TABLE_NAME, "NVIDIA H200")
    monkeypatch.setenv(tuned.TUNED_ENV, "0")
    assert tuned.install("NVIDIA H200", str(tmp_path)) == 0
    monkeypatch.delenv(tuned.TUNED_ENV)
    assert tuned.install("Some Other GPU", str(tmp_path / "empty")) == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / tuned.TABLE_NAME).write_text("{not json")
    assert tuned.install("NVIDIA H200", str(tmp_path / "bad")) == 0


def test_records_of_two_warm_ups_merge_and_the_newer_choice_wins():
    old = {"m:k": {"src": "a", "entries": [[[1, 2], {"x": 1}], [[1, 4], {"x": 2}]]}}
    new = {
        "m:k": {"src": "a", "entries": [[[1, 4], {"x": 3}], [[1, 8], {"x": 4}]]},
        "m:j": {"src": "b", "entries": []},
    }
    got = tuned.merge(old, new)
    assert sorted(map(tuple, (tuple(e[0]) + (e[1]["x"],) for e in got["m:k"]["entries"]))) == [
        (1, 2, 1),
        (1, 4, 3),
        (1, 8, 4),
    ]
    changed = tuned.merge(old, {"m:k": {"src": "c", "entries": [[[9, 9], {"x": 5}]]}})
    assert changed["m:k"]["entries"] == [[[9, 9], {"x": 5}]]


def test_the_shipped_tables_are_named_by_gpu_and_hold_their_triton_version():
    assert tuned.gpu_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert tuned.gpu_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    for name in ("NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json"):  # shipped with the package
        assert (tuned.SHIPPED_DIR / name).is_file()
    for path in sorted(tuned.SHIPPED_DIR.glob("*.json")):
        table = json.loads(path.read_text())
        assert path.name == tuned.gpu_file_name(table["gpu"]) and table["triton"] and table["kernels"]


def _recorded(monkeypatch, tmp_path, name: str):
    """A table recorded by a process that ran ``name``'s kernels, and a fresh copy of that module in place."""
    first = _module(name)
    monkeypatch.setitem(sys.modules, name, first)
    first.chunk_kernel.run((1, 2, 3), best=1)
    path = tmp_path / tuned.TABLE_NAME
    tuned.record(path, "NVIDIA H200")
    fresh = _module(name)
    monkeypatch.setitem(sys.modules, name, fresh)
    return path, fresh


def test_a_table_naming_a_module_outside_the_kernel_packages_imports_nothing(monkeypatch, tmp_path, caplog):
    """A cache file never chooses what code runs: only modules of the kernel packages are imported."""
    path, fresh = _recorded(monkeypatch, tmp_path, "fla.fake_ops4")
    mods, imported = tmp_path / "mods", tmp_path / "imported"
    mods.mkdir()
    (mods / "probe_not_a_kernel.py").write_text(f"open({str(imported)!r}, 'w').write('ran')\nkernel = None\n")
    (mods / "fla_lookalike.py").write_text(f"open({str(imported)!r}, 'w').write('ran')\nkernel = None\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.delitem(sys.modules, "this", raising=False)
    table = json.loads(path.read_text())
    legit = table["kernels"]["fla.fake_ops4:chunk_kernel"]
    for hostile in (
        "this:nothing",
        "probe_not_a_kernel:kernel",
        "fla_lookalike:kernel",
        "os:system",
        "fla.fake_ops4:chunk_kernel; import os",
        "fla..x:k",
    ):
        table["kernels"][hostile] = legit
    path.write_text(json.dumps(table))
    with caplog.at_level("WARNING", logger="hsextract.startup.warmup.tables"):
        assert tuned.install("NVIDIA H200", str(tmp_path)) == 1
    assert not imported.exists() and "this" not in sys.modules
    assert "probe_not_a_kernel" not in sys.modules and "fla_lookalike" not in sys.modules
    assert sum("names no kernel module" in r.getMessage() for r in caplog.records) == 6
    assert (
        fresh.chunk_kernel.run((1, 2, 3)) is fresh.chunk_kernel.configs[1] and fresh.chunk_kernel.timed == []
    )


def test_a_table_another_user_could_write_is_not_read(monkeypatch, tmp_path, caplog):
    path, fresh = _recorded(monkeypatch, tmp_path, "fla.fake_ops5")
    assert path.stat().st_mode & 0o777 == 0o644
    for mode, says in ((0o666, "lets others write it"), (0o664, "lets its group write it")):
        path.chmod(mode)
        caplog.clear()
        with caplog.at_level("WARNING", logger="hsextract.startup.warmup.tables"):
            assert tuned.install("NVIDIA H200", str(tmp_path)) == 0
        assert any(str(path) in r.getMessage() and says in r.getMessage() for r in caplog.records)
    path.chmod(0o644)
    if os.geteuid() == 0:  # another owner: only root can make one here
        os.chown(path, 12345, 12345)
        with caplog.at_level("WARNING", logger="hsextract.startup.warmup.tables"):
            assert tuned.install("NVIDIA H200", str(tmp_path)) == 0
        assert any("owned by uid 12345" in r.getMessage() for r in caplog.records)
        os.chown(path, 0, 0)
    assert tuned.install("NVIDIA H200", str(tmp_path)) == 1
    assert fresh.chunk_kernel.run((1, 2, 3)) is fresh.chunk_kernel.configs[1]


def test_a_table_is_recorded_writable_by_its_owner_only_whatever_the_umask(monkeypatch, tmp_path):
    first = _module("fla.fake_ops6")
    monkeypatch.setitem(sys.modules, "fla.fake_ops6", first)
    first.chunk_kernel.run((1, 2, 3))
    old = os.umask(0o002)
    try:
        tuned.record(tmp_path / tuned.TABLE_NAME, "NVIDIA H200")
    finally:
        os.umask(old)
    assert (tmp_path / tuned.TABLE_NAME).stat().st_mode & 0o777 == 0o644
