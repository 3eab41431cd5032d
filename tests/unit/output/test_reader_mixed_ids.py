"""An output of a mix of sources keys its samples ``name/id``: a lookup by the row's own id says so."""

import json

import pytest
from support.output import write_output

from hsextract.demo import make_conversations
from hsextract.output import open_output


def test_a_row_id_missed_in_a_mix_names_the_source_prefixed_ids(tiny_model, tmp_path):
    rows = make_conversations(4)
    for i, row in enumerate(rows):
        row["id"] = f"mine-{i:03d}"
    for name, part in (("a.jsonl", rows[:2]), ("b.jsonl", rows[2:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    data = (f"{tmp_path / 'a.jsonl'}?name=chat", f"{tmp_path / 'b.jsonl'}?name=tools")
    out = open_output(write_output(tmp_path, tiny_model, data, layers="0", shards=1))
    assert sorted(out.sample_ids()) == ["chat/mine-000", "chat/mine-001", "tools/mine-002", "tools/mine-003"]
    assert out["chat/mine-001"]["sample_id"] == "chat/mine-001"
    with pytest.raises(
        KeyError, match=r"'mine-001' is not in this output; .* source's name: 'chat/mine-001'"
    ):
        out["mine-001"]
    with pytest.raises(
        KeyError, match=r"'nope' is not in this output \(its ids read like '(chat|tools)/mine-"
    ):
        out["nope"]
