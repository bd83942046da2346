"""How `python train_distribute.py` starts its ranks (torch's elastic agent) and how a run ends: the exit code, one
line, within seconds, and no rank left behind. Runs forked from the test server, and the same ends in new
interpreters, as a user's run is."""

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

import distribute_tools
import train_distribute
from safeguards import failures
from tests.conftest import (
    BACKGROUND,
    HANG_TIMEOUT,
    ROOT,
    TINY,
    alive,
    call,
    children_of,
    clean_env,
    csv_rows,
    launch,
    model_name,
    needs,
    new_interpreter,
    recorded_ranks,
    scenario,
    wait_for_rows,
)

STOP_WITHIN = 10  # seconds from the signal to the launcher's exit (a rank stuck in C++ is another matter)
LONG = [*TINY, "--synthetic_size=1200", "--epochs=20"]  # epochs of about half a second: a run to stop in the middle


def lines(text: str) -> list[str]:
    """Every non-empty line: "one line" counts torch's own warnings too."""
    return [line for line in text.splitlines() if line.strip()]


def checkpoint_epoch(folder: Path) -> int:
    return int(torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"])


def ended_in_time(run, signalled_at: float) -> str:
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert time.monotonic() - signalled_at < STOP_WITHIN, f"took {time.monotonic() - signalled_at:.1f} s: {err}"
    return err


def in_a_new_interpreter(*args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`python train_distribute.py *args` into a new folder, to its end: a scenario, run in the background."""
    out = Path(tempfile.mkdtemp(prefix="new-interpreter-")) / "out"
    (out.parent / "tmp").mkdir()  # its TMPDIR, which the run must leave as it found it
    command = [sys.executable, "train_distribute.py", *args, f"--output_dir={out}"]
    env = clean_env(TMPDIR=str(out.parent / "tmp"))
    with new_interpreter(command, stdout=-1, stderr=-1, env=env, nice=BACKGROUND) as run:
        stdout, stderr = run.communicate(timeout=HANG_TIMEOUT)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr), out


@needs((in_a_new_interpreter, *TINY, "--epochs=2"))
def test_a_finished_run_in_a_new_interpreter_exits_0_prints_only_its_lines_and_leaves_nothing_in_tmpdir():
    run, out = scenario(in_a_new_interpreter, *TINY, "--epochs=2")
    assert list((out.parent / "tmp").iterdir()) == []  # torch's agent's folder removed, torch 2.4's and dynamo's too
    assert run.returncode == 0, run.stderr
    assert lines(run.stderr) == []  # no warning of torch's, no log line of its agent
    first, *epochs, done = lines(run.stdout)
    assert first.startswith(f"{model_name()}(") and "2 rank(s) on cpu (gloo)" in first
    assert [line.split()[1] for line in epochs] == ["1/2", "2/2"] and done.startswith("done: 2 epochs")
    assert len(pd.read_csv(out / "pytorch_res.csv")) == 2 and checkpoint_epoch(out) == 2


@pytest.mark.parametrize(
    "argument, words",
    [
        ("--epochs=0", "EPOCHS=0 on the command line is out of range"),
        ("--batch_size=47", "does not split evenly over 2 ranks"),
        ("--accumulate=5", "BATCH_SIZE=48 does not split evenly over 2 ranks x 5 micro-batches; use a multiple"),
        ("--optimiser=sgd", "unknown setting --optimiser; write settings as --name value"),
        ("--lr=fast", "--lr=fast is not a number"),
        ("--world_size=-1", "WORLD_SIZE=-1 on the command line is out of range: it must be at least 0"),
        ("--resume", "RESUME=True but there is no"),
        ("--dataset=imagefolder", "DATA_DIR /nowhere does not exist"),
        (
            "--init_from=/nowhere/checkpoint.pt",
            "INIT_FROM /nowhere/checkpoint.pt is no file; give a run's checkpoint.pt or a state_dict file",
        ),
        (f"--data_dir={ROOT / 'README.md'}", f"DATA_DIR {ROOT / 'README.md'} is a file, not a folder; give a folder"),
    ],
)
def test_a_mistake_is_one_line_naming_it_and_exits_2_before_anything_starts(tmp_path, argument, words):
    run = launch(*TINY, "--data_dir=/nowhere", f"--output_dir={tmp_path / 'out'}", argument)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 2 and lines(out) == [], out
    assert len(lines(err)) == 1 and err.startswith("error: ") and words in err, err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


@needs((in_a_new_interpreter, "--epochs=0"))
def test_a_mistake_in_a_new_interpreter_is_one_line_too():
    run, _ = scenario(in_a_new_interpreter, "--epochs=0")
    assert run.returncode == 2 and lines(run.stdout) == [] and len(lines(run.stderr)) == 1, run.stderr


def test_a_mistake_the_ranks_find_is_one_line_from_the_launcher(tmp_path):
    """A mistake found only once the ranks load the data (fewer images than one batch): every rank raises it, each
    writes it for the agent, and the launcher prints it once."""
    run = launch(*TINY, "--synthetic_size=40", f"--output_dir={tmp_path}")
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 2 and len(lines(err)) == 1, err
    assert err == "error: 40 training images, fewer than BATCH_SIZE=48; lower it\n", err


@pytest.mark.parametrize("local_ranks, gpus", [(2, 1), (4, 2)])
def test_more_ranks_on_a_machine_than_its_gpus_are_refused_on_every_rank_alike(local_ranks, gpus):
    """Ranks of one torchrun (or of our launcher) see the same GPUs: more of them than GPUs would put two on one."""
    for local_rank in range(local_ranks):
        with pytest.raises(failures.UserError) as refused:
            distribute_tools.choose_device(local_rank, local_ranks, gpus)
        fix = f"start one per GPU (--world_size {gpus}; torchrun: --nproc_per_node={gpus})"
        assert str(refused.value) == f"{local_ranks} ranks of this machine would share {gpus} GPU(s); {fix}"
    assert distribute_tools.choose_device(1, 2, 2) == (torch.device("cuda", 1), "nccl")
    assert distribute_tools.choose_device(0, 1, 1) == (torch.device("cuda", 0), "nccl")  # one per task (SLURM's)
    assert distribute_tools.choose_device(1, 2, 0) == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("gpus", [["GPU-a", "GPU-b", "GPU-a"], ["GPU-a", "GPU-b", "GPU-c"], ["", "", ""]])
def test_ranks_of_several_torchruns_on_one_gpu_are_refused_on_each_of_them(gpus):
    """Every rank counts its GPU in the store and waits for all (three ranks here, threads on one store): each rank on
    a GPU counted twice is refused in one line; other GPUs, or GPUs of unknown UUID (torch 2.4), go on."""
    store = torch.distributed.HashStore()

    def rank(gpu: str) -> str:
        try:
            distribute_tools.refuse_shared_gpu(store, len(gpus), gpu)
        except failures.UserError as e:
            return str(e)
        return ""

    with ThreadPoolExecutor(len(gpus)) as pool:
        said = list(pool.map(rank, gpus))
    shared = "2 ranks would share GPU GPU-a; give each its own (one torchrun per machine, say)"
    assert said == [shared if gpus.count(gpu) > 1 and gpu else "" for gpu in gpus]


def without_tensorboard(*argv: str) -> int:
    """Called in a process forked from the test server: `python train_distribute.py *argv` where the tensorboard
    package cannot be imported, in the launcher and in its ranks (forked from it)."""
    sys.modules["tensorboard"] = None  # what an import finds: no such package
    return train_distribute.main(list(argv), entrypoint=train_distribute.main)


def two_runs_in_one_process(folder: str, *argv: str) -> int:
    """Called in a process forked from the test server: `train_distribute.main` twice, as a notebook would call it,
    each time into a folder of its own, the second time without a TMPDIR; the process's TMPDIR after each, on stderr."""
    codes = []
    for run in ("a", "b"):
        codes.append(train_distribute.main([*argv, f"--output_dir={folder}/{run}"], entrypoint=train_distribute.main))
        print(f"TMPDIR {os.environ.pop('TMPDIR', None)}", file=sys.stderr)
    return max(codes)


def test_a_process_that_runs_main_twice_gets_its_tmpdir_back_each_time(tmp_path):
    """The ranks' TMPDIR is the agent's folder, removed as the run ends: the launcher's own is given back (or none)."""
    env = clean_env(TMPDIR=str(tmp_path))
    result = call("tests.test_launch:two_runs_in_one_process", str(tmp_path), *TINY, "--epochs=1", env=env)
    assert result.returncode == 0 and csv_rows(tmp_path / "a") == csv_rows(tmp_path / "b") == 1, result.stderr
    assert lines(result.stderr) == [f"TMPDIR {tmp_path}", "TMPDIR None"]


def test_tensorboard_is_needed_only_when_asked_for_and_then_its_absence_is_one_line(tmp_path):
    asked = call("tests.test_launch:without_tensorboard", *TINY, "--tensorboard", f"--output_dir={tmp_path / 'a'}")
    assert asked.returncode == 2 and asked.stdout == "", asked.stdout
    assert (
        asked.stderr
        == "error: TENSORBOARD=True needs the tensorboard package: pip install tensorboard, or leave it False\n"
    )
    plain = call("tests.test_launch:without_tensorboard", *TINY, "--epochs=1", f"--output_dir={tmp_path / 'b'}")
    assert plain.returncode == 0 and csv_rows(tmp_path / "b") == 1, plain.stderr


def test_an_epoch_shows_its_progress_as_a_bar_on_a_terminal_and_as_lines_in_a_log(tmp_path):
    """On a terminal (rank 0's stderr): tqdm's bar with the rate and the time left, gone at the epoch's end. In a
    log file: a line now and then (a minute apart; here, with TEST_PROGRESS_SECONDS=0, after every step but the first,
    which starts the clock)."""
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a window of 120 columns
    on_terminal = launch(*TINY, "--epochs=2", f"--output_dir={tmp_path / 'tty'}", output=os.ttyname(terminal))
    in_a_log = launch(*TINY, "--epochs=2", f"--output_dir={tmp_path / 'log'}", env=clean_env(TEST_PROGRESS_SECONDS="0"))
    shown = read_until_it_ends(controller, on_terminal)  # the terminal stays open here: the run may open it late
    os.close(terminal)
    os.close(controller)
    assert on_terminal.wait(HANG_TIMEOUT) == 0, shown
    screen = shown.decode(errors="replace")
    assert re.search(r"epoch 1/2: +\d+%\|.*\| [\d.]+k?/576 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+k?img/s\]", screen), screen
    log, err = in_a_log.communicate(timeout=HANG_TIMEOUT)
    steps = re.findall(r"^epoch 2/2: (\d+) of 12 steps, [\d,]+ img/s, [\d.]+ min left$", log, re.MULTILINE)
    assert in_a_log.returncode == 0 and steps == [str(step) for step in range(2, 13)], log  # after the first step
    assert "\r" not in log and "%|" not in log + err  # no bar in a file


def read_until_it_ends(controller: int, run) -> bytes:
    """All that the terminal shows until `run` has ended. (Closing our end of the terminal first, and reading until no
    process holds it, failed 1 in many runs under load: the run, started in another process, had not opened the
    terminal yet, the read ended at once, and the run's writes then failed.)"""
    shown, deadline = b"", time.monotonic() + HANG_TIMEOUT
    while time.monotonic() < deadline:
        ended = run.poll() is not None  # then read what is left, and stop
        while select.select([controller], [], [], 0.1)[0]:
            shown += os.read(controller, 4096)
        if ended:
            return shown
    return shown


def test_sigterm_to_the_launcher_exits_75_with_the_epochs_files_whole(tmp_path):
    run = launch(*LONG, f"--output_dir={tmp_path}")
    wait_for_rows(tmp_path, 1, run)
    os.kill(run.pid, signal.SIGTERM)
    err = ended_in_time(run, time.monotonic())
    assert run.returncode == 75, err
    kept = checkpoint_epoch(tmp_path)
    assert lines(err) == [
        f"stopped by SIGTERM: the files in {tmp_path} are from epoch {kept}: continue with --resume True"
    ]
    assert kept >= 1 and csv_rows(tmp_path) == kept  # the checkpoint and the CSV agree: both whole
    assert not list(tmp_path.glob("*.tmp*"))


def stop_while_a_lost_peer_unwinds() -> int:
    """In a process of its own (call): a rank's stop signal that comes while gloo's lost-peer error unwinds, as when
    the peer stopped first (the signal reached both; the peer left before this rank's handler could run)."""
    from safeguards import failures

    def body() -> None:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:39334")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs now, inside the unwinding
            print("the files are finished", flush=True)  # where train's finally closes the writer

    return failures.run_rank(body)


def test_a_stop_that_comes_while_a_lost_peers_error_unwinds_is_the_stop_in_one_line():
    result = call("tests.test_launch:stop_while_a_lost_peer_unwinds", env=clean_env(LOCAL_RANK="0", RANK="0"))
    assert result.returncode == 75 and result.stdout == "the files are finished\n", result.stderr
    assert lines(result.stderr) == [f"stopped by SIGTERM: {failures.NOTHING_KEPT}"], result.stderr


def test_ctrl_c_mid_epoch_exits_130_in_one_line(tmp_path):
    run = launch(*LONG, f"--output_dir={tmp_path}")
    wait_for_rows(tmp_path, 1, run)
    time.sleep(0.3)  # in the middle of epoch 2
    os.kill(run.pid, signal.SIGINT)
    err = ended_in_time(run, time.monotonic())
    assert run.returncode == 130 and len(lines(err)) == 1 and err.startswith("interrupted: the files in"), err
    assert csv_rows(tmp_path) == checkpoint_epoch(tmp_path)


@pytest.mark.parametrize("when", [0.0, 1.0])
def test_ctrl_c_while_the_ranks_start_in_new_interpreters_is_one_line(tmp_path, when):
    """The ranks are new interpreters importing torch: the stop waits for them to handle it (held back as they
    start), then the run ends in one line instead of a traceback per rank."""
    run = launch(*TINY, f"--output_dir={tmp_path}", ranks_as_interpreters=True)
    deadline = time.monotonic() + HANG_TIMEOUT
    while len(children_of(run.pid)) < 2:  # the agent has started the ranks
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.01)
    time.sleep(when)
    os.kill(run.pid, signal.SIGINT)
    err = ended_in_time(run, time.monotonic())
    assert run.returncode == 130 and lines(err) == [
        "interrupted: it stopped before any epoch finished; nothing to resume: start the run again"
    ], err


def test_a_killed_rank_exits_1_names_it_and_stops_the_others(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    run = launch(*LONG, f"--output_dir={tmp_path / 'out'}", env=clean_env(TEST_PIDS=str(pids)))
    rank_0, rank_1 = recorded_ranks(pids)
    wait_for_rows(tmp_path / "out", 1, run)
    os.kill(rank_1, signal.SIGKILL)
    err = ended_in_time(run, time.monotonic())
    assert run.returncode == 1 and len(lines(err)) == 1, err
    kept = checkpoint_epoch(tmp_path / "out")
    assert err.startswith("error: rank 1 was killed by SIGKILL") and f"are from epoch {kept}: continue" in err
    assert not alive(rank_0)


def test_a_rank_that_raises_prints_its_traceback_and_the_launcher_names_it(tmp_path):
    run = launch(*TINY, f"--output_dir={tmp_path}", env=clean_env(TEST_RANK_1_BUG="1"))
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 1
    assert "[rank 1] RuntimeError: a bug on rank 1" in err and "Traceback" in err
    bug = "a bug on rank 1, raised on purpose by the test"
    assert lines(err)[-1].startswith(f"error: rank 1 failed with RuntimeError: {bug}; stopped the other ranks")


def test_a_rank_out_of_gpu_memory_in_epoch_2_ends_in_one_line_naming_the_way_on_and_epoch_1s_files_stay(tmp_path):
    """As when another process takes the GPU's memory after epoch 1 (TEST_OUT_OF_MEMORY: torch's error on rank 0)."""
    run = launch(*TINY, "--epochs=3", f"--output_dir={tmp_path}", env=clean_env(TEST_OUT_OF_MEMORY="2"))
    _, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 1 and checkpoint_epoch(tmp_path) == 1, err
    assert lines(err) == [
        "error: rank 0 ran out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 139.81 GiB of which 1.12 GiB is free. Process 4242 has 120.00 GiB memory in use); resume with "
        "--accumulate 2 or more, or start anew with a smaller --batch_size; stopped the other ranks; "
        f"the files in {tmp_path} are from epoch 1: continue with --resume True"
    ]


def test_out_of_gpu_memory_is_that_line_from_the_caching_allocator_and_from_the_driver():
    """torch's own error, and the CUDA driver's where no cache stands between (PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""
    from tests.hooked_run import OUT_OF_MEMORY

    how = "resume with --accumulate 2 or more, or start anew with a smaller --batch_size"
    code, line = failures.outcome(torch.cuda.OutOfMemoryError(OUT_OF_MEMORY))
    kept = f"; {failures.KEPT}"  # filled in where the line is printed (under torchrun too: test_torchrun)
    assert code == 1 and line.endswith(" is free. Process 4242 has 120.00 GiB memory in use); " + how + kept), line
    driver = RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported elsewhere")
    said = f"error: rank 0 ran out of GPU memory (CUDA error: out of memory); {how}{kept}"
    assert failures.outcome(driver) == (1, said)


def test_a_closed_stdout_does_not_stop_the_run(tmp_path):
    """`python train_distribute.py ... | head -2`: the reader is gone after the first line and epoch 1's; the run goes
    on to its end without a word (its files are the record), and exits 0."""
    fifo, folder = tmp_path / "pipe", tmp_path / "out"
    os.mkfifo(fifo)
    run = launch(*TINY, "--epochs=4", f"--output_dir={folder}", stdout_to=str(fifo))
    with open(fifo) as reader:  # opened once the run opened it for its output
        head = [reader.readline(), reader.readline()]
    run.wait(HANG_TIMEOUT)
    err = Path(run.stderr_path).read_text()
    assert run.returncode == 0 and lines(err) == [], err
    assert head[1].startswith("epoch 1/4") and csv_rows(folder) == 4, head


def test_a_lost_peer_and_a_collectives_failure_are_said_without_torchs_source_paths(monkeypatch):
    """gloo and NCCL put the place in torch's C++ sources first; our lines leave it out."""
    monkeypatch.delenv(failures.LAUNCHER_PID, raising=False)
    where = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] "
    code, line = failures.outcome(RuntimeError(f"{where}Read error [127.0.0.1]:40002: Connection reset by peer"))
    assert (code, line) == (
        1,
        f"[rank 0] stopped: another rank failed or was stopped (its connection closed); {failures.KEPT}",
    )
    timeout = RuntimeError(f"{where}Timed out waiting 600000ms for recv operation to complete\nmore")
    assert failures.outcome(timeout) == (
        1,
        "error: rank 0 failed with RuntimeError: Timed out waiting 600000ms for recv operation to complete",
    )


def ranks_left_after_a_while(ranks: list[int]) -> list[int]:
    """The ranks still alive STOP_WITHIN seconds from now, or as soon as none is."""
    deadline = time.monotonic() + STOP_WITHIN
    while (left := [pid for pid in ranks if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_kill_9_of_the_launcher_leaves_no_rank_behind(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    run = launch(*LONG, f"--output_dir={tmp_path / 'out'}", env=clean_env(TEST_PIDS=str(pids)))
    ranks = recorded_ranks(pids)
    wait_for_rows(tmp_path / "out", 1, run)
    run.kill()
    run.wait(60)
    assert ranks_left_after_a_while(ranks) == [], "a rank outlived its launcher"


def launcher_killed_beside_new_interpreters() -> tuple[list[int], list[int]]:
    """kill -9 of a launcher whose ranks are new interpreters, as a user's are, each in a session of its own, in the
    background (a scenario): its ranks, found by process id, and those still alive after a while."""
    out = Path(tempfile.mkdtemp(prefix="killed-launcher-"))
    run = launch(*LONG, f"--output_dir={out}", ranks_as_interpreters=True, nice=BACKGROUND)
    wait_for_rows(out, 1, run)
    ranks = children_of(run.pid)
    run.kill()
    run.wait(60)
    return ranks, ranks_left_after_a_while(ranks)


@needs((launcher_killed_beside_new_interpreters,))
def test_kill_9_of_the_launcher_leaves_no_rank_in_a_new_interpreter_behind():
    ranks, left = scenario(launcher_killed_beside_new_interpreters)
    assert len(ranks) >= 2 and left == [], "a rank outlived its launcher"


def teardown_beside_busy_processes() -> subprocess.CompletedProcess:
    """benchmarks/gloo_teardown.py's `kept` way, in the background (a scenario: its busy processes take the CPU)."""
    command = [sys.executable, "-m", "benchmarks.gloo_teardown", "--pairs=1", "--rounds=30", "--ways=kept"]
    command = ["nice", "-n", str(BACKGROUND), *command]
    return subprocess.run(command, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=HANG_TIMEOUT)


@needs((teardown_beside_busy_processes,))
def test_leaving_the_group_does_not_hang_beside_busy_processes():
    """distribute_tools.cleanup's way out of the group, as benchmarks/gloo_teardown.py runs it: a pair of ranks, 30
    rounds, 2 busy processes beside them. torch 2.4 to 2.7's destroy_process_group alone got stuck in 9 of 10 such
    pairs of 50 rounds (the benchmark's `plain` way); 2.8 and later free a group without holding Python's lock."""
    run = scenario(teardown_beside_busy_processes)
    assert run.returncode == 0 and "kept: 0 of 1 pairs stuck" in run.stdout, run.stdout + run.stderr
