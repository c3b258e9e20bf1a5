"""Forked rank processes (``pg_core.procs.ForkedRanks``, what the test pool starts its ranks
with): each rank a process of its own, run as its command says, its exit status reported as a
child's would be, a ``SIGTERM`` to the launcher passed on, nothing left running after a kill."""

from __future__ import annotations

import os
import signal
import socket
import sys

import pytest
from pg_core.procs import ForkedRanks, wait_exited

pytestmark = pytest.mark.timeout(120)

PROBE = """
import atexit, faulthandler, os, signal, socket, sys
faulthandler.register(signal.SIGUSR1)  # as pg_core.procs.prepare_rank does, for dump_stacks
what, port = sys.argv[1], int(sys.argv[2])
atexit.register(print, "exited normally")  # buffered: printed and flushed only by a normal exit
if what == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
said = f"{sys.argv[3]} {what} as {__name__} in {os.getpid()} of {os.getppid()} torch {'torch' in sys.modules}"
said += f" hash {hash('pg-core forked ranks')}"
with socket.create_connection(("127.0.0.1", port)) as hello:  # to the test: running
    hello.sendall(said.encode() + b"\\n")
if what == "exit3":
    sys.exit(3)
if what == "raise":
    raise ValueError("planted")
while what in ("wait", "term"):
    signal.pause()  # until a signal ends it (a stack dump's returns here)
"""


def _ranks(tmp_path, *whats: str) -> tuple[ForkedRanks, list[str]]:
    """The ranks running the probe as ``whats`` say, and what each said when it started."""
    (tmp_path / "forked_probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = str(listener.getsockname()[1])
        commands = [[sys.executable, "-m", "forked_probe", w, port, str(r)] for r, w in enumerate(whats)]
        ranks = ForkedRanks(commands, env=env, log_dir=tmp_path)
        said: dict[int, str] = {}
        listener.settimeout(60)  # bounded: a rank that never starts fails the test
        try:
            while len(said) < len(whats):
                conn, _ = listener.accept()
                with conn, conn.makefile() as lines:
                    line = lines.readline()
                said[int(line.split()[0])] = line
        except BaseException:
            ranks.kill()
            raise
    return ranks, [said[r] for r in range(len(whats))]


def test_each_rank_is_a_process_of_its_own_running_its_command_with_its_exit_status(tmp_path):
    ranks, said = _ranks(tmp_path, "ok", "exit3", "raise", "wait")
    try:
        assert [ranks.wait(r, 60) for r in range(3)] == [0, 3, 1]
        assert all(f"{w} as __main__" in s for s, w in zip(said, ("ok", "exit3", "raise", "wait"), strict=True))
        assert "ValueError: planted" in ranks.tail(2)  # the traceback, in the rank's own log
        pids = [int(s.split(" in ")[1].split()[0]) for s in said]
        assert len(set(pids)) == 4 and os.getpid() not in pids and ranks.launcher.pid not in pids
        assert all(s.count(" torch True") == 1 for s in said)  # forked after torch was imported
        assert f"of {ranks.launcher.pid} " in said[0] and f"of {ranks.launcher.pid} " not in said[1]  # two launchers
        hashes = [s.split("hash ")[1].split()[0] for s in said]
        if not os.environ.get("PYTHONHASHSEED"):  # neighbours differ in their string-hash seed, as fresh processes do
            assert hashes[0] != hashes[1] and hashes[2] != hashes[3], hashes
        assert all("exited normally" in ranks.tail(r) for r in (0, 1))  # atexit ran: the interpreter exited as usual
        assert ranks.poll() == [0, 3, 1, None] and ranks.running() == [3]
        assert "forked_probe.py" in ranks.dump_stacks([3])[3]  # its stacks: signals reach the rank itself
    finally:
        ranks.kill()
    assert ranks.poll()[3] == -signal.SIGKILL
    assert wait_exited([*pids, ranks.launcher.pid], 10) == []


def test_sigterm_to_the_launcher_reaches_every_rank_and_a_kill_leaves_nothing_running(tmp_path):
    ranks, said = _ranks(tmp_path, "term", "term", "wait")
    try:
        ranks.launcher.terminate()
        assert [ranks.wait(r, 60) for r in range(3)] == [7, 7, -signal.SIGTERM]
        assert "got SIGTERM" in ranks.tail(0) and "got SIGTERM" in ranks.tail(1)
        assert ranks.launcher.wait(30) == 0  # every rank reaped, then it exits
    finally:
        ranks.kill()
    pids = [int(s.split(" in ")[1].split()[0]) for s in said]
    assert wait_exited(pids, 10) == []


def test_a_command_not_of_the_form_python_m_module_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\[python, '-m', module, \*args\]"):
        ForkedRanks([[sys.executable, "script.py"]], log_dir=tmp_path)
    with pytest.raises(ValueError, match="at least one"):
        ForkedRanks([], log_dir=tmp_path)


def test_alive_says_a_zombie_is_gone_and_a_reaped_process_too():
    import subprocess

    from pg_core.procs import alive

    assert alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert alive(child.pid)
    assert child.stdin is not None
    child.stdin.close()
    assert wait_exited([child.pid], 30) == []  # exited, not reaped: a zombie
    assert not alive(child.pid)
    child.wait(30)
    assert not alive(child.pid)


def test_watch_parent_calls_gone_when_also_says_so_and_stops():
    import threading

    from pg_core.procs import watch_parent

    called = threading.Event()
    flag = [False]
    thread = watch_parent(os.getppid(), called.set, every_s=0.01, also=lambda: flag[0])
    assert not called.wait(0.1)  # the parent is here and also() says no
    flag[0] = True
    assert called.wait(10)
    thread.join(10)
    assert not thread.is_alive()


_TREE = """
import os, subprocess, sys
from pg_core.procs import EXEC_WITH_PARENT
child = subprocess.Popen([sys.executable, "-c", EXEC_WITH_PARENT, str(os.getpid()), sys.executable, "-c",
                          "import os, sys, time; print(os.getpid(), flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
print(child.stdout.readline().decode().strip(), flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_command_started_through_exec_with_parent_dies_with_its_parent():
    import subprocess

    parent = subprocess.run([sys.executable, "-c", _TREE], capture_output=True, timeout=120, check=False)
    assert parent.returncode == -signal.SIGKILL
    pid = int(parent.stdout.split()[0])  # the command itself: EXEC_WITH_PARENT became it (same pid)
    assert wait_exited([pid], 30) == []


def test_exec_with_parent_gives_up_if_the_parent_is_already_gone():
    import subprocess

    from pg_core.procs import EXEC_WITH_PARENT

    not_my_parent = str(os.getpid() + 1_000_000)
    done = subprocess.run(
        [sys.executable, "-c", EXEC_WITH_PARENT, not_my_parent, sys.executable, "-c", "print('ran')"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 137 and b"ran" not in done.stdout
