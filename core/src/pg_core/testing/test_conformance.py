"""The conformance suite, collected by ``pytest --pg-backend NAME --pyargs pg_core.testing``.

One test per operation and per cross-cutting check; each draws its examples
with Hypothesis from the backend's declared capabilities. See
:mod:`pg_core.testing.harness` for what each check means.
"""

from __future__ import annotations

from typing import Any

import pytest

from pg_core.testing.cases import Example
from pg_core.testing.harness import TESTS, ConformanceFailure, NotApplicable


@pytest.mark.parametrize("test", [pytest.param(t, id=t, marks=pytest.mark.pg_conformance(t)) for t in TESTS])
def test_conformance(pg_conformance: Any, test: str, request: pytest.FixtureRequest) -> None:
    replay = request.config.getoption("pg_replay")
    failure = None
    try:
        if replay is not None:
            name, text = replay
            if name != test:
                pytest.skip(f"replaying one example of {name}")
            try:
                example = Example.from_json(text)
            except (ValueError, KeyError, TypeError) as exc:
                failure = f"--pg-replay: not an example the suite printed ({type(exc).__name__}: {exc})"
            else:
                pg_conformance.execute(test, example)
        else:
            pg_conformance.check(test)
    except NotApplicable as exc:
        pytest.skip(str(exc))
    except ConformanceFailure as exc:
        failure = str(exc)
    if failure is not None:  # outside the except block: pytest prints the failure once, without a chain
        pytest.fail(failure, pytrace=False)
