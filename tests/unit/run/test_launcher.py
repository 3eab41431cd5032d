"""One rate with one meaning: the launcher's bar and `hsextract status` show the shard's own rate from its progress
file (ShardProgress.tokens_per_s: tokens made durable per second of this session's forwards), where the bar showed
tqdm's rate beside it and status a third, computed over the whole session."""

import re
import time

from click.testing import CliRunner

from hsextract.cli import main
from hsextract.prepare.plan import make_plan
from hsextract.run.launcher import _Bars
from hsextract.run.progress import ShardProgress, rate_text
from hsextract.run.rundir import RunDir


def test_the_bar_and_status_show_the_shards_own_rate_and_no_other(tmp_path, capsys):
    plan = make_plan([100, 90, 80, 70], max_tokens_per_batch=200, max_rows=2, shards=1, fingerprint={"m": 1})
    run_dir = RunDir(tmp_path)
    plan.save(run_dir.plan_file)
    total = sum(b.num_tokens for b in plan.batches)
    now = time.time()
    p = ShardProgress(shard=0, state="running", pid=1, tokens_total=total, tokens_done=170)
    p.tokens_per_s, p.eta_s, p.started_at = 1666.4, 12.0, now - 600  # 10 min since start: load included
    p.save(run_dir)
    assert rate_text(p) == "running, 1,666 tok/s, eta 0m12s"
    bars = _Bars(run_dir, plan, [0], enabled=True)
    bars.update()
    p.state, p.tokens_done, p.eta_s = "done", total, None
    p.save(run_dir)
    bars.close()
    lines = [line for line in re.split(r"[\r\n]", capsys.readouterr().err) if "tok/s" in line]
    assert lines and re.search(rf"{total}/{total} \[\d\d:\d\d, done, 1,666 tok/s\]$", lines[-1]), lines
    assert all(line.count("tok/s") == 1 for line in lines), lines  # tqdm's own rate is gone

    out = CliRunner().invoke(main, ["status", str(tmp_path)], terminal_width=200).output
    row = next(line for line in out.splitlines() if re.match(r"\s+0\s+done\s", line))
    assert row.split()[4] == "1,666" and "took 10m00s" in row, out  # was tokens / wall time: 0
