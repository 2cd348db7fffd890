"""Session-wide test plumbing: the multi-rank worker pools of `tests._dist`."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from tests._dist import run_ranks, shutdown_pools


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()


@pytest.fixture
def dist_run() -> Callable[..., list[Any]]:
    """The `run_ranks(world_size, fn, *args, timeout=120)` function, as a fixture."""
    return run_ranks
