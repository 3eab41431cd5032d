"""``hsextract regenerate`` through click's CliRunner: option errors in one line before any request, the checks
of the servers, and a whole job against a loopback server that answers at once (the real server's scenarios are
in tests/scenarios/test_regenerate.py)."""

import json
import time

import pytest
from click.testing import CliRunner
from support.chat_servers import InstantServer

from hsextract.cli import main
from hsextract.regenerate.config import RegenerateConfig
from hsextract.regenerate.ledger import Ledger


@pytest.fixture
def server():
    s = InstantServer(model="org/model")
    yield s
    s.stop()


@pytest.fixture
def data(tmp_path):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(23)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _regenerate(*args, env=None):
    return CliRunner().invoke(main, ["regenerate", "--no-progress", *map(str, args)], env=env)


def _args(server, data, out, *extra):
    return ["--endpoint", server.url, "--served-model", "org/model", "--data", data, "--output", out, *extra]


REQUIRED_REST = ["--served-model", "m", "--data", "x", "--output", "o"]
"""The required options besides --endpoint; each case adds the one it gets wrong."""


def _options(*extra, endpoint="http://h"):
    return ["--endpoint", endpoint, *REQUIRED_REST, *extra]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "x.jsonl"], "missing --endpoint, --served-model, --output"),
        (_options(endpoint="gpu-node:8000"), "not an http"),
        (_options(endpoint="http://u:secret@h/v1"), "--api-key-env"),
        (
            ["--endpoint", "http://h/v1", "--endpoint", "http://h/v1/", *REQUIRED_REST],
            "the same server twice",
        ),
        (_options("--chat-template-kwargs", "[1]"), "must be a JSON object"),
        (_options("--chat-template-kwargs", '{"tools": []}'), "set by each rendering itself"),
        (_options("--api-key-env", "sk-abc.def"), "NAME of an environment variable"),
        (_options("--api-key-env", "HSX_UNSET_KEY"), "HSX_UNSET_KEY: the variable is not set"),
        (["--endpoint", "http://h", "--served-model", "m", "--data", "x?limit=0", "--output", "o"], "limit"),
    ],
)
def test_option_errors_are_one_line(args, message):
    result = _regenerate(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert "secret" not in result.output


def test_a_server_that_refuses_connections_fails_in_seconds(data, tmp_path):
    started = time.monotonic()
    result = _regenerate(
        "--endpoint",
        "http://127.0.0.1:9/v1",
        "--served-model",
        "m",
        "--data",
        data,
        "--output",
        tmp_path / "out",
    )
    assert result.exit_code == 2 and "refuses connections" in result.output, result.output
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "given, base",
    [
        ("http://h:8000/v1/chat/completions", "http://h:8000/v1"),
        ("http://h:8000/v1/chat/completions/", "http://h:8000/v1"),
        ("https://h/openai/v1/models", "https://h/openai/v1"),
        ("http://h:8000", "http://h:8000/v1"),
        ("http://h:8000/v1/", "http://h:8000/v1"),
    ],
)
def test_an_endpoint_is_taken_as_its_base_url_or_its_full_path(given, base):
    assert RegenerateConfig(endpoint=given, served_model="m", data="x", output="o").endpoint == (base,)


def test_the_full_chat_completions_url_works_as_the_endpoint(server, data, tmp_path):
    result = _regenerate(
        "--endpoint",
        server.url + "/chat/completions",
        "--served-model",
        "org/model",
        "--data",
        data,
        "--output",
        tmp_path / "out",
    )
    assert result.exit_code == 0 and "wrote 23 rows" in result.output, result.output
    assert server.requests == 23


def test_a_404_on_models_names_the_url_tried_and_what_was_expected(server, data, tmp_path):
    wrong = server.url.removesuffix("/v1") + "/api"
    result = _regenerate(
        "--endpoint", wrong, "--served-model", "org/model", "--data", data, "--output", tmp_path / "out"
    )
    assert result.exit_code == 2, result.output
    assert f"GET {wrong}/models answered 404" in result.output and "base URL" in result.output
    assert server.requests == 0


def test_a_model_the_server_does_not_serve_is_refused_listing_what_it_serves(server, data, tmp_path):
    result = _regenerate(
        "--endpoint", server.url, "--served-model", "org/other", "--data", data, "--output", tmp_path / "out"
    )
    assert result.exit_code == 2 and "lists org/model" in result.output, result.output
    assert server.requests == 0


def test_a_refused_key_stops_before_any_request_naming_the_variable(server, data, tmp_path):
    server.status = 401
    result = _regenerate(
        *_args(server, data, tmp_path / "out", "--api-key-env", "HSX_KEY"), env={"HSX_KEY": "sk-very-secret"}
    )
    assert result.exit_code == 2 and "$HSX_KEY" in result.output and "sk-very-secret" not in result.output
    assert server.requests == 0


def test_a_job_writes_every_row_once_and_a_rerun_requests_nothing(server, data, tmp_path):
    out = tmp_path / "out"
    result = _regenerate(
        *_args(
            server,
            data,
            out,
            "--chunk-rows",
            "7",
            "--concurrency",
            "5",
            "--seed",
            "3",
            "--chat-template-kwargs",
            '{"enable_thinking": true}',
        )
    )
    assert result.exit_code == 0, result.output
    assert "wrote 23 rows in 4 chunk(s)" in result.output
    assert server.requests == 23
    done = Ledger(str(out)).done()
    assert done.written == {f"c{i}" for i in range(23)} and done.chunks == 4
    record = json.loads((out / "regenerate.json").read_text())
    assert record["settings"]["request"] == {"seed": 3, "chat_template_kwargs": {"enable_thinking": True}}
    assert record["served"]["model"] == "org/model"
    again = _regenerate(
        *_args(
            server,
            data,
            out,
            "--chunk-rows",
            "7",
            "--concurrency",
            "50",
            "--seed",
            "3",
            "--chat-template-kwargs",
            '{"enable_thinking":true}',
        )
    )
    assert again.exit_code == 0 and "23 already in the output" in again.output, again.output
    assert server.requests == 23
    other = _regenerate(*_args(server, data, out, "--seed", "4"))
    assert other.exit_code == 2 and "--seed 3 -> 4" in other.output


def test_max_samples_requests_the_first_rows_and_a_rerun_without_it_the_rest(server, data, tmp_path):
    out = tmp_path / "out"
    first = CliRunner().invoke(
        main, ["regenerate", *map(str, _args(server, data, out, "--max-samples", "5"))]
    )
    assert first.exit_code == 0 and "wrote 5 rows" in first.output, first.output
    assert "--max-samples 5" in first.output and "regenerate:" in first.output  # the progress bar's label
    assert server.requests == 5 and Ledger(str(out)).done().written == {f"c{i}" for i in range(5)}
    rest = _regenerate(*_args(server, data, out))
    assert rest.exit_code == 0 and "5 already in the output" in rest.output and server.requests == 23


def test_help_says_the_chunks_are_compressed_json_lines():
    text = " ".join(CliRunner().invoke(main, ["regenerate", "--help"]).output.split())
    assert "JSON lines (one row each) compressed as .jsonl.zst" in text and "--max-samples" in text


def test_options_come_from_a_yaml_file_too(server, data, tmp_path):
    config = tmp_path / "regen.yaml"
    config.write_text(
        f"endpoint: [{server.url}]\nserved-model: org/model\ndata:\n  - path: {data}\n    limit: 5\n"
        f"output: {tmp_path / 'out'}\nchat_template_kwargs: {{enable_thinking: false}}\nmax_tokens: 16\n"
    )
    result = _regenerate("--config", config, "--temperature", "0.5")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "regenerate.json").read_text())
    assert record["settings"]["request"] == {
        "max_tokens": 16,
        "temperature": 0.5,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert server.requests == 5
    (tmp_path / "bad.yaml").write_text("layers: dflash\n")
    assert "unknown option 'layers'" in _regenerate("--config", tmp_path / "bad.yaml").output


def test_a_key_refused_mid_run_stops_every_request_at_once(server, data, tmp_path):
    server.chat_status = 403  # /v1/models answers; the chat requests are refused
    result = _regenerate(
        *_args(server, data, tmp_path / "out", "--api-key-env", "HSX_KEY", "--concurrency", "4"),
        env={"HSX_KEY": "sk-very-secret"},
    )
    assert result.exit_code == 2, result.output
    assert (
        "refused the API key in $HSX_KEY (HTTP 403)" in result.output
        and "sk-very-secret" not in result.output
    )
    assert server.requests <= 4  # the requests already in flight, and no row after them


@pytest.mark.slow  # 2-3 s: the fast tier's budget (60 s on 2 cores)
@pytest.mark.usefixtures("aws_test_env")
def test_an_s3_output_is_written_resumed_and_read_as_its_chunks(server, data, tmp_path, s3, s3_bucket):
    from hsextract.prepare.sources import resolve_sources

    out = f"s3://{s3_bucket}/regen"
    args = _args(
        server, data, out, "--chunk-rows", "10", "--s3-endpoint-url", s3.url, "--compression", "gzip"
    )
    assert _regenerate(*args).exit_code == 0
    keys = s3.object_keys(s3_bucket)
    assert "regen/regenerate.json" in keys and "regen/chunk-000002.jsonl.gz" in keys
    again = _regenerate(*args)
    assert again.exit_code == 0 and "23 already in the output" in again.output and server.requests == 23
    mix = resolve_sources(out, cache_dir=tmp_path / "cache", s3_endpoint_url=s3.url)
    assert sorted(r["id"] for _, _, r in mix.rows()) == sorted(f"c{i}" for i in range(23))  # records not read
    assert mix.describe()[0]["identity"]["regenerated"]["settings"]["served_model"] == "org/model"


def test_a_rerun_redoes_a_damaged_chunk_says_so_and_every_row_is_there_once(server, data, tmp_path):
    from hsextract.prepare.sources import resolve_sources

    out = tmp_path / "out"
    args = _args(server, data, out, "--chunk-rows", "10")
    assert _regenerate(*args).exit_code == 0 and server.requests == 23
    chunk = out / "chunk-000001.jsonl.zst"
    chunk.write_bytes(chunk.read_bytes()[:-7])  # cut short: only regenerate's check can tell before run
    again = _regenerate(*args)
    assert again.exit_code == 0, again.output
    assert (
        "output: chunk-000001.jsonl.zst: its 199 bytes are not the 206" in again.output
        and "set aside" in again.output
    )
    assert "13 already in the output" in again.output and server.requests == 33
    ids = [r["id"] for _, _, r in resolve_sources(str(out)).rows()]
    assert sorted(ids) == sorted(f"c{i}" for i in range(23))


def test_a_reply_not_to_store_fails_its_row_with_the_reason_and_the_rerun_asks_it_again(
    server, data, tmp_path
):
    from support.chat_servers import FaultProxy

    from hsextract.prepare.sources import resolve_sources

    proxy = FaultProxy(server.url)
    try:
        proxy.plant("reply", None, match='"q3"', message={"role": "user"})
        args = _args(proxy, data, tmp_path / "out", "--max-retries", "1")
        result = _regenerate(*args)
        assert result.exit_code == 1, result.output
        assert "failed: 1 rows (1 bad reply (reply of role 'user', not assistant) (2 tries))" in result.output
        ids = {r["id"] for _, _, r in resolve_sources(str(tmp_path / "out")).rows()}
        assert ids == {f"c{i}" for i in range(23)} - {"c3"}
        proxy.clear()
        again = _regenerate(*args)
        assert again.exit_code == 0 and "22 already in the output" in again.output, again.output
        assert proxy.seen == ["q3"]
    finally:
        proxy.stop()


KEY = "sk-proj-Zq81x0PLk2"


def test_a_refusal_that_echoes_the_key_is_printed_without_it(server, data, tmp_path):
    server.chat_status = 400
    result = _regenerate(
        *_args(server, data, tmp_path / "out", "--api-key-env", "HSX_KEY"), env={"HSX_KEY": KEY}
    )
    assert result.exit_code == 2, result.output
    assert "refused the first 20 requests (HTTP 400: refused (Authorization: Bearer ***))" in result.output
    assert KEY not in result.output and "Zq81x0" not in result.output


@pytest.mark.parametrize("given", ["sk_live_Zq81x0PLk2", "ABCDEF0123456789ABCDEF", "Zq81x0PLk2Zq81x0PLk2"])
def test_the_key_given_as_the_variables_name_is_refused_without_showing_it(server, data, tmp_path, given):
    result = _regenerate(*_args(server, data, tmp_path / "out", "--api-key-env", given))
    assert result.exit_code == 2 and "NAME of an environment variable" in result.output, result.output
    assert given not in result.output and "may be the key itself" in result.output
    assert server.requests == 0


@pytest.mark.parametrize("key", [KEY + "\n", "sk-\r\nX-Other: 1", KEY + "\x1b"])
def test_a_key_with_a_line_break_is_one_message_without_the_key(server, data, tmp_path, key):
    result = _regenerate(
        *_args(server, data, tmp_path / "out", "--api-key-env", "HSX_KEY"), env={"HSX_KEY": key}
    )
    assert result.exit_code == 2, result.output
    assert "the key in $HSX_KEY holds a" in result.output and "Traceback" not in result.output
    assert key.strip() not in result.output and not (tmp_path / "out").exists()


def _data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}]})
    )
    (tmp_path / "link").symlink_to(tmp_path / "d")


@pytest.mark.parametrize(
    "data_at, output_at, relation",
    [
        ("d", "d", "is the place of"),
        ("d", "d/regen", "is inside"),
        ("d/x.jsonl", "d", "holds"),
        ("d/*.jsonl", "d", "is the place of"),
        ("d/**/*.jsonl.gz", "d/sub/regen", "is inside"),
        ("d/../d/x.jsonl", "d/.", "holds"),
        ("link", "d/regen", "is inside"),  # the data through a symbolic link to d
        ("s3://b/mix", "s3://b/mix/regen", "is inside"),
    ],
)
def test_an_output_overlapping_the_data_is_refused_before_any_request(
    server, tmp_path, monkeypatch, data_at, output_at, relation
):
    _data_dir(tmp_path, monkeypatch)
    result = _regenerate(*_args(server, data_at, output_at, "--restart"))
    assert result.exit_code == 2, result.output
    assert f"--output {output_at} {relation} --data {data_at}: regenerate would read its own" in result.output
    assert server.requests == 0 and (tmp_path / "d" / "x.jsonl").exists() and result.output.count("\n") == 1


@pytest.mark.parametrize(
    "data_at, output_at",
    [("d/*.jsonl", "d/regen"), ("d", "e"), ("s3://b/mix", "s3://b/mixed"), ("hf:org/name", "d")],
)
def test_an_output_apart_from_the_data_is_taken(tmp_path, monkeypatch, data_at, output_at):
    from hsextract.regenerate.config import RegenerateConfig

    _data_dir(
        tmp_path, monkeypatch
    )  # a glob that does not recurse does not reach the output beside its files
    cfg = RegenerateConfig(endpoint="http://h", served_model="m", data=data_at, output=output_at)
    assert cfg.output == output_at


def test_run_refuses_replies_regenerated_under_other_template_arguments(
    server, data, tmp_path, tiny_model, restored_process_state
):
    from support.cli import TINY_LIMITS, cli_run_args

    regen = tmp_path / "regen"
    made = _regenerate(*_args(server, data, regen, "--chat-template-kwargs", '{"enable_thinking": false}'))
    assert made.exit_code == 0, made.output
    args = cli_run_args(tmp_path, tiny_model, regen, num_proc=1, no_progress=True, **TINY_LIMITS)
    run = CliRunner().invoke(main, [*map(str, args), "--chat-template-kwargs", '{"enable_thinking": true}'])
    assert run.exit_code == 2, run.output
    said = " ".join(run.stderr.split())
    assert 'regenerated with chat_template_kwargs {"enable_thinking": false}' in said, said
    assert 'this run renders with {"enable_thinking": true}' in said
    assert """pass --chat-template-kwargs '{"enable_thinking": false}'""" in said
    assert not (tmp_path / "run" / "plan.json").exists()
    bare = CliRunner().invoke(main, list(map(str, args)))  # no arguments at all: refused the same way
    assert bare.exit_code == 2 and "this run renders with {}" in bare.stderr, bare.output


def test_regenerated_sources_of_different_template_arguments_cannot_share_a_run():
    from hsextract.errors import HsextractError
    from hsextract.prepare.rows import check_regenerated_rendering

    def source(name, kwargs):
        request = {"chat_template_kwargs": kwargs} if kwargs else {}
        return {"name": name, "source": name, "identity": {"regenerated": {"settings": {"request": request}}}}

    plain = {"name": "raw", "source": "raw.jsonl", "identity": {}}
    check_regenerated_rendering([plain, source("a", {"enable_thinking": True})], {"enable_thinking": True})
    check_regenerated_rendering([plain, source("a", None)], {})
    with pytest.raises(HsextractError, match="leave --chat-template-kwargs out"):
        check_regenerated_rendering([source("a", None)], {"enable_thinking": False})
    with pytest.raises(HsextractError, match="in separate runs"):
        check_regenerated_rendering([source("a", {"x": 1}), source("b", {"x": 2})], {"x": 1})
