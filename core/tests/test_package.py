"""``import pg_core`` itself: cheap (no torch until a name needs it), and everything it used to
give still there: its public names, and its submodules as attributes."""

from __future__ import annotations

import subprocess
import sys

import pg_core
import pytest


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_bare_import_loads_no_torch_and_still_reaches_submodules_and_names() -> None:
    out = _fresh(
        "import sys, pg_core\n"
        "print('torch' in sys.modules)\n"
        "print(pg_core.errors.PGError.__name__, pg_core.store.wait_for_server.__name__, pg_core.ProcessGroup.__name__)"
    )
    assert out.splitlines() == ["False", "PGError wait_for_server ProcessGroup"]


def test_every_public_name_resolves_and_unknown_names_are_attribute_errors() -> None:
    for name in pg_core.__all__:
        assert getattr(pg_core, name) is not None, name
    assert set(pg_core.__all__) <= set(dir(pg_core))
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        pg_core.nothing_here
