"""``hsextract status --serve`` against a real run on CPU: the page in a real headless browser, ``/metrics`` read by
prometheus-client's own parser, ``/api/status`` equal to ``status --json``; live, finished, and with a damaged
progress file.

One run serves every test. It is pinned live, not raced: once shard 1 has uploaded a batch its worker is frozen
with SIGSTOP (a stopped process still counts as alive), shard 0 runs to the end, and everything "live" is looked at
then; SIGCONT lets the run finish for the "finished" views.

The browser is Debian's Chromium (``scripts/setup.sh --test`` installs it). Without it the browser tests skip on a
developer's machine and fail under CI. ``HSEXTRACT_STATUS_SCREENSHOT=docs/status-page.png`` also copies the live
page's screenshot there (the README's picture).
"""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cli import (
    cli_run_args,
    done_count,
    launched,
    launcher_output,
    run_cli,
    wait_for,
    write_mixed_dataset,
)

from hsextract.output import Plan
from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LIVE_STATES = {"starting", "loading", "waiting-for-kernels", "running", "waiting-for-uploader", "draining"}


# -- helpers --------------------------------------------------------------------------------------------------------
@contextmanager
def served(run_dir: Path, root: Path):
    """``hsextract status RUN_DIR --serve --port 0`` in the background; yields its URL once it listens."""
    root.mkdir(exist_ok=True)
    with launched(["status", run_dir, "--serve", "--port", "0"], root) as proc:

        def url():
            text = launcher_output(root)
            return text.split(" at ", 1)[1].split()[0] if " at http" in text else None

        yield wait_for(url, "the server's URL", proc=proc, root=root, timeout=60)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def need_browser() -> None:
    if chromium() is None:
        if os.environ.get("CI"):
            pytest.fail(
                "chromium is not installed; scripts/setup.sh --test installs it (apt-get install chromium)"
            )
        pytest.skip("chromium is not installed (apt-get install chromium)")


def browse(url: str, tmp: Path, screenshot: Path | None = None) -> str | None:
    """The DOM after the page loaded in headless Chromium (None without one); with ``screenshot``, also a PNG."""
    exe = chromium()
    if exe is None:
        return None
    base = [
        exe,
        "--headless",
        "--no-sandbox",  # tests run as root in CI
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,1120",
        f"--user-data-dir={tmp / 'chromium-profile'}",
    ]
    if screenshot is not None:
        subprocess.run(
            [*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True
        )
    r = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True)
    return r.stdout


def metrics(url: str) -> dict[str, list]:
    """Samples of ``/metrics`` by family name, parsed by prometheus-client itself."""
    status, text = get(url + "metrics")
    assert status == 200
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def by_shard(samples, **labels) -> dict[int, float]:
    return {
        int(s.labels["shard"]): s.value
        for s in samples
        if "shard" in s.labels and all(s.labels.get(k) == v for k, v in labels.items())
    }


# -- the run --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seen(tmp_path_factory, tiny_model, tiny_tokenizer):
    """What the server, the CLI and the browser showed at each stage of one run. The run gives neither --run-dir
    nor --num-proc: it also shows that the defaults work and that rerunning the same command resumes."""
    root = tmp_path_factory.mktemp("serve")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=40)
    args = cli_run_args(
        root,
        tiny_model,
        data,
        run_dir=None,
        layers="0,3,7",
        shards=2,
        max_tokens_per_batch=300,
        max_rows=4,
        max_length=300,
        no_progress=True,
    )
    seen: dict = {"root": root}
    with launched(args, root, cwd=root) as run:

        def announced_run_dir():
            lines = launcher_output(root).splitlines()
            return next((Path(ln.split()[2]) for ln in lines if ln.startswith("run dir: ")), None)

        seen["run_dir"] = run_dir = wait_for(announced_run_dir, "the run dir", proc=run, root=root)
        wait_for(lambda: RunDir(run_dir).is_run_dir(), "the plan", proc=run, root=root)
        with served(run_dir, root / "server") as url:
            plan = Plan.load(RunDir(run_dir).plan_file)

            def progress_of(shard, state):
                p = ShardProgress.load(run_dir, shard)
                return p.pid if p is not None and p.state == state else None

            def settled(shard):  # no record for a second: the frozen worker's uploader has finished its queue
                before = done_count(run_dir, shard)
                time.sleep(1.0)
                return done_count(run_dir, shard) == before

            # Frozen, as the crash tests do it, once two of its batches are durable: the worker lives, idle.
            wait_for(lambda: done_count(run_dir, 1) >= 2, "shard 1's second batch", proc=run, root=root)
            pid = ShardProgress.load(run_dir, 1).pid
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(lambda: progress_of(0, "done"), "shard 0 to finish", proc=run, root=root)
                wait_for(lambda: settled(1), "shard 1's uploads to settle", proc=run, root=root)
                assert done_count(run_dir, 1) < len(plan.for_shard(1))
                seen["live_api"] = json.loads(get(url + "api/status")[1])
                seen["live_cli"] = json.loads(run_cli("status", run_dir, "--json", timeout=60).stdout)
                seen["live_metrics"] = metrics(url)
                seen["live_page"] = get(url)
                seen["live_history"] = json.loads(get(url + "api/history")[1])
                shot = root / "live.png"
                seen["live_dom"] = browse(url, root, screenshot=shot)
                if seen["live_dom"] is not None and os.environ.get("HSEXTRACT_STATUS_SCREENSHOT"):
                    shutil.copyfile(shot, os.environ["HSEXTRACT_STATUS_SCREENSHOT"])
                seen["live_png"] = shot.read_bytes() if shot.exists() else b""
            finally:
                os.kill(pid, signal.SIGCONT)
            assert run.wait(timeout=180) == 0, launcher_output(root)
            seen["done_api"] = json.loads(get(url + "api/status")[1])
            seen["done_metrics"] = metrics(url)

            damaged = '{"shard": 1, "state": "runn'  # cut short, as by a full disk
            RunDir(run_dir).progress_file(1).write_text(damaged)
            seen["damaged_page"] = get(url)
            seen["damaged_dom"] = browse(url, root)
            seen["damaged_metrics"] = metrics(url)
            seen["damaged_cli"] = run_cli("status", run_dir, timeout=60)
    seen["run_log"] = launcher_output(root)
    rerun = run_cli(*args, cwd=root, check=False)
    seen["rerun_rc"], seen["rerun_log"] = rerun.returncode, rerun.stdout + rerun.stderr
    return seen


# -- live -----------------------------------------------------------------------------------------------------------
def test_api_status_is_the_document_status_json_prints(seen):
    api, cli = seen["live_api"], seen["live_cli"]
    assert api.keys() == cli.keys() >= {"complete", "shards", "totals", "plan"}
    moving = {"progress_age_s", "upload_lag_s", "updated_at", "gpu"}
    for a, c in zip(api["shards"], cli["shards"], strict=True):
        assert {k: v for k, v in a.items() if k not in moving} == {
            k: v for k, v in c.items() if k not in moving
        }
    assert api["plan"] == cli["plan"]


def test_live_status_shows_one_shard_running_and_one_done(seen):
    shard0, shard1 = seen["live_api"]["shards"]
    assert shard0["state"] == "done" and shard0["batches_done"] == shard0["batches_total"]
    assert shard1["state"] in LIVE_STATES and 1 <= shard1["batches_done"] < shard1["batches_total"]
    assert shard1["progress_age_s"] is not None and shard1["uploads_waiting"] is not None
    assert not seen["live_api"]["complete"]
    plan = seen["live_api"]["plan"]
    assert [layer["id"] for layer in plan["layers"]] == [0, 3, 7]
    assert plan["layers"][0]["hf_output_hidden_states_index"] == 1
    assert plan["data_report"]["rows"] == plan["data_report"]["kept"] == plan["samples"]


def test_metrics_parse_and_agree_with_the_status(seen):
    m, api = seen["live_metrics"], seen["live_api"]
    rows = {r["shard"]: r for r in api["shards"]}
    assert by_shard(m["hsextract_tokens_done"]) == {s: r["tokens_done"] for s, r in rows.items()}
    assert by_shard(m["hsextract_planned_tokens"]) == {s: r["tokens_total"] for s, r in rows.items()}
    assert by_shard(m["hsextract_batches_done"]) == {s: r["batches_done"] for s, r in rows.items()}
    assert by_shard(m["hsextract_shard_failed"]) == {0: 0, 1: 0}
    assert by_shard(m["hsextract_shard_state"], hsextract_shard_state="done") == {0: 1, 1: 0}
    assert by_shard(m["hsextract_shard_state"], hsextract_shard_state=rows[1]["state"]) == {0: 0, 1: 1}
    assert m["hsextract_status_up"][0].value == 1
    assert m["hsextract_run_complete"][0].value == 0
    assert m["hsextract_run_info"][0].labels["layer_ids"] == "0,3,7"
    assert {s.labels["run"] for s in m["hsextract_tokens_done"]} == {seen["run_dir"].name}


def test_workers_record_a_rate_history_that_the_page_charts(seen):
    history = seen["live_history"]
    assert set(history) == {"0", "1"}
    for points in history.values():
        assert len(points) >= 2
        times = [p[0] for p in points]
        assert times == sorted(times)
        assert [p[1] for p in points] == sorted(p[1] for p in points)  # tokens done never go down
    assert history["0"][-1][1] == seen["live_api"]["shards"][0]["tokens_total"]


def test_page_in_a_browser_shows_each_shard_and_the_charts(seen):
    status, _ = seen["live_page"]
    assert status == 200
    need_browser()
    dom = seen["live_dom"]
    assert 'data-shard="0" data-state="done"' in dom
    assert 'data-shard="1" data-state="running"' in dom
    assert 'id="rate-chart"' in dom and 'class="series" data-series="total"' in dom
    assert 'data-series="shard 1"' in dom and 'id="staging-chart"' in dom
    assert 'id="layers"' in dom and "output of decoder layer 7" in dom
    assert seen["live_png"][:8] == b"\x89PNG\r\n\x1a\n" and len(seen["live_png"]) > 20_000


# -- finished, damaged ----------------------------------------------------------------------------------------------
def test_finished_run_reads_complete(seen):
    api, m = seen["done_api"], seen["done_metrics"]
    assert api["complete"]
    assert {r["state"] for r in api["shards"]} == {"done"}
    assert api["totals"]["tokens_done"] == api["totals"]["tokens_total"] == api["plan"]["tokens"]
    assert m["hsextract_run_complete"][0].value == 1


def test_damaged_progress_file_shows_on_the_page_without_breaking_it(seen):
    status, page = seen["damaged_page"]
    assert status == 200 and "progress file damaged: " in page and "shard-00001.json: not JSON" in page
    assert by_shard(seen["damaged_metrics"]["hsextract_progress_file_damaged"]) == {0: 0, 1: 1}
    assert seen["damaged_cli"].returncode == 0  # the plain table still answers, from the output
    need_browser()
    dom = seen["damaged_dom"]
    assert 'data-shard="0"' in dom and 'data-shard="1"' in dom
    assert "shard-00001.json: not JSON" in dom and 'class="state damaged"' in dom


def test_serve_refuses_a_directory_that_is_not_a_run(tmp_path):
    r = run_cli("status", tmp_path, "--serve", "--port", "0", check=False, timeout=60)
    assert r.returncode == 2 and "not an hsextract run directory" in r.stderr


def test_run_without_run_dir_derives_one_and_the_same_command_resumes_there(seen):
    run_dir, root = seen["run_dir"], seen["root"]
    assert run_dir.parent == root / "runs" and run_dir.name.startswith("out-")
    assert seen["rerun_rc"] == 0, seen["rerun_log"]
    assert f"run dir: {run_dir}" in seen["rerun_log"]
    assert "shards already complete: [0, 1]" in seen["rerun_log"]
