"""The error hierarchy as torch users catch it: what torch raises as a ``RuntimeError``
(``DistBackendError``, ``DistNetworkError``) is one in pg-core too, beside the builtin that
says what it is; and a backend's translation of torch's errors leaves pg-core's own alone."""

from __future__ import annotations

import pytest
from pg_core.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    GroupClosedError,
    PeerFailureError,
    PGError,
    StoreUnavailableError,
)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (CollectiveTimeout("Timed out after 1 s in all_reduce", op="all_reduce"), TimeoutError),
        (PeerFailureError("rank 1 died", peers=[1]), ConnectionError),
        (StoreUnavailableError("the store is gone"), ConnectionError),
        (CollectiveMismatchError("rank 1 called broadcast", peers=[1]), RuntimeError),
        (GroupClosedError("shut down"), RuntimeError),
    ],
)
def test_torchs_except_runtimeerror_catches_what_torch_raises_as_one(error: PGError, builtin: type) -> None:
    for kind in (RuntimeError, builtin, PGError):
        with pytest.raises(kind):
            raise error


def test_a_timeout_says_timed_out_as_torchs_do() -> None:
    assert str(CollectiveTimeout("Rank 0 timed out in monitoredBarrier")).startswith("Timed out: Rank 0")
    assert str(CollectiveTimeout("Timed out after 2 s in recv")) == "Timed out after 2 s in recv"


@pytest.mark.requires_backend("gloo")
def test_gloos_translation_of_torchs_errors_leaves_pg_cores_own_alone() -> None:
    from pg_gloo.backend import GlooBackend

    own = CollectiveTimeout("Timed out after 3 s in barrier", op="barrier", peers=[1])
    backend = GlooBackend.__new__(GlooBackend)  # the translation reads nothing of a formed backend for it
    assert backend._error(own, "barrier", 3.0, [1]) is own
