"""Export options read strictly (#43): 0 is a value, refused where it means nothing, never taken as not given."""

import pytest

from hsextract.errors import HsextractError
from hsextract.export.runner import export


@pytest.mark.parametrize(
    "option,value", [("seq_length", 0), ("shard_size", 0), ("shard_size", -3), ("seq_length", 1.5)]
)
def test_a_sharded_cache_option_of_zero_or_not_a_positive_int_is_refused(
    written_output, tmp_path, option, value
):
    with pytest.raises(HsextractError, match=f"--{option.replace('_', '-')} must be a positive"):
        export(
            str(written_output), str(tmp_path / "dest"), "nemo-dspark", show_progress=False, **{option: value}
        )
    assert not (tmp_path / "dest").exists()


def test_zero_is_not_taken_for_absent_by_a_per_sample_format(written_output, tmp_path):
    with pytest.raises(HsextractError, match="--shard-size must be a positive"):
        export(
            str(written_output), str(tmp_path / "dest"), "specforge-dflash", show_progress=False, shard_size=0
        )
