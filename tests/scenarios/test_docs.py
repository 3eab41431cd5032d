"""Every python block of README.md and docs/*.md runs as pasted against what ``hsextract demo`` writes (./demo).

Each block runs alone in a fresh interpreter, in a directory holding a demo output built once (fewer
conversations than the demo's default, the same job). A bash block runs only when the doc marks it
``<!-- doc-test: run -->`` (a step a python block needs, as the index-only export). A block marked
``<!-- doc-test: skip: why -->`` would be skipped, but none may be: a reader never sees the comment. The demo's own
output is checked too: the command it says it runs, and `--config demo/run/config.json`, repeat its job.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<mark>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.S)


def doc_blocks() -> list:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            mark, lang = (m["mark"] or "").strip(), m["lang"]
            if lang == "python" or (lang == "bash" and mark == "run"):
                line = text[: m.start("code")].count("\n") + 1
                name = f"{doc.relative_to(ROOT)}:{line}"
                marks = [pytest.mark.skip(reason=mark[5:].strip(" :"))] if mark.startswith("skip") else []
                blocks.append(pytest.param(lang, m["code"], id=name, marks=marks))
    return blocks


BLOCKS = doc_blocks()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """A directory whose ./demo is what `hsextract demo` writes (60 conversations: the docs' ids are in it), and in
    which the marked bash blocks have run, in doc order."""
    here = tmp_path_factory.mktemp("docs")
    demo = run_cli("demo", "--conversations", 60, cwd=here, timeout=900).stdout
    # The demo says the command it runs, and the shorter one that repeats it: both find its job complete.
    command = re.search(r"^running: (hsextract run .*)$", demo, re.M)
    assert command and "--config demo/run/config.json` repeats it" in demo, demo
    for again in (shlex.split(command[1])[1:], ["run", "--config", "demo/run/config.json"]):
        out = run_cli(*again, cwd=here).stdout
        assert "shards already complete: [0, 1]" in out and "done: 60 samples" in out, out
    for param in BLOCKS:
        lang, code = param.values
        if lang == "bash":
            _run(lang, code, here)
    return here


def _run(lang: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the block failed as pasted:\n{code}\n--- output ---\n{r.stdout}\n{r.stderr}"
    return r


def test_the_docs_say_to_use_the_venv_before_the_bare_commands_they_show():
    """The README's first command runs `.venv/bin/hsextract`; what follows says `hsextract`, and a bare `pytest` picks
    whatever install is first on PATH: the README says to activate the venv before the first bare command, and no
    doc runs a bare `pytest`."""
    readme = (ROOT / "README.md").read_text()
    bare = re.search(r"^hsextract ", readme, re.M)
    assert bare and "source .venv/bin/activate" in readme[: bare.start()]
    for doc in DOCS:
        assert not re.findall(r"(?:^|`)pytest -", doc.read_text(), re.M), doc.name


def test_the_docs_have_python_blocks_to_run_and_skip_none_where_a_reader_cannot_see_why():
    assert sum(1 for p in BLOCKS if p.values[0] == "python") >= 10
    # A skip mark is an HTML comment: the rendered page hides it. A block that cannot run here says so in its text.
    assert [p.id for p in BLOCKS if p.marks] == []


@pytest.mark.parametrize(("lang", "code"), BLOCKS)
def test_doc_block_runs_as_pasted_against_the_demo_output(lang, code, demo_dir):
    _run(lang, code, demo_dir)
