"""A run killed like kill -9 at a chosen point, for the resume tests of convert and export."""
from __future__ import annotations

import os
from typing import Any, Callable


def killed_after(calls: int, module: Any, name: str, run: Callable[[], Any]) -> None:
    """``run()`` in a forked child that dies without any cleanup (``os._exit``) as it makes call number
    ``calls + 1`` to ``module.name``: the first ``calls`` calls complete."""
    pid = os.fork()
    if pid == 0:
        real, made = getattr(module, name), []

        def dying(*args, **kwargs):
            made.append(1)
            if len(made) > calls:
                os._exit(9)
            return real(*args, **kwargs)

        setattr(module, name, dying)
        try:
            run()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 9, "the run ended before the kill point"
