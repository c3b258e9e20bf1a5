"""``pg_core.launchers`` and ``BackendSpec.launcher``: the data, read without starting anything.

Starting ranks through ``mpiexec`` (``RankPool(launcher=...)``, ``LaunchedRanks``) is tested
where an MPI is installed: ``backends/mpi/tests``."""

from __future__ import annotations

from pathlib import Path

import pytest
from pg_core import launchers
from pg_core.backend import BackendSpec
from pg_core.launchers import LAUNCHERS, launch_command, launched_rank, why_unavailable_launched


@pytest.mark.parametrize(
    ("env", "found"),
    [
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, (3, 4)),  # MPICH's Hydra
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2)),  # Open MPI
        ({"PMIX_RANK": "0"}, (0, None)),  # a PMIx launcher that gives no size
        ({"PMIX_RANK": "5", "SLURM_NTASKS": "8"}, (5, 8)),  # srun --mpi=pmix
        ({"RANK": "0", "WORLD_SIZE": "2"}, None),  # torchrun is not an MPI launcher
        ({"PMI_RANK": "x"}, None),
        ({}, None),
    ],
)
def test_the_rank_an_mpi_launcher_gave_is_read_from_the_environment(
    env: dict[str, str], found: tuple[int, int | None] | None
) -> None:
    assert launched_rank(env) == found


def test_a_spec_declares_a_known_launcher_or_none() -> None:
    assert LAUNCHERS == ("mpiexec",)
    assert BackendSpec("x", factory="m:f", devices=("cpu",)).launcher is None
    assert BackendSpec("x", factory="m:f", devices=("cpu",), launcher="mpiexec").launcher == "mpiexec"
    with pytest.raises(ValueError, match="unknown launcher 'srun'"):
        BackendSpec("x", factory="m:f", devices=("cpu",), launcher="srun")


@pytest.mark.parametrize(
    ("version", "plain", "keep_going"),
    [
        ("HYDRA build details:\n    Version: 5.0.2", ["-n", "3"], ["-disable-auto-cleanup", "-n", "3"]),
        (
            "mpiexec (Open MPI) 5.0.11",
            ["--oversubscribe", "-n", "3"],
            ["--oversubscribe", "--enable-recovery", "-n", "3"],
        ),
    ],
)
def test_the_command_line_is_the_launchers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, plain: list[str], keep_going: list[str]
) -> None:
    """Hydra and Open MPI spell "keep the others when a rank dies" differently; which one
    ``mpiexec`` is, is read from its ``--version`` (a stand-in script here, started)."""
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{version}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setattr(launchers, "find_launcher", lambda launcher: str(fake))
    argv = ["python", "x.py"]
    assert launch_command("mpiexec", 3, argv) == [str(fake), *plain, *argv]
    assert launch_command("mpiexec", 3, argv, keep_going=True) == [str(fake), *keep_going, *argv]


def test_open_mpi_refusing_root_is_reported_with_the_variables_that_allow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pg-core writes the command line, so Open MPI's advice (add ``--allow-run-as-root`` to it)
    is not one the user can follow: the report names the environment variables instead."""
    fake = tmp_path / "mpiexec"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "mpiexec (Open MPI) 5.0.11"; exit 0; fi\n'
        "echo 'prterun has detected an attempt to run as root.' >&2\n"
        "echo 'You can override this protection by adding the --allow-run-as-root option' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(launchers, "find_launcher", lambda launcher: str(fake))
    said = why_unavailable_launched("mpi", "mpiexec")
    assert said is not None and said.startswith("a process started with mpiexec exited 1 without an answer: prterun")
    assert "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in said
