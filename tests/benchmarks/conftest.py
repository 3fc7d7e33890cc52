"""The benchmark smoke tests' shared fixture: the quick run of a module's scenarios (its `HALF`), made once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from benchmark_smoke import make_runs


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[dict, Path, str]]:
    return make_runs(tmp_path_factory, request.module.HALF)
