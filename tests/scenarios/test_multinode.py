"""Several nodes, one job: separate launcher processes, each with its own run dir, staging and one CPU shard,
writing one S3 output on a loopback SeaweedFS server, as SLURM would start them (one ``srun`` task per node)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import TINY_LIMITS, cli_run_args, launched, wait_for, write_mixed_dataset
from support.s3server import cli_env

from hsextract.demo import make_conversations
from hsextract.errors import HsextractError
from hsextract.output import open_output
from hsextract.output.manifest import MANIFEST
from hsextract.output.records import JOB
from hsextract.prepare.publish import LEASE as PREPARE_LEASE
from hsextract.prepare.publish import RECORD as PREPARE_RECORD
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.cluster import node_place

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_test_env"), pytest.mark.timeout(900)]

SHARDS_PER_NODE = 1


def uploaded_count(run_dir: Path) -> int:
    """Batches a node's uploaders logged as uploaded and recorded (its output is on S3)."""
    return sum(p.read_text().count("uploaded shard-") for p in (run_dir / "logs").glob("*.uploader.log"))


def node_args(root: Path, model, data, output: str, endpoint: str, **options) -> list[str]:
    opts = {
        **TINY_LIMITS,
        "max_tokens_per_batch": 300,
        "max_rows": 8,
        "layers": "0,3,7",
        "shards": SHARDS_PER_NODE,
        "num_proc": 1,
        "no_progress": True,
        "output": output,
        "s3_endpoint_url": endpoint,
        **options,
    }
    return list(map(str, cli_run_args(root, model, data, **opts)))


def hsextract(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
    )


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    return {
        key[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=key)["Body"].read()
        for key in s3.object_keys(bucket)
        if key.startswith(prefix + "/")
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    return write_mixed_dataset(
        tmp_path_factory.mktemp("multinode-data") / "data.jsonl", tiny_tokenizer, n_chat=60
    )


def test_two_nodes_one_killed_and_rerun_alone_give_the_one_node_output(
    tmp_path, tiny_model, dataset, s3, s3_bucket
):
    endpoint = s3.url
    # The reference: the same plan (2 shards) on one node.
    ref = hsextract(
        *node_args(tmp_path / "one", tiny_model, dataset, f"s3://{s3_bucket}/one", endpoint, shards=2)
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr

    output = f"s3://{s3_bucket}/two"
    n0 = node_args(tmp_path / "node0", tiny_model, dataset, output, endpoint, nodes=2, node_rank=0)
    n1 = node_args(tmp_path / "node1", tiny_model, dataset, output, endpoint)  # rank and count from SLURM
    slurm = cli_env(SLURM_NNODES="2", SLURM_NODEID="1")
    for root in (tmp_path / "node0", tmp_path / "node1"):
        root.mkdir()
    with (
        launched(n1, tmp_path / "node1", env=slurm) as p1,
        launched(n0, tmp_path / "node0", env=cli_env()) as p0,
    ):
        wait_for(
            lambda: uploaded_count(tmp_path / "node1" / "run") >= 1,
            "node 1's first batch",
            proc=p1,
            root=tmp_path / "node1",
        )
        p1.send_signal(signal.SIGKILL)  # the node dies; its workers die with its launcher
        p1.wait(timeout=30)
        assert p0.wait(timeout=300) == 0, (tmp_path / "node0" / "launcher.out").read_text()
    node0_out = (tmp_path / "node0" / "launcher.out").read_text()
    assert "node 0 of 2 (--nodes/--node-rank): shard 0 of 2" in node0_out
    assert "still to do (shards [1])" in node0_out
    # Node 0 prepared once; node 1 took its tokens instead of tokenizing the data itself.
    assert "published the tokens" in node0_out, node0_out
    assert "took the tokens node 0 published" in (tmp_path / "node1" / "launcher.out").read_text()

    # Progress from the output alone, in a directory that holds nothing of the run.
    fresh = tmp_path / "elsewhere"
    fresh.mkdir()
    st = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "status", output, "--s3-endpoint-url", endpoint, "--json"],
        capture_output=True,
        text=True,
        cwd=fresh,
        env=cli_env(),
        timeout=120,
    )
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert not doc["complete"] and doc["nodes"] == 2
    assert [r["node"] for r in doc["shards"]] == [0, 1]
    assert doc["shards"][0]["state"] == "done"
    assert doc["shards"][1]["batches_done"] < doc["shards"][1]["batches_total"]

    # Node 1 rerun alone, with the same command and rank: only its unfinished batches are computed.
    again = hsextract(*n1, env=slurm)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "node 1 of 2 (SLURM_NNODES/SLURM_NODEID)" in again.stdout and "done:" in again.stdout
    log = (tmp_path / "node1" / "run" / "logs" / "shard-00001.log").read_text()
    assert "resume:" in log

    one, two = objects(s3, s3_bucket, "one"), objects(s3, s3_bucket, "two")
    batches = sorted(k for k in one if k.startswith("shard-"))
    assert batches == sorted(k for k in two if k.startswith("shard-")) and len(batches) > 2
    assert [k for k in batches if one[k] != two[k]] == [], "batch files differ from the one-node run"
    assert json.loads(one[MANIFEST]) == json.loads(two[MANIFEST])
    out = open_output(output, endpoint)
    assert sorted(out.sample_ids()) == sorted(open_output(f"s3://{s3_bucket}/one", endpoint).sample_ids())
    assert json.loads(hsextract("status", output, "--s3-endpoint-url", endpoint, "--json").stdout)["complete"]

    # A node started with other layers, or another node count, is refused, naming the job that holds the output.
    other = hsextract(
        *node_args(
            tmp_path / "node2", tiny_model, dataset, output, endpoint, nodes=2, node_rank=1, layers="1,3,7"
        )
    )
    assert other.returncode == 2 and "preparation of another job" in other.stderr, other.stderr
    assert "layer_ids: [0, 3, 7] -> [1, 3, 7]" in other.stderr
    wider = hsextract(
        *node_args(tmp_path / "node3", tiny_model, dataset, output, endpoint, nodes=3, node_rank=2)
    )
    assert wider.returncode == 2 and "preparation of another job" in wider.stderr
    assert "shards: 2 -> 3" in wider.stderr

    # `hsextract finalize OUTPUT` rebuilds the manifest from the output alone.
    s3.client().delete_object(Bucket=s3_bucket, Key=f"two/{MANIFEST}")
    fin = hsextract("finalize", output, "--s3-endpoint-url", endpoint)
    assert fin.returncode == 0 and "done:" in fin.stdout, fin.stdout + fin.stderr
    assert json.loads(objects(s3, s3_bucket, "two")[MANIFEST]) == json.loads(one[MANIFEST])
    assert json.loads(objects(s3, s3_bucket, "two")[JOB])["nodes"] == 2


def test_a_truncated_batch_of_node_0_is_named_by_node_1_and_recomputed_by_node_0_alone(
    tmp_path, tiny_model, dataset, s3, s3_bucket
):
    """Both nodes finished, then one of node 0's batch files truncated in the output: node 1's rerun names it and
    says whose command to rerun; node 0's rerun recomputes exactly that batch and the manifest verifies clean."""
    output, endpoint = f"s3://{s3_bucket}/job", s3.url
    nodes = [
        node_args(
            tmp_path / f"node{r}", tiny_model, dataset, output, endpoint, shards=1, nodes=2, node_rank=r
        )
        for r in (0, 1)
    ]
    for args in nodes:
        r = hsextract(*args)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "done:" in r.stdout, r.stdout
    client = s3.client()
    key = sorted(k for k in objects(s3, s3_bucket, "job") if k.startswith("shard-00000/"))[1]
    original = s3.get_object(s3_bucket, f"job/{key}")
    client.put_object(Bucket=s3_bucket, Key=f"job/{key}", Body=original[: len(original) // 2])

    by_node_1 = hsextract(*nodes[1])
    text = by_node_1.stdout + by_node_1.stderr
    assert by_node_1.returncode != 0 and "Traceback" not in text, text
    assert f"{key}: batch file has {len(original) // 2} bytes, {len(original)} were uploaded" in text, text
    assert "belong to other nodes' shards: rerun those nodes' commands" in text, text
    assert "manifest.json" not in objects(s3, s3_bucket, "job"), "a manifest over a damaged batch was left"

    by_node_0 = hsextract(*nodes[0])
    assert by_node_0.returncode == 0 and "done:" in by_node_0.stdout, by_node_0.stdout + by_node_0.stderr
    log = (tmp_path / "node0" / "run" / "logs" / "shard-00000.log").read_text()
    assert log.rstrip().splitlines()[-1].endswith("shard 0 done")
    resumed = [line for line in log.splitlines() if "resume:" in line][-1]
    assert resumed.endswith("0 staged to upload, 1 to compute"), resumed
    uploader_log = (tmp_path / "node0" / "run" / "logs" / "shard-00000.uploader.log").read_text()
    assert (
        uploader_log.count("uploaded shard-")
        == len([k for k in objects(s3, s3_bucket, "job") if k.startswith("shard-00000/")]) + 1
    ), "every batch of shard 0 once, and the damaged one once more"
    assert s3.get_object(s3_bucket, f"job/{key}") == original
    v = hsextract("verify", output, "--s3-endpoint-url", endpoint)
    assert v.returncode == 0 and "all good" in v.stdout, v.stdout + v.stderr


def test_node_0_killed_while_preparing_ends_node_1s_wait_and_a_rerun_of_both_completes(
    tmp_path, tiny_model, tiny_tokenizer, s3, s3_bucket
):
    """Node 0 SIGKILLed while it tokenizes: node 1, which waits for its published tokens, gives up within
    --prepare-wait saying what to rerun; the rerun of both nodes finishes the job, node 1 tokenizing nothing."""
    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer, n_chat=20)
    # Rows too long to keep, so that node 0 tokenizes for a few seconds while the job stays small.
    with open(data, "a") as f:
        for row in make_conversations(40, seed=7):
            system = {"role": "system", "content": " ".join(["the weather is sunny today"] * 100)}
            messages = [system] + [m for m in row["messages"] if m["role"] != "system"]
            f.write(json.dumps({**row, "id": "long-" + row["id"], "messages": messages}) + "\n")
    output, endpoint = f"s3://{s3_bucket}/job", s3.url
    wait_s = 30  # time for node 0 to start and write its lease after node 1 waits, under load
    args = [
        node_args(
            tmp_path / f"node{r}",
            tiny_model,
            data,
            output,
            endpoint,
            shards=1,
            nodes=2,
            node_rank=r,
            too_long="skip",
            prepare_wait=wait_s,
            max_tokens_per_batch=600,
            max_rows=16,
        )
        for r in (0, 1)
    ]
    for r in (0, 1):
        (tmp_path / f"node{r}").mkdir()
    cache0 = tmp_path / "node0" / "run" / "cache"
    with launched(args[1], tmp_path / "node1", env=cli_env(PYTHONUNBUFFERED="1")) as p1:
        # Node 0 starts once node 1 waits, so that node 1 sees node 0's lease appear (not one from before it started).
        wait_for(
            lambda: "waiting for node 0 to publish" in (tmp_path / "node1" / "launcher.out").read_text(),
            "node 1 waiting",
            proc=p1,
            root=tmp_path / "node1",
        )
        with launched(args[0], tmp_path / "node0", env=cli_env()) as p0:
            wait_for(
                lambda: list(cache0.glob("tokens-*.tmp")),
                "node 0 tokenizing",
                proc=p0,
                root=tmp_path / "node0",
            )
            p0.send_signal(signal.SIGKILL)
            p0.wait(timeout=30)
        in_output = objects(s3, s3_bucket, "job")
        assert PREPARE_LEASE in in_output and PREPARE_RECORD not in in_output, sorted(in_output)
        assert p1.wait(timeout=wait_s + 60) == 2
    said = (tmp_path / "node1" / "launcher.out").read_text()
    assert f"did not publish the prepared tokens and plan at {output}/hsextract/prepare/" in said, said
    assert "node 0 is preparing" in said and "if it stopped, rerun every node's command" in said, said
    assert "Traceback" not in said

    with launched(args[1], tmp_path / "node1", env=cli_env()) as p1:
        with launched(args[0], tmp_path / "node0", env=cli_env()) as p0:
            assert p0.wait(timeout=300) == 0, (tmp_path / "node0" / "launcher.out").read_text()
        assert p1.wait(timeout=300) == 0, (tmp_path / "node1" / "launcher.out").read_text()
    said = (tmp_path / "node1" / "launcher.out").read_text()
    assert "took the tokens node 0 published" in said and "done:" in said, said
    prepared = TokenizedSamples.load(tmp_path / "node0" / "run" / "tokens.safetensors")
    assert sorted(open_output(output, endpoint).sample_ids()) == sorted(prepared.sample_ids)
    assert not any(i.startswith("long-") for i in prepared.sample_ids) and len(prepared) > 20


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (1, 0, "single node")),
        ({"SLURM_NNODES": "8", "SLURM_NODEID": "3"}, (8, 3, "SLURM_NNODES/SLURM_NODEID")),
        (
            {"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "0"},
            (4, 0, "SLURM_ARRAY_TASK_COUNT/SLURM_ARRAY_TASK_ID"),
        ),
        ({"NNODES": "2", "NODE_RANK": "1"}, (2, 1, "NNODES/NODE_RANK")),
        (
            {"SLURM_NNODES": "8", "SLURM_NODEID": "3", "NNODES": "2", "NODE_RANK": "1"},
            (8, 3, "SLURM_NNODES/SLURM_NODEID"),
        ),
    ],
)
def test_node_rank_and_count_come_from_the_scheduler_environment(env, expected):
    place = node_place(environ=env)
    assert (place.nodes, place.rank, place.source) == expected


def test_command_line_wins_and_bad_ranks_are_refused():
    assert (
        node_place(2, 1, environ={"SLURM_NNODES": "8", "SLURM_NODEID": "3"}).source == "--nodes/--node-rank"
    )
    for nodes, rank in ((2, 2), (0, 0), (2, -1)):
        with pytest.raises(HsextractError, match="rank must be in"):
            node_place(nodes, rank, environ={})
    with pytest.raises(HsextractError, match="not integers"):
        node_place(environ={"NNODES": "two", "NODE_RANK": "0"})


def test_nodes_without_a_rank_take_it_from_the_scheduler_or_are_refused():
    """``--nodes 2`` without ``--node-rank`` under SLURM_NODEID=1 used to run as node 0."""
    slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    place = node_place(2, None, environ=slurm)
    assert (place.nodes, place.rank, place.source) == (2, 1, "SLURM_NNODES/SLURM_NODEID")
    with pytest.raises(HsextractError, match="--nodes 2 without --node-rank, and no scheduler variable"):
        node_place(2, None, environ={})
    with pytest.raises(HsextractError, match="--nodes 4 but SLURM_NNODES/SLURM_NODEID says 2 nodes"):
        node_place(4, None, environ=slurm)
    assert node_place(1, None, environ=slurm).rank == 0
