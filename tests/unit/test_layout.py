"""The package's shape: the light processes import no torch, no import runs up a floor (prepare never imports run,
format never run or model, training only the output's read side...), and no module imports another in a circle."""

import ast
import subprocess
import sys
from pathlib import Path

import hsextract

PACKAGE = Path(hsextract.__file__).parent


def test_uploader_and_storage_import_no_torch():
    # A fresh interpreter: this one has torch loaded already.
    code = (
        "import sys\n"
        "import hsextract.run.uploader, hsextract.storage, hsextract.storage.s3, hsextract.storage.local\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"the uploader's imports pull in {out.strip()}"


def _imports() -> dict[str, set[str]]:
    """Every module's project imports, lazy ones (inside functions) included."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hsextract"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("hsextract"))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_circle_even_through_lazy_imports():
    graph = _imports()
    circles = []

    def visit(module, path):
        for dep in graph[module]:
            if dep in path:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


# The floors, from the leaves up: a module imports its own package or a lower floor, never a higher or level one.
# The output's read side (batchfile, reader, verify) sits under everything that writes or trains on it; training
# beside config, so that a trainer's process reads the output without the extraction's config, model or run.
FLOORS = [
    {"hsextract", "errors"},
    {"layers", "devices"},
    {"format"},
    {"storage"},
    {"batchfile"},
    {"reader", "verify"},
    {"config", "training"},
    {"model"},
    {"prepare"},
    {"run"},
    {"dryrun_report"},
    {"status", "export", "dryrun", "demo"},
    {"cli"},
]

KNOWN_UPWARD = {
    (
        "hsextract.config",
        "hsextract.prepare.source_spec",
    ): "RunConfig checks --data with the sources' own parser",
    (
        "hsextract.output.verify",
        "hsextract.prepare.plan",
    ): "the output holds its plan; Plan's record lives in prepare/",
    (
        "hsextract.prepare.steps",
        "hsextract.run.rundir",
    ): "preparation writes the run dir; RunDir and RunInfo live in run/",
    (
        "hsextract.training.follow",
        "hsextract.output.finalize",
    ): "a growing output's manifest is built with finalize's",
}

"""Imports that run up a floor today, each with why; a new one fails the test below, a fixed one too (remove it)."""


def _floor(module: str) -> int:
    package = module.split(".")[1] if "." in module else module
    return next(i for i, names in enumerate(FLOORS) if package in names)


def test_no_import_runs_up_a_floor_except_the_known_ones():
    graph = _imports()
    assert {m.split(".")[1] for m in graph if "." in m} <= set().union(*FLOORS), (
        "a new package: give it a floor"
    )
    upward = {
        (module, dep)
        for module, deps in graph.items()
        for dep in deps
        if module.split(".")[:2] != dep.split(".")[:2] and _floor(dep) >= _floor(module)
    }
    new = sorted(upward - set(KNOWN_UPWARD))
    assert not new, "imports that run up a floor: " + "; ".join(f"{m} -> {d}" for m, d in new)
    fixed = sorted(set(KNOWN_UPWARD) - upward)
    assert not fixed, f"no longer imported, remove from KNOWN_UPWARD: {fixed}"
