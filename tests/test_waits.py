"""Nothing waits unstoppably. A process is a rank only when torch's elastic agent started it (torchrun, or the
launcher): RANK and the rest left in a shell are refused before anything connects. A rank that waits for another
process inside torch's C++ code (where Python runs no signal handler) still ends on Ctrl-C or SIGTERM within seconds,
with its line and code: connecting to the store, rank 0 waiting for a missing rank, a collective whose peer is stopped
(SIGSTOP stands in for a hung machine); and the launcher with it. Only 127.0.0.1 is ever used."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import distribute_tools
from tests.conftest import (
    BACKGROUND,
    HANG_TIMEOUT,
    TINY,
    clean_env,
    csv_rows,
    free_port,
    launch,
    needs,
    new_interpreter,
    recorded_ranks,
    scenario,
    wait_for_rows,
)
from tests.test_launch import checkpoint_epoch
from tests.test_torchrun import listening

STOP_WITHIN = 10  # seconds from the signal to the exit
WAITING = ["--collective_timeout=60"]  # should a stop not end a wait, the wait ends first (the test then fails)
KEPT_HERE = "it stopped before any epoch finished; nothing to resume: start the run again"
SHELL = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}  # left by another job
TORCHRUN_WAY_ON = (
    "continue with the same command on every node and --resume True (torchrun's restarts and a SLURM requeue do so "
    "by themselves)"
)
UNREACHABLE = {**SHELL, "MASTER_ADDR": "127.0.0.1"}  # and a master that nothing answers (MASTER_PORT: a free port)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def refused(*names: str) -> tuple[subprocess.CompletedProcess, float, Path]:
    """`python train_distribute.py` in a new interpreter with these variables of UNREACHABLE set: its end, seconds."""
    env = {name: UNREACHABLE.get(name) or str(free_port()) for name in names}  # MASTER_PORT: nothing listens there
    out = Path(tempfile.mkdtemp(prefix="refused-")) / "out"
    command = [sys.executable, "train_distribute.py", *TINY, f"--output_dir={out}"]
    started = time.monotonic()
    with new_interpreter(command, stdout=-1, stderr=-1, env=clean_env(**env), nice=BACKGROUND) as run:
        stdout, stderr = run.communicate(timeout=HANG_TIMEOUT)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr), time.monotonic() - started, out


THREE, FIVE = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@needs((refused, *THREE), (refused, *FIVE))
@pytest.mark.parametrize("names", [THREE, FIVE], ids=["three", "five"])
def test_rank_variables_that_torchrun_did_not_set_are_refused_in_one_line_before_any_connection(names):
    run, seconds, out = scenario(refused, *names)
    found = [name for name in distribute_tools.RANK_VARIABLES if name in names]
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert lines(run.stderr) == [
        f"error: {' '.join(found)} set, but not by torchrun: unset {' '.join(found)}, or start ranks with torchrun"
    ]
    assert seconds < 60 and not out.exists()  # the seconds of its imports: no connection was tried


def rank(rank: int, port: int, out: Path, *args: str):
    """A rank as torchrun starts it (machine `rank` of two, one rank each), forked from the test server."""
    env = clean_env(TORCHELASTIC_RUN_ID="waits", RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cores = sorted(os.sched_getaffinity(0))  # a core each, as machines have their own (else their threads contend)
    return launch(*TINY, *WAITING, *args, f"--output_dir={out / str(rank)}", env=env, cpus=[cores[rank % len(cores)]])


def ends_with_its_line(run, sig: signal.Signals, kept: str = KEPT_HERE) -> str:
    """`sig` to the process `run`: it ends within STOP_WITHIN seconds, with the stop's code and line (`kept` begins
    the line's end); returns the line."""
    os.kill(run.pid, sig)
    signalled_at = time.monotonic()
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert time.monotonic() - signalled_at < STOP_WITHIN, f"took {time.monotonic() - signalled_at:.1f} s: {err}"
    code, word = (130, "interrupted") if sig == signal.SIGINT else (75, f"stopped by {sig.name}")
    assert run.returncode == code and lines(err) == [lines(err)[-1]] and err.startswith(f"{word}: {kept}"), err
    return err.strip()


def test_a_rank_connecting_to_a_store_that_never_answers_ends_on_ctrl_c(tmp_path):
    """The store's machine accepts the connection and says nothing, as a hung one would: the rank waits in C++."""
    with socket.create_server(("127.0.0.1", 0)) as hung:
        hung.settimeout(HANG_TIMEOUT)
        run = rank(1, hung.getsockname()[1], tmp_path)
        connection, _ = hung.accept()  # the rank connected, and now waits for the store's answer
        with connection:
            ends_with_its_line(run, signal.SIGINT)


def hosting(port: int, run) -> None:
    """Until rank 0 hosts the store: it waits for rank 1 from then on."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while not listening(port):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)


def test_rank_0_waiting_for_a_rank_that_never_comes_ends_on_sigterm(tmp_path):
    port = free_port()
    run = rank(0, port, tmp_path)
    hosting(port, run)
    ends_with_its_line(run, signal.SIGTERM)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def wait_until_idle(pid: int, seconds: float = 0.5) -> None:
    """Until the process used no CPU for `seconds`: it waits (for a stopped peer), where it computed before."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while True:
        before = cpu_ticks(pid)
        time.sleep(seconds)
        if cpu_ticks(pid) == before:
            return
        assert time.monotonic() < deadline, "the process never waited"


def test_a_rank_whose_peer_is_stopped_mid_collective_ends_on_sigterm_with_its_files_whole(tmp_path):
    """torchrun's two machines, one rank each; machine 1 hangs (SIGSTOP) while both train: rank 0 waits for it in a
    collective, in C++, until the stop."""
    port = free_port()
    first = rank(0, port, tmp_path, "--synthetic_size=1200", "--epochs=20")
    hosting(port, first)  # (rank 1 then connects at once, where it would retry every few seconds before)
    second = rank(1, port, tmp_path, "--synthetic_size=1200", "--epochs=20")
    try:
        wait_for_rows(tmp_path / "0", 1, first)
        os.kill(second.pid, signal.SIGSTOP)
        wait_until_idle(first.pid)
        line = ends_with_its_line(first, signal.SIGTERM, f"the files in {tmp_path / '0'} are from epoch ")
        assert line.endswith(f"from epoch {checkpoint_epoch(tmp_path / '0')}; {TORCHRUN_WAY_ON}"), line
        assert csv_rows(tmp_path / "0") == checkpoint_epoch(tmp_path / "0")
    finally:
        second.kill_session()


def test_a_run_with_a_stopped_rank_ends_on_ctrl_c_and_the_launcher_with_it(tmp_path):
    """The launcher's ranks; rank 1 hangs (SIGSTOP); Ctrl-C to the launcher: it ends in seconds, not in the 30 s that
    torch's agent waits for a rank before its SIGKILL."""
    pids = tmp_path / "pids"
    pids.mkdir()
    run = launch(
        *TINY,
        "--synthetic_size=1200",
        "--epochs=20",
        *WAITING,
        f"--output_dir={tmp_path / 'out'}",
        env=clean_env(TEST_PIDS=str(pids)),
    )
    rank_0, rank_1 = recorded_ranks(pids)
    wait_for_rows(tmp_path / "out", 1, run)
    os.kill(rank_1, signal.SIGSTOP)
    wait_until_idle(rank_0)
    line = ends_with_its_line(run, signal.SIGINT, f"the files in {tmp_path / 'out'} are from epoch ")
    assert line.endswith(f"from epoch {checkpoint_epoch(tmp_path / 'out')}: continue with --resume True"), line
