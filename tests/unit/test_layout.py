"""The package's shape: the light processes import no torch, no import runs up a floor (prepare never imports model,
config or run, output never prepare, run, model or training...), the rest import the output through its two faces only, and no
module imports another in a circle."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import hsextract
import hsextract.output
import hsextract.output.ledger

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


def test_regenerate_imports_no_torch():
    """``hsextract regenerate`` is a light process: thousands of requests in flight, no model."""
    code = (
        "import sys\n"
        "import hsextract.cli, hsextract.regenerate.runner\n"
        "print(','.join(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"regenerate's imports pull in {out.strip()}"


FACES = {
    "hsextract.output": hsextract.output._EXPORTS,
    "hsextract.output.ledger": hsextract.output.ledger._EXPORTS,
}


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
                face = FACES.get(node.module, {})
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if alias.name in face:
                        sub = f"hsextract.output.{face[alias.name]}"  # a face's name, resolved to its module
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


# The floors, from the leaves up: a module imports its own package or a lower floor, never a higher or level one,
# and no exception is allowed. The output (written and read) sits under everything that writes or trains on it;
# prepare (data -> tokens -> plan) under the config, the model and the run, so that it imports none of them;
# training beside config, so that a trainer's process reads the output without the extraction's config, model or run.
FLOORS = [
    {"hsextract", "errors", "validation"},
    {"layers", "devices", "hub", "container", "real_target"},
    {"storage"},
    {"output"},
    {"prepare"},
    {"config", "training"},
    {"model"},
    {"startup"},
    {"run"},
    {"dryrun_report"},
    {"status", "export", "dryrun", "demo", "regenerate"},
    {"cli"},
]


def _floor(module: str) -> int:
    package = module.split(".")[1] if "." in module else module
    return next(i for i, names in enumerate(FLOORS) if package in names)


def test_no_import_runs_up_a_floor():
    graph = _imports()
    assert {m.split(".")[1] for m in graph if "." in m} <= set().union(*FLOORS), (
        "a new package: give it a floor"
    )
    upward = sorted(
        (module, dep)
        for module, deps in graph.items()
        for dep in deps
        if module.split(".")[:2] != dep.split(".")[:2] and _floor(dep) >= _floor(module)
    )
    assert not upward, "imports that run up a floor: " + "; ".join(f"{m} -> {d}" for m, d in upward)


# The output is reached through two faces. ``hsextract.output``: what an output is, for anyone (a trainer, export,
# the CLI, the model's capture, the run): open, read and verify one, the plan, and what writes a batch file.
# ``hsextract.output.ledger``: who holds an output and which batches are done (the claim, the job files, the
# completion records, the manifest's lifecycle), for those that keep or follow a job only.
LEDGER_READERS = {"run", "status", "training", "export"}


def test_the_output_is_imported_through_its_faces_only():
    """Outside hsextract/output/, its names come from its faces, never from its modules; the ledger's only in the
    packages that keep or follow a job (``LEDGER_READERS``)."""
    reached = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "output":
            continue
        package = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        allowed = set(FACES) if package in LEDGER_READERS else {"hsextract.output"}
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("hsextract.output")
            ):
                names = {a.name for a in node.names}
                if node.module not in allowed or not names <= set(FACES[node.module]):
                    reached.append(
                        f"{path.relative_to(PACKAGE)}: from {node.module} import {', '.join(sorted(names))}"
                    )
            elif isinstance(node, ast.Import):
                reached += [
                    f"{path.relative_to(PACKAGE)}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("hsextract.output")
                ]
    assert not reached, "outside the output, import its faces' names only: " + "; ".join(reached)


def test_each_face_is_small():
    """A face that grows past its cap asks for a better name (a method, a record) instead of one more export."""
    assert len(hsextract.output._EXPORTS) <= 20, sorted(hsextract.output._EXPORTS)
    assert len(hsextract.output.ledger._EXPORTS) <= 24, sorted(hsextract.output.ledger._EXPORTS)


def test_the_faces_export_what_they_name():
    """Every name of a face is defined where the face says, and no name is in both."""
    import importlib

    assert not set(hsextract.output._EXPORTS) & set(hsextract.output.ledger._EXPORTS)
    for face in FACES.values():
        for name, module in face.items():
            assert hasattr(importlib.import_module(f"hsextract.output.{module}"), name), (name, module)


# Module docstrings say what a module is for and why it is built that way, in a few lines; the rest lives in the
# code's own comments and in docs/. Figures that were measured (durations, rates, sizes, ratios) drift as the code
# changes, so they live in docs/PERFORMANCE.md beside the command that measures them, never in a docstring.
MAX_MODULE_DOCSTRING_LINES = 6
# No module is allowed past either rule any more; a module reshaped in other work may be listed while it is cut.
LONG_DOCSTRING_ALLOWED: set[str] = set()
FIGURES_ALLOWED: set[str] = set()
_UNIT = r"(?:s|ms|us|µs|min|minutes|seconds|h|hours|[kMGT]i?B|%|x)"
MEASURED_FIGURE = re.compile(
    # An approximate quantity: ~1 s, about 20 MB, roughly 3x.
    rf"(?:~|\babout |\baround |\broughly )\d[\d,.]*\s?{_UNIT}(?![\w/])"
    # A rate: 1,666 tok/s, 4.1 GB/s, 900 TFLOP/s.
    r"|\b\d[\d,.]*\s?(?:tok|tokens|samples|rows|it|[kMGT]i?B|TFLOP)/s\b"
    # A speed-up or saving: 8x less, 2.5x faster (a dimension such as 128x128 is not one).
    r"|\b\d[\d.]*\s?x (?:faster|slower|less|more|fewer|smaller|larger|lower|higher)\b"
    # A duration or share with decimals: 0.026 s, 0.3% (round definitions such as "1 MiB" or "30 min" pass).
    r"|\b\d+\.\d+\s?(?:s|ms|%)(?![\w/])"
)
"""What a measured figure looks like in prose. Text in double backquotes is left out: it shows what the code prints
(``1,666 tok/s``) or takes, not a measurement."""


def _docstrings():
    """(module, line, text) of every docstring under the package: modules', classes', functions' and attributes'."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                if isinstance(node.value.value, str):
                    yield module, node.lineno, node.value.value


def test_module_docstrings_are_short():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if (n := len(doc.strip("\n").splitlines())) > MAX_MODULE_DOCSTRING_LINES:
            long[module] = n
    assert set(long) <= LONG_DOCSTRING_ALLOWED, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (say what the module is for and why, "
        f"in short; the rest belongs in comments or docs/): {long}"
    )
    shortened = LONG_DOCSTRING_ALLOWED - set(long)
    assert not shortened, (
        f"within {MAX_MODULE_DOCSTRING_LINES} lines now: take out of LONG_DOCSTRING_ALLOWED: {shortened}"
    )


def _figures(docstring: str) -> list[str]:
    prose = re.sub(r"``.*?``", "", docstring, flags=re.S)
    return [m.group().strip() for m in MEASURED_FIGURE.finditer(prose)]


def test_no_docstring_quotes_a_measured_figure():
    found, quoting = [], set()
    for module, line, text in _docstrings():
        if figures := _figures(text):
            quoting.add(module)
            found += [f"{module}:{line}: {f!r}" for f in figures if module not in FIGURES_ALLOWED]
    assert not found, "measured figures in docstrings (they belong in docs/PERFORMANCE.md): " + "; ".join(
        found
    )
    assert FIGURES_ALLOWED <= quoting, (
        f"no figures left: take out of FIGURES_ALLOWED: {FIGURES_ALLOWED - quoting}"
    )
