"""The kernel cache (its key, directory and the run dir's pointer), the warm-up's stamp and skip, and the worker's
wait for a warm-up running beside its load. GPU-free: the parts that compile kernels run in tests/gpu."""

import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hsextract.config import RunConfig
from hsextract.prepare.plan import make_plan
from hsextract.run.rundir import RunDir
from hsextract.startup.begin import Startup, warmup_spec
from hsextract.startup.begin import start_warmup as start_warmup_in
from hsextract.startup.warmup import cache as kc
from hsextract.startup.warmup import fla_patch, tables
from hsextract.startup.warmup.fla_patch import PIN_ENV, pin_token_count_autotune
from hsextract.startup.warmup.launch import WARMUP_FLAG_ENV, Warmup, wait_for_warmup, warmup_pending
from hsextract.startup.warmup.process import plan_shapes, warm_shapes


def open_kernel_cache(cfg: RunConfig):
    """The run's kernel cache, as the launcher's start-up opens it."""
    return Startup(cfg, RunDir(cfg.run_dir).startup, program="").kernel_cache()


def start_warmup(cfg: RunConfig, plan, cache, echo):
    return start_warmup_in(cfg, plan, cache, RunDir(cfg.run_dir).startup, echo=echo)


H200 = [{"name": "NVIDIA H200", "driver": "580.159.04"}]
PACKAGES = {"torch": "2.11.0+cu130", "triton": "3.6.0", "fla-core": "0.6.0", "liger-kernel": "0.8.5"}


# -- the key ---------------------------------------------------------------------------------------------------


def test_cpu_key_needs_no_gpu():
    key = kc.setup_key("cpu")
    assert key == {"device": "cpu"}
    assert kc.key_name(key) == "cpu"


def test_cuda_key_changes_with_gpu_driver_and_every_version():
    base = kc.setup_key("cuda", gpus=H200, packages=PACKAGES)
    assert base["gpus"] == ["NVIDIA H200"] and base["driver"] == ["580.159.04"] and base["triton"] == "3.6.0"
    name = kc.key_name(base)
    assert name.startswith("h200-") and name != "cpu"
    assert kc.key_name(kc.setup_key("cuda", gpus=H200, packages=dict(PACKAGES))) == name  # stable
    others = [
        kc.setup_key(
            "cuda", gpus=[{"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}], packages=PACKAGES
        ),
        kc.setup_key("cuda", gpus=[{"name": "NVIDIA H200", "driver": "575.57.08"}], packages=PACKAGES),
    ]
    for dist, other in [("torch", "2.11.0+cu128"), ("triton", "3.5.1"), ("fla-core", "0.5.0")]:
        others.append(kc.setup_key("cuda", gpus=H200, packages={**PACKAGES, dist: other}))
    others.append(kc.setup_key("cuda", gpus=H200, packages={**PACKAGES, "flash-linear-attention": "0.6.0"}))
    names = [kc.key_name(k) for k in others]
    assert name not in names and len(set(names)) == len(names)


def test_cuda_key_without_nvidia_smi_is_still_a_key():
    key = kc.setup_key("cuda", gpus=[], packages=PACKAGES)
    assert key["gpus"] == ["unknown"] and kc.key_name(key).startswith("unknown-")


# -- the directory and the pointer -----------------------------------------------------------------------------


def test_default_directory_is_per_user_and_keyed(tmp_path):
    env = {"HOME": str(tmp_path / "home")}
    assert (
        kc.resolve(None, "cpu", env=env).dir == tmp_path / "home" / ".cache" / "hsextract" / "triton" / "cpu"
    )
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    got = kc.resolve(None, "cpu", env=env)
    assert got.dir == tmp_path / "xdg" / "hsextract" / "triton" / "cpu" and got.source == "default"


def test_option_beats_environment_and_both_are_keyed(tmp_path):
    key = kc.setup_key("cuda", gpus=H200, packages=PACKAGES)
    env = {
        "HOME": str(tmp_path),
        kc.KERNEL_CACHE_ENV: str(tmp_path / "env"),
        "TRITON_CACHE_DIR": "/elsewhere",
    }
    by_option = kc.resolve(str(tmp_path / "opt"), "cuda", env=env, key=key)
    assert by_option.dir == tmp_path / "opt" / kc.key_name(key) and by_option.source == "--kernel-cache"
    by_env = kc.resolve(None, "cuda", env=env, key=key)
    assert by_env.dir == tmp_path / "env" / kc.key_name(key) and by_env.source == kc.KERNEL_CACHE_ENV
    # A TRITON_CACHE_DIR the user set (and nothing of ours) is used exactly as given.
    del env[kc.KERNEL_CACHE_ENV]
    assert kc.resolve(None, "cuda", env=env, key=key).dir.as_posix() == "/elsewhere"


def test_prepare_writes_the_key_and_explains_an_unwritable_directory(tmp_path):
    key = kc.setup_key("cuda", gpus=H200, packages=PACKAGES)
    cache = kc.resolve(str(tmp_path / "k"), "cuda", env={}, key=key)
    kc.prepare(cache)
    assert json.loads((cache.dir / "key.json").read_text()) == key
    (tmp_path / "file").write_text("not a directory")
    blocked = kc.resolve(str(tmp_path / "file"), "cuda", env={}, key=key)
    with pytest.raises(kc.HsextractError, match=r"kernel cache .*file.* cannot be written.*--kernel-cache"):
        kc.prepare(blocked)


def test_open_kernel_cache_points_the_run_dir_at_it_and_makes_nothing_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv(kc.KERNEL_CACHE_ENV, str(tmp_path / "kernels"))
    cfg = RunConfig(
        model="m", data="d", output=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), device="cpu"
    )
    (tmp_path / "run").mkdir()
    got = open_kernel_cache(cfg)
    assert got.dir == tmp_path / "kernels" / "cpu"
    pointer = tmp_path / "run" / "kernel-cache.json"
    assert kc.read_pointer(pointer) == got.dir
    assert json.loads(pointer.read_text())["key"] == {"device": "cpu"}
    assert not (tmp_path / "kernels").exists()  # nothing is compiled on CPU, so nothing is created
    assert kc.read_pointer(tmp_path / "absent.json") is None


@pytest.mark.slow
def test_a_cpu_run_names_its_kernel_cache_in_the_run_dir(finished_run):
    root = finished_run[0]
    pointer = json.loads((root / "run" / "kernel-cache.json").read_text())
    assert pointer["key"] == {"device": "cpu"} and pointer["dir"].endswith("cpu")
    assert not (root / "run" / "triton-cache").exists()


# -- buckets, classes, the stamp -------------------------------------------------------------------------------


def _text(hk=16, hv=48, **more):
    fields = dict(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=128)
    fields.update(
        linear_value_head_dim=128, hidden_size=5120, layer_types=["linear_attention", "full_attention"]
    )
    return types.SimpleNamespace(**fields, **more)


def test_buckets_are_flas_nb_of_the_rows_each_kernel_sees():
    # fla 0.6 fla/modules/norm/l2norm.py and fused_norm_gate.py: NB = triton.cdiv(T, 2048 * 32), T = tokens x heads
    # rows of 128 (tests/gpu/test_fla_internals.py reads it from FLA's source).
    assert fla_patch.NB_ROWS == 65536
    fused, stock = kc.bucket_heads(_text(), "fused"), kc.bucket_heads(_text(), "stock")
    assert fused == (16, 48) and stock == (48, 48)
    assert kc.token_bucket(4096, fused) == (1, 3)
    assert kc.token_bucket(1, fused) == (1, 1)
    assert kc.token_bucket(4097, fused) == (2, 4)  # 65552 rows -> 2 blocks; 196656 rows -> 4
    assert kc.bucket_heads(types.SimpleNamespace(hidden_size=8), "fused") == ()


def test_shape_classes_follow_tritons_integer_specialisation():
    assert kc.shape_class(1, 17) == (True, False, False, False)
    assert kc.shape_class(32, 64) == (False, True, False, True)
    assert kc.shape_class(3, 1) == (False, False, True, False)


def _plan(lengths, budget=4096):
    return make_plan(lengths, max_tokens_per_batch=budget, max_rows=64, shards=1)


def _shapes(plan):
    return [(b.rows, b.padded_length) for b in plan.batches]


def test_stamp_skips_a_plan_it_covers_and_names_what_a_new_plan_adds(tmp_path):
    heads = (16, 48)
    plan = _plan([100, 120, 300, 310, 900, 1000] * 8)
    need = kc.plan_needs(_shapes(plan), heads)
    assert need.buckets == {kc.token_bucket(b.rows * b.padded_length, heads) for b in plan.batches}
    assert not kc.read_stamp(tmp_path, "sig")  # no stamp: everything is missing
    assert need.minus(kc.read_stamp(tmp_path, "sig")).buckets == need.buckets
    kc.add_to_stamp(tmp_path, "sig", need)
    assert not need.minus(kc.read_stamp(tmp_path, "sig"))  # covered: the warm-up is skipped
    assert (
        not kc.plan_needs(_shapes(_plan([100, 120, 300])), heads)
        .minus(kc.read_stamp(tmp_path, "sig"))
        .classes
    )
    bigger = _plan([8000, 8000], budget=16384)
    new = kc.plan_needs(_shapes(bigger), heads).minus(kc.read_stamp(tmp_path, "sig"))
    assert new.buckets == {kc.token_bucket(16000, heads)}
    single = kc.plan_needs(_shapes(_plan([1])), heads).minus(kc.read_stamp(tmp_path, "sig"))
    assert single.classes == {kc.shape_class(1, 1)}
    assert not kc.read_stamp(tmp_path, "other-model")  # stamps are per model signature


def test_stamps_of_two_jobs_at_once_merge(tmp_path):
    sets = [kc.WarmSet({(i, 3 * i)}, {(False, False, False, i % 2 == 0)}) for i in range(1, 9)]
    threads = [threading.Thread(target=kc.add_to_stamp, args=(tmp_path, "sig", s)) for s in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kc.read_stamp(tmp_path, "sig").buckets == {(i, 3 * i) for i in range(1, 9)}


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"buckets": [["3"]], "classes": []}',  # a string for an integer
        '{"buckets": [], "classes": [[1, 0, 0, 1]]}',  # integers for flags: not warm shapes
        '{"buckets": [], "classes": [[true, false]]}',  # two flags of four
        '{"buckets": [], "classes": [], "extra": 1}',
        "[]",
    ],
)
def test_a_damaged_stamp_counts_as_none(tmp_path, text):
    path = kc.stamp_path(tmp_path, "sig")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert not kc.read_stamp(tmp_path, "sig")


def test_model_signature_follows_layer_shapes_and_kernels_not_depth():
    def sig(text, **kw):
        args = {"kernel_mode": "fused", "dtype": "bfloat16", "attn_implementation": "sdpa", **kw}
        return kc.model_signature(text, **args)

    base = sig(_text(num_hidden_layers=64))
    assert sig(_text(num_hidden_layers=4)) == base
    assert sig(_text(hk=8)) != base
    assert sig(_text(), kernel_mode="stock") != base
    assert sig(_text(), dtype="float16") != base
    assert sig(_text(), pinned=False) != base


def test_a_changed_fused_forward_is_a_new_signature_and_stock_ignores_it(tmp_path, monkeypatch):
    import shutil

    for name in kc.FUSED_SOURCES:  # the package's files, copied where the test may change them
        (tmp_path / "model").mkdir(exist_ok=True)
        shutil.copy(Path(kc.__file__).parents[2] / "model" / name, tmp_path / "model" / name)
    monkeypatch.setattr(kc, "__file__", str(tmp_path / "startup" / "warmup" / "cache.py"))
    args = {"dtype": "bfloat16", "attn_implementation": "sdpa"}
    fused, stock = (kc.model_signature(_text(), kernel_mode=m, **args) for m in ("fused", "stock"))
    with open(tmp_path / "model" / kc.FUSED_SOURCES[0], "a") as f:
        f.write("\n# another fused forward\n")
    assert kc.model_signature(_text(), kernel_mode="fused", **args) != fused
    assert kc.model_signature(_text(), kernel_mode="stock", **args) == stock


def test_warm_shapes_start_with_the_largest_and_keep_one_of_each_missing_class():
    shapes = [(r, length) for r in (1, 2, 16, 64) for length in range(16, 2000, 37)]
    got = warm_shapes(shapes, limit=6, must=[(1, 17)])
    assert got[0] == max(shapes, key=lambda s: s[0] * s[1])
    assert (1, 17) in got and len(got) == 7
    assert [s[0] * s[1] for s in got] == sorted((s[0] * s[1] for s in got), reverse=True)
    plan = _plan([5, 37, 37, 300, 301, 302, 640, 1000] * 3)
    heads = (16, 48)
    missing = kc.plan_needs(_shapes(plan), heads)
    chosen = plan_shapes(_shapes(plan), missing, heads)
    assert {kc.shape_class(*s) for s in chosen} == missing.classes
    covered = kc.WarmSet(set(missing.buckets), set(missing.classes))
    assert plan_shapes(_shapes(plan), missing.minus(covered), heads) == []


def test_the_spec_reads_the_models_heads_and_the_stamp(tiny_model, tmp_path):
    cfg = RunConfig(
        model=str(tiny_model),
        data="d",
        output=str(tmp_path / "o"),
        run_dir=str(tmp_path / "r"),
        device="cuda",
    )
    plan = _plan([50, 60, 200] * 4)
    text = __import__("transformers").AutoConfig.from_pretrained(str(tiny_model)).get_text_config()
    heads = kc.bucket_heads(text, "fused")
    assert heads == (text.linear_num_key_heads, text.linear_num_value_heads)
    spec = warmup_spec(cfg, plan)
    missing = spec.missing(tmp_path / "cache")
    assert missing.buckets == kc.plan_needs(_shapes(plan), heads).buckets
    kc.add_to_stamp(tmp_path / "cache", spec.signature(text), missing)
    assert not spec.missing(tmp_path / "cache")


def test_start_without_fla_says_so_and_starts_nothing(tmp_path, tiny_model):
    if fla_patch.fla_available():
        pytest.skip("flash-linear-attention is installed here")
    cfg = RunConfig(model=str(tiny_model), data="d", output=str(tmp_path / "o"), run_dir=str(tmp_path / "r"))
    said = []
    cache = kc.resolve(str(tmp_path / "k"), "cpu", env={})
    assert start_warmup(cfg, _plan([10]), cache, echo=said.append) is None
    assert "flash-linear-attention is not installed" in said[0]


def test_a_model_without_gated_deltanet_layers_warms_nothing_and_says_nothing_of_them(tmp_path):
    """A Llama has no Gated-DeltaNet layer: no warm-up, and no word about flash-linear-attention (was: "Gated-DeltaNet
    layers run the slow torch path" for a model that has none)."""
    from transformers import LlamaConfig

    model = tmp_path / "llama"
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(model)
    cfg = RunConfig(model=str(model), data="d", output=str(tmp_path / "o"), run_dir=str(tmp_path / "r"))
    said = []
    cache = kc.resolve(str(tmp_path / "k"), "cpu", env={})
    assert start_warmup(cfg, _plan([10]), cache, echo=said.append) is None
    assert said == []


# -- the warm-up process and the worker's wait ------------------------------------------------------------------


def _warmup(tmp_path, code: str) -> Warmup:
    proc = subprocess.Popen([sys.executable, "-c", code])
    return Warmup(proc, tmp_path / "warmup.done", tmp_path / "warmup.log", echo=lambda m: None)


def test_the_flag_is_written_when_the_warm_up_ends_however_it_ends(tmp_path):
    said = []
    ok = _warmup(tmp_path, "pass")
    ok.echo = said.append
    deadline = time.monotonic() + 30
    while not ok.poll():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (tmp_path / "warmup.done").read_text().strip() == "0" and said[0].startswith("kernels warm in")
    (tmp_path / "warmup.done").unlink()
    failed = _warmup(tmp_path, "raise SystemExit(3)")
    failed.echo = said.append
    failed.proc.wait()
    assert failed.poll() and "warm-up failed (exit 3" in said[-1]
    assert (tmp_path / "warmup.done").exists()
    (tmp_path / "warmup.done").unlink()
    hung = _warmup(tmp_path, "import time; time.sleep(60)")
    hung.stop()  # the run stops: the warm-up goes, and no worker waits for it
    assert hung.proc.returncode is not None and (tmp_path / "warmup.done").exists()


def test_worker_waits_for_the_flag_only_when_a_warm_up_runs(tmp_path):
    assert wait_for_warmup(env={}) is None and not warmup_pending(env={})
    flag = tmp_path / "warmup.done"
    timer = threading.Timer(0.4, flag.write_text, args=("0\n",))
    timer.start()
    assert warmup_pending(env={WARMUP_FLAG_ENV: str(flag)})
    waited = wait_for_warmup(env={WARMUP_FLAG_ENV: str(flag)}, poll_s=0.02)
    assert 0.3 < waited < 10
    assert wait_for_warmup(env={WARMUP_FLAG_ENV: str(flag)}) < 0.1  # already there
    gone = tmp_path / "never"
    assert 0.2 <= wait_for_warmup(env={WARMUP_FLAG_ENV: str(gone)}, timeout=0.2, poll_s=0.02) < 5


# -- pinned autotune keys ----------------------------------------------------------------------------------------


class Autotuner:
    """Stands in for triton.runtime.autotuner.Autotuner (Triton is not installed here): the name and ``keys``."""

    def __init__(self, keys):
        self.keys = list(keys)


class CachedAutotuner(Autotuner):
    """fla's own subclass (``fla.ops.utils.cache``), which ``l2norm_fwd_kernel`` is in fla 0.6."""


def test_pinning_drops_the_token_count_from_autotune_keys(monkeypatch):
    module = types.ModuleType("fake_fla_norms")
    module.l2norm_fwd_kernel = CachedAutotuner(["D", "NB"])
    module.layer_norm_gated_fwd_kernel = Autotuner(["D", "NB", "HAS_RESIDUAL", "IS_RMS_NORM"])
    module.l2norm_fwd_kernel1 = Autotuner(["D"])
    module.wrapped = types.SimpleNamespace(fn=Autotuner(["NB", "D"]))  # triton.heuristics over the autotuner
    module.not_a_kernel = types.SimpleNamespace(keys=["NB"])
    monkeypatch.setitem(sys.modules, "fake_fla_norms", module)
    monkeypatch.setenv(PIN_ENV, "0")
    assert pin_token_count_autotune(["fake_fla_norms"]) == []
    assert module.l2norm_fwd_kernel.keys == ["D", "NB"]
    monkeypatch.delenv(PIN_ENV)
    got = pin_token_count_autotune(["fake_fla_norms", "no_such_module_here"])
    assert got == ["l2norm_fwd_kernel", "layer_norm_gated_fwd_kernel", "wrapped"]
    assert module.wrapped.fn.keys == ["D"] and module.not_a_kernel.keys == ["NB"]
    assert module.l2norm_fwd_kernel.keys == ["D"]
    assert module.layer_norm_gated_fwd_kernel.keys == ["D", "HAS_RESIDUAL", "IS_RMS_NORM"]
    assert module.l2norm_fwd_kernel1.keys == ["D"]


def test_another_fla_version_is_left_unpatched_with_one_logged_line(monkeypatch, tmp_path, caplog):
    module = types.ModuleType("fake_fla_norms")
    module.l2norm_fwd_kernel = CachedAutotuner(["D", "NB"])
    monkeypatch.setitem(sys.modules, "fake_fla_norms", module)
    monkeypatch.setattr(fla_patch, "fla_version", lambda: "0.7.1")
    monkeypatch.setattr(fla_patch, "_skip_logged", False)
    (tmp_path / tables.TABLE_NAME).write_text(
        json.dumps({"kernels": {"fake_fla_norms:l2norm_fwd_kernel": {}}})
    )
    with caplog.at_level("WARNING"):
        assert pin_token_count_autotune(["fake_fla_norms"]) == []
        assert tables.install("NVIDIA H200", str(tmp_path)) == 0
    assert module.l2norm_fwd_kernel.keys == ["D", "NB"]
    said = [r.getMessage() for r in caplog.records if "flash-linear-attention" in r.getMessage()]
    assert len(said) == 1 and "0.7.1 is not the 0.6.x" in said[0]
    assert fla_patch.patch_supported("0.6.3") and fla_patch.patch_supported("") is False
    # The stamp's signature says whether the keys were pinned: another FLA never reads a pinned stamp as its own.
    args = {"kernel_mode": "fused", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    assert kc.model_signature(_text(), **args) == kc.model_signature(_text(), pinned=False, **args)


def test_a_chosen_cache_that_cannot_be_made_fails_before_work_and_the_default_falls_back(
    tmp_path, monkeypatch
):
    (tmp_path / "file").write_text("not a directory")
    key = kc.setup_key("cuda", gpus=H200, packages=PACKAGES)
    kc.check_writable(kc.resolve(str(tmp_path / "new" / "root"), "cuda", env={}, key=key))  # creatable
    with pytest.raises(kc.HsextractError, match=r"cannot be created: .*file is not a writable directory"):
        kc.check_writable(kc.resolve(str(tmp_path / "file" / "root"), "cuda", env={}, key=key))
    # The default root under a HOME that cannot hold it: this job keeps its kernels in the run dir, as before.
    monkeypatch.delenv(kc.KERNEL_CACHE_ENV, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    (tmp_path / "run").mkdir()
    cfg = RunConfig(
        model="m", data="d", output=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), device="cuda"
    )
    got = open_kernel_cache(cfg)
    assert got.dir == tmp_path / "run" / "kernel-cache" and got.source == "run dir"
    assert (got.dir / "key.json").exists() and kc.read_pointer(
        tmp_path / "run" / "kernel-cache.json"
    ) == got.dir
    chosen = RunConfig(**{**cfg.__dict__, "kernel_cache": str(tmp_path / "file" / "k")})
    with pytest.raises(kc.HsextractError, match="--kernel-cache"):
        open_kernel_cache(chosen)


@pytest.mark.slow
def test_warm_up_process_agrees_with_the_launcher_on_what_the_stamp_covers(
    finished_run, tmp_path, monkeypatch, capsys
):
    from hsextract.output import Plan
    from hsextract.startup.warmup import process

    run_dir = finished_run[0] / "run"
    cfg = RunConfig.load(run_dir / "config.json")
    plan = Plan.load(run_dir / "plan.json")
    cache = tmp_path / "cache"
    spec = warmup_spec(cfg, plan)
    missing = spec.missing(cache)  # what the launcher would start a warm-up for
    assert missing.buckets and missing.classes
    text = __import__("transformers").AutoConfig.from_pretrained(cfg.model).get_text_config()
    kc.add_to_stamp(cache, spec.signature(text), missing)
    assert not spec.missing(cache)
    # The warm-up process reads the same stamp under the same signature, and stops before touching a GPU.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    spec.save(tmp_path / "warmup.json")
    assert process.main([str(tmp_path / "warmup.json")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["covered_by_stamp"] is True


@pytest.mark.slow
def test_start_skips_a_covered_plan_and_otherwise_runs_the_warm_up_process(
    finished_run, tmp_path, monkeypatch
):
    import dataclasses

    from hsextract.output import Plan
    from hsextract.startup.warmup import launch

    monkeypatch.setattr(launch, "fla_available", lambda: True)  # as on a GPU machine with FLA installed
    src = finished_run[0] / "run"
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    for name in ("config.json", "plan.json"):
        (run_dir / name).write_text((src / name).read_text())
    cfg = dataclasses.replace(RunConfig.load(src / "config.json"), run_dir=str(run_dir))
    cfg.save(run_dir / "config.json")
    plan = Plan.load(src / "plan.json")
    cache = kc.resolve(str(tmp_path / "kernels"), "cpu", env={})
    said = []
    warm = start_warmup(cfg, plan, cache, echo=said.append)
    assert warm is not None and "pre-warming kernels into" in said[-1] and "token-count bucket(s)" in said[-1]
    assert warm.worker_env() == {WARMUP_FLAG_ENV: str(run_dir / "warmup.done")}
    warm.proc.wait(timeout=120)  # no GPU here: the real warm-up process fails, and says why in its log
    assert warm.poll() and "warm-up failed" in said[-1] and (run_dir / "warmup.done").exists()
    assert "Traceback" in (run_dir / "logs" / "shard-00000.warmup.log").read_text()
    text = __import__("transformers").AutoConfig.from_pretrained(cfg.model).get_text_config()
    spec = warmup_spec(cfg, plan)
    kc.add_to_stamp(cache.dir, spec.signature(text), spec.missing(cache.dir))
    assert start_warmup(cfg, plan, cache, echo=said.append) is None and "pre-warm skipped" in said[-1]
