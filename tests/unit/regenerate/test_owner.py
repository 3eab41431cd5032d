"""One ``hsextract regenerate`` process owns an output at a time (regenerate/owner.py): a second is refused at the
start in one line naming the first, before any request or any read of the output. Two real processes at once:
tests/scenarios/test_concurrent_runs.py."""

import json
import os
import socket

import pytest
from click.testing import CliRunner
from support.chat_servers import InstantServer

from hsextract.cli import main
from hsextract.errors import HsextractError
from hsextract.regenerate.owner import own_output


def test_an_output_owned_by_a_process_is_refused_to_a_second_naming_it_and_free_once_released(tmp_path):
    out = tmp_path / "regen"
    with own_output(str(out)):
        with pytest.raises(HsextractError) as e:
            own_output(f"{tmp_path}/./regen/")  # the same directory, spelled otherwise
        assert f"pid {os.getpid()} on {socket.gethostname()}" in str(e.value) and "\n" not in str(e.value)
        with own_output(str(tmp_path / "other")):  # another output is another owner's
            pass
    with own_output(str(out)):
        pass
    assert not out.exists()  # the lock lives in the user's cache, never in the output


def test_regenerate_on_an_owned_output_sends_no_request_and_writes_nothing(tmp_path):
    server = InstantServer(model="org/model")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "q"}]}) + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "regen"
    args = ["--endpoint", server.url, "--served-model", "org/model", "--data", data, "--output", out]
    try:
        with own_output(str(out)):
            result = CliRunner().invoke(main, ["regenerate", "--no-progress", *map(str, args)])
        assert result.exit_code == 2, result.output
        assert "is being written by another hsextract regenerate (pid" in result.stderr
        assert server.requests == 0 and not out.exists()
    finally:
        server.stop()
