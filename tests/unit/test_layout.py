"""The package's shape: the light processes import no torch, and no module imports another in a circle."""

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
