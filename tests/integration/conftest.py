"""Shared by the launcher tests: ``pgrun_job.py`` (the script their ranks run, and the helpers
that check its output and its processes) loaded once as the module ``pgrun_job``. The suite
imports test files with ``--import-mode=importlib``, which puts no test folder on ``sys.path``,
and a plain ``import pgrun_job`` would not resolve without this."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if "pgrun_job" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("pgrun_job", Path(__file__).with_name("pgrun_job.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["pgrun_job"] = _module
    _spec.loader.exec_module(_module)
