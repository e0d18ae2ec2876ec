"""Voice ids are safe file names: no dots lost to a suffix, no hidden files, no Windows device names,
no two ids that a case-insensitive file system would store in one file."""

from __future__ import annotations

from pathlib import Path

import pytest

from voicertc.errors import InputError
from voicertc.voice_ids import check_voice_id, same_file_name, voice_id_of, voice_path


@pytest.mark.parametrize("voice_id", ["a", "a.b", "a.c", "v1.2.3", "ann_lee-2", "conan", "com10", "x" * 64])
def test_good_ids_round_trip_through_their_file_names(voice_id, tmp_path):
    for suffix in (".json", ".safetensors"):
        path = voice_path(tmp_path, voice_id, suffix)
        assert path.parent == tmp_path and path.name == voice_id + suffix
        assert voice_id_of(path, suffix) == voice_id


def test_dotted_ids_get_files_of_their_own(tmp_path):
    names = {voice_path(tmp_path, v, ".json").name for v in ("a", "a.b", "a.c", "a.b.c")}
    assert names == {"a.json", "a.b.json", "a.c.json", "a.b.c.json"}


@pytest.mark.parametrize(
    "voice_id",
    ["", ".a", "..", "-a", "_a", "a/b", "a\\b", "a b", "x" * 65, "con", "NUL", "nul.json", "com1", "lpt9.x"],
)
def test_unsafe_ids_are_refused(voice_id):
    with pytest.raises(InputError, match="bad voice id"):
        check_voice_id(voice_id)


def test_stray_files_are_not_voices():
    assert voice_id_of(Path(".owners.json"), ".json") is None
    assert voice_id_of(Path(".a.json.1a2b3c.tmp"), ".json") is None
    assert voice_id_of(Path("a.b.safetensors"), ".json") is None


def test_ids_that_differ_only_in_case_share_a_file_name():
    assert same_file_name("Ann", "ann") and same_file_name("A.B", "a.b")
    assert not same_file_name("ann", "ann") and not same_file_name("a.b", "a.c")
