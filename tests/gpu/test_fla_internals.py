"""The FLA and Triton internals startup/warmup/fla_patch.py relies on, read from the installed packages: a new FLA
release that renames a module, moves the token bucket or keeps its autotune cache elsewhere fails here, not as a
slower start-up nobody notices. Needs FLA (the GPU machine); the last test runs the kernels on CUDA."""

import inspect
import re

import pytest

pytest.importorskip("fla")

from hsextract.startup.warmup import fla_patch, tables  # noqa: E402


def _tuner(module_name: str, name: str):
    module = __import__(module_name, fromlist=[name])
    tuner = fla_patch.autotuner_of(getattr(module, name, None))
    assert tuner is not None, f"{module_name}.{name} is no longer a Triton autotuner"
    return tuner


NORM_KERNELS = [
    ("fla.modules.l2norm", "l2norm_fwd_kernel"),
    ("fla.modules.fused_norm_gate", "layer_norm_gated_fwd_kernel"),
]


def test_the_installed_fla_is_the_version_the_patches_were_written_for():
    assert fla_patch.fla_version().startswith(fla_patch.WRITTEN_FOR), (
        f"fla-core {fla_patch.fla_version()}: re-read fla_patch.py against it, then set WRITTEN_FOR"
    )
    assert fla_patch.patch_supported()


@pytest.mark.parametrize(("module_name", "name"), NORM_KERNELS)
def test_the_norm_kernels_key_their_autotuning_on_the_token_bucket(module_name, name):
    assert module_name in fla_patch.PINNED_MODULES
    tuner = _tuner(module_name, name)
    assert isinstance(tuner.keys, list) and fla_patch.TOKEN_COUNT_KEY in tuner.keys
    assert isinstance(tuner.cache, dict) and tuner.configs
    assert isinstance(fla_patch.jit_of(tuner).src, str) and fla_patch.source_hash(tuner)
    for config in tuner.configs:
        assert set(fla_patch.config_dict(config)) == {
            "kwargs",
            "num_warps",
            "num_stages",
            "num_ctas",
            "maxnreg",
        }


def test_the_token_bucket_is_the_rows_over_nb_rows():
    """``NB = triton.cdiv(T, NB_ROWS)`` in both norm entry points: the kernel cache's buckets are FLA's."""
    from fla.modules import fused_norm_gate, l2norm

    for fn in (fla_patch.l2norm_fwd(), fused_norm_gate.layer_norm_gated_fwd):
        source = inspect.getsource(inspect.unwrap(fn))
        found = re.findall(r"NB = triton\.cdiv\(T, ([0-9 *]+)\)", source)
        assert found, f"{fn.__qualname__} no longer computes NB = triton.cdiv(T, ...)"
        products = {eval(expr, {"__builtins__": {}}) for expr in found}  # digits and '*' only, by the regex
        assert products == {fla_patch.NB_ROWS}, (fn.__qualname__, found)
    assert fla_patch.l2norm_fwd() is l2norm.l2norm_fwd


def test_tritons_autotuner_looks_its_cache_up_by_the_keys_it_holds():
    """The patches set ``keys`` and replace ``cache``: both must be what ``run`` reads."""
    tuner = _tuner(*NORM_KERNELS[0])
    runs = [inspect.getsource(cls.run) for cls in type(tuner).__mro__ if "run" in vars(cls)]
    assert any("self.keys" in src for src in runs) and any("self.cache" in src for src in runs)


def test_the_shipped_table_names_kernels_this_fla_has_with_their_source():
    """Every kernel of the table shipped for a GPU, recorded with this FLA, still exists with the same source."""
    for path in sorted(tables.SHIPPED_DIR.glob("*.json")):
        table = tables.read_table(path)
        if table.get("fla-core") != fla_patch.fla_version():
            continue
        for kernel_id, rec in table["kernels"].items():
            module_name, name = tables.kernel_module(kernel_id)
            tuner = _tuner(module_name, name)
            assert fla_patch.source_hash(tuner) == rec["src"], f"{kernel_id} changed: record the table again"


@pytest.fixture
def pinned_then_restored():
    """Pins the norm kernels for one test; the other tests of this process see FLA's own keys again."""
    tuners = [_tuner(*k) for k in NORM_KERNELS]
    saved = [list(t.keys) for t in tuners]
    yield fla_patch.pin_token_count_autotune()
    for tuner, keys in zip(tuners, saved, strict=True):
        tuner.keys = keys


def test_pinned_norm_kernels_tune_once_for_every_token_bucket(pinned_then_restored):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    l2norm_fwd = fla_patch.l2norm_fwd()
    tuner = _tuner(*NORM_KERNELS[0])
    assert "l2norm_fwd_kernel" in pinned_then_restored
    assert fla_patch.TOKEN_COUNT_KEY not in tuner.keys
    before = len(tuner.cache)
    for rows in (1000, fla_patch.NB_ROWS * 3 + 5):  # two buckets
        x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
        y, _ = l2norm_fwd(x)
        torch.testing.assert_close(
            y.float(), torch.nn.functional.normalize(x.float(), dim=-1), rtol=2e-2, atol=2e-2
        )
    assert len(tuner.cache) == before + 1, "a second token bucket was tuned again"
