"""server.common.names: names are data; their file names are safe and distinct whatever the name holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.common.names import MAX_FILE_NAME_CHARS, file_name

HOSTILE = [
    ".",
    "..",
    "a/../../b",
    "/etc/passwd",
    "x" * 255,
    "é" * 512,
    "\u202e",
    "a\\b",
    "con",
    "-",
    "",
]


def test_hostile_names_become_plain_distinct_file_names() -> None:
    names = [file_name(name) for name in HOSTILE]
    assert len(set(names)) == len(HOSTILE)
    for name in names:
        assert name not in (".", "..") and "/" not in name and "\\" not in name
        assert len(name) <= MAX_FILE_NAME_CHARS and name.isascii() and name.startswith("t-")


@settings(max_examples=120, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_distinct_names_get_distinct_file_names(a: str, b: str) -> None:
    assert (file_name(a) == file_name(b)) == (a == b)
    assert len(file_name(a)) <= MAX_FILE_NAME_CHARS and "/" not in file_name(a)
