"""server.rank.malloc_tuning: a rank's glibc malloc settings, and the switch that leaves the defaults."""

from __future__ import annotations

import platform

import pytest

from shardserve.server.rank.malloc_tuning import SETTINGS, tune_malloc


def test_tuning_can_be_turned_off() -> None:
    assert tune_malloc({"SHARDSERVE_MALLOC_TUNING": "0"}) == {}


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_takes_every_setting() -> None:
    assert tune_malloc({}) == {name: value for name, (_, value) in SETTINGS.items()}
