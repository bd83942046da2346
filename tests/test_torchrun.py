"""The same script under torchrun: a killed worker (torchrun restarts the workers, which resume exactly), a mistake
(one line per attempt), two "machines" meeting by c10d rendezvous, a stop signal, and a finished run started again.
torchrun's code forked from the test server, its workers forked from it (start_torchrun); the first test runs the real
`torchrun` executable a user types."""

import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from tests.conftest import (
    BACKGROUND,
    HANG_TIMEOUT,
    SCRIPT,
    TINY,
    alive,
    children_of,
    clean_env,
    csv_rows,
    free_port,
    needs,
    new_interpreter,
    scenario,
    snapshot,
    start_torchrun,
    wait_for_rows,
)

ARGS = TINY[:-1]  # torchrun decides the number of ranks
ENV = clean_env()  # torchrun as its documentation has it: its store shared with the workers
# Several machines: a machine started again waits in vain for the shared store's address (torch's agent publishes it
# only once), so README's multi-machine commands export this, and so do the tests of them.
NODES_ENV = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
# torchrun's banner (on torch 2.4 its logger's name is a line of its own), and runpy's note on `-m`
TORCHRUN_OWN = ("*****", "Setting OMP_NUM_THREADS", "<frozen runpy>", "WARNING:__main__:")
# torch 2.3 to 2.7: a torchrun that gets a stop signal closes the rendezvous for every machine (pytorch#152525)
CLOSES_RENDEZVOUS = "_rdzv_handler.shutdown()" in inspect.getsource(LocalElasticAgent._shutdown)
TIMINGS = ("epoch_seconds", "elapsed_seconds", "images_per_second", "peak_memory_mb", "write_wait_seconds")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error: ")]


def checkpoint_epoch(folder: Path) -> int:
    return int(torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"])


def standalone(*args: str, restarts: int = 0) -> list[str]:
    return ["--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}", str(SCRIPT), *args]


def killed_worker_scenario() -> tuple[subprocess.CompletedProcess, Path, list[int]]:
    """The real `torchrun` executable as its documentation has it (`--standalone --nproc_per_node=2 --max-restarts=2
    train_distribute.py ...`, its store shared with the workers), new interpreters all; SIGKILL to a worker after
    epoch 2. Returns the run, its OUTPUT_DIR and the first attempt's workers."""
    out = Path(tempfile.mkdtemp(prefix="torchrun-")) / "out"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, *standalone(*ARGS, "--epochs=5", f"--output_dir={out}", restarts=2)]
    with new_interpreter(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, nice=BACKGROUND) as process:
        wait_for_rows(out, 2, process)
        first = workers(process.pid)
        os.kill(first[-1], signal.SIGKILL)
        out_text, err_text = process.communicate(timeout=HANG_TIMEOUT)
    return subprocess.CompletedProcess(command, process.returncode, out_text, err_text), out, first


killed_worker_scenario.long = True  # (conftest.pytest_collection_finish)


@needs((killed_worker_scenario,))
def test_a_killed_worker_is_restarted_by_torchrun_and_the_run_resumes_exactly(reference_run):
    """torchrun restarts both workers, they resume from the checkpoint by themselves, and the CSV is the uninterrupted
    run's (reference_run: the same settings) up to timings and memory."""
    result, out, first = scenario(killed_worker_scenario)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "| 2 rank(s) on cpu (gloo) |" in result.stdout and "done: 5 epochs" in result.stdout, result.stdout
    assert "Traceback" not in log and "terminate called" not in log, log
    assert not any(alive(pid) for pid in first)
    resumed = re.search(r"^resuming after epoch (\d+) of 5$", result.stdout, re.MULTILINE)
    assert resumed and int(resumed.group(1)) >= 2 and log.count("epoch 1/5") == log.count("epoch 2/5") == 1, log
    rows, expected = (
        pd.read_csv(folder / "pytorch_res.csv").drop(columns=list(TIMINGS)) for folder in (out, reference_run[0])
    )
    assert rows["epoch"].tolist() == [1, 2, 3, 4, 5], rows
    pd.testing.assert_frame_equal(rows, expected, rtol=1e-5)  # every number as if nothing had happened
    assert checkpoint_epoch(out) == 5 and not list(out.glob("previous-*")), "the restart moved its own results aside"


@pytest.mark.parametrize(
    "mistake, restarts, words",
    [
        ("--optimiser=sgd", 2, "unknown setting --optimiser; write settings as --name value"),
        ("--epochs=0", 0, "EPOCHS=0 on the command line is out of range"),
        ("--resume=True", 2, "RESUME=True but there is no "),
    ],
)
def test_a_mistake_under_torchrun_is_one_line_per_attempt(tmp_path, mistake, restarts, words):
    """A mistake found before the workers meet (a setting) or by every rank once they have (nothing to resume):
    local rank 0 prints the line; torchrun restarts its workers as after any failure, and each attempt fails alike,
    in the same line. torchrun's summary names it as the root cause."""
    out = tmp_path / "out"
    run = start_torchrun(*standalone(*ARGS, mistake, f"--output_dir={out}", restarts=restarts), env=ENV)
    log = run.communicate(timeout=HANG_TIMEOUT)[0]
    assert run.returncode == 1, log  # torchrun's own code for a failed worker
    assert len(errors(log)) == restarts + 1 and all(line.startswith(f"error: {words}") for line in errors(log)), log
    assert csv_rows(out) == 0 and "epoch 1/" not in log
    root_cause = log.split("Root Cause (first observed failure):")[1]  # torchrun's summary, from the error file
    assert f"traceback : error: {words}" in root_cause, log


def test_out_of_gpu_memory_under_torchrun_names_the_kept_epoch_and_the_way_on(tmp_path):
    """Rank 0 runs out of GPU memory as epoch 2 begins (TEST_OUT_OF_MEMORY: torch's error): without our launcher, the
    rank's own line names the epoch whose files are kept, as README promises of the last line after a failure."""
    out = tmp_path / "out"
    args = standalone(*ARGS, "--epochs=3", f"--output_dir={out}")
    args[args.index(str(SCRIPT))] = str(SCRIPT.parent / "tests" / "hooked_run.py")  # the script with the test's hooks
    run = start_torchrun(*args, env=clean_env(TEST_OUT_OF_MEMORY="2"))
    log = run.communicate(timeout=HANG_TIMEOUT)[0]
    assert run.returncode == 1 and checkpoint_epoch(out) == 1, log
    (line,) = errors(log)
    assert line.startswith("error: rank 0 ran out of GPU memory (CUDA out of memory. Tried to allocate"), log
    assert line.endswith(
        f"smaller --batch_size; the files in {out} are from epoch 1; continue with the same command on every node and "
        "--resume True (torchrun's restarts and a SLURM requeue do so by themselves)"
    ), log


def workers(torchrun: int, count: int = 2) -> list[int]:
    """torchrun's worker processes (its children), once all `count` have started."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while len(found := [pid for pid in children_of(torchrun) if parent(pid) == torchrun]) < count:
        assert time.monotonic() < deadline, "torchrun did not start its workers"
        time.sleep(0.05)
    return sorted(found)


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def node(n: int, port: int, out: Path, *args: str, restarts: int = 0, address: str = ""):
    """torchrun as machine `n` of two, one worker each, on a core of its own and with its own OUTPUT_DIR (out/n), as
    README's multi-machine command has it. Each has an address of its own, as machines do: the rendezvous gives
    global rank 0 to the machine whose address sorts first, machine 0, at every start (unless `address` says else)."""
    return start_torchrun(
        "--nnodes=2",
        "--nproc_per_node=1",
        f"--max-restarts={restarts}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--local_addr={address or f'127.0.0.{n + 1}'}",  # what each tells the other (else this machine's name)
        "--rdzv_id=two-nodes",
        # a stopped machine leaves the rendezvous after 3 missed heartbeats, 1 s apart here (5 s by default; 2.4 has 5)
        "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3",
        str(SCRIPT),
        *ARGS,
        *args,
        f"--output_dir={out / str(n)}",
        cpus=[sorted(os.sched_getaffinity(0))[n % len(os.sched_getaffinity(0))]],
        env=NODES_ENV,
    )


def endpoint_node(port: int, out: Path, *args: str, restarts: int = 0, n: int = 0, address: str = ""):
    """Machine 0, started first and waited for until it listens: the endpoint's machine, which hosts the rendezvous."""
    first = node(n, port, out, *args, restarts=restarts, address=address)
    deadline = time.monotonic() + HANG_TIMEOUT
    while not listening(port):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    return first


def listening(port: int) -> bool:
    """Something listens on `port` (the kernel's table: a probe's connection would be a client to the store)."""
    tables = (Path(f"/proc/net/{name}").read_text().splitlines()[1:] for name in ("tcp", "tcp6"))
    return any(row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A" for table in tables for row in table)


def wait_for_rows_of_two_epochs(out: Path, *nodes) -> None:
    """Until the machine of global rank 0, whichever it is, wrote two epochs' rows: every rank knows the first's."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while max(csv_rows(out / str(n)) for n in (0, 1)) < 2:
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "no row in time"
        time.sleep(0.05)


def epochs_printed(*logs: str) -> list[int]:
    return sorted(int(epoch) for log in logs for epoch in re.findall(r"^epoch (\d+)/", log, re.MULTILINE))


def test_a_stopped_node_started_again_rejoins_and_the_run_finishes_every_epoch_once(tmp_path):
    """Two torchrun processes as two machines, README's command (--max-restarts=3): the one that is not the
    endpoint's gets SIGTERM mid-run and is started again with the same command; the other's torchrun restarts its
    worker and waits for it. Only global rank 0's machine, the one whose address sorts first, prints epochs and
    writes files, at every start. On torch 2.3 to 2.7 the stopped machine's torchrun closes the rendezvous for all
    (pytorch#152525): the other ends too, with our line, and both started again with --resume True go on, as README
    says."""
    port, epochs = free_port(), "--epochs=5"
    first = endpoint_node(port, tmp_path, epochs, restarts=3)
    second = node(1, port, tmp_path, epochs, restarts=3)
    wait_for_rows_of_two_epochs(tmp_path, first, second)
    os.kill(second.pid, signal.SIGTERM)
    logs_of_1, logs_of_0 = [second.communicate(timeout=90)[0]], []
    if CLOSES_RENDEZVOUS:
        logs_of_0.append(first.communicate(timeout=90)[0])
        assert any(line.endswith("do so by themselves)") for line in lines(logs_of_0[0])), logs_of_0  # our line
        first = endpoint_node(port, tmp_path, epochs, "--resume=True", restarts=3)
    again = node(1, port, tmp_path, epochs, *(["--resume=True"] if CLOSES_RENDEZVOUS else []), restarts=3)
    logs_of_0.append(first.communicate(timeout=HANG_TIMEOUT)[0])
    logs_of_1.append(again.communicate(timeout=HANG_TIMEOUT)[0])
    assert (first.returncode, again.returncode) == (0, 0), [*logs_of_0, *logs_of_1]
    assert epochs_printed(*logs_of_0) == list(range(1, 6)) and epochs_printed(*logs_of_1) == [], logs_of_1
    assert "| 2 rank(s) on cpu (gloo) |" in logs_of_0[-1], logs_of_0
    writer, other = tmp_path / "0", tmp_path / "1"  # machine 0's address, 127.0.0.1, sorts first
    assert pd.read_csv(writer / "pytorch_res.csv")["epoch"].tolist() == list(range(1, 6))
    assert checkpoint_epoch(writer) == 5
    written = {".lock", "best.pt", "checkpoint.pt", "pytorch_res.csv", "pytorch_res.png"}
    assert {p.name for p in writer.iterdir()} - {p.name for p in writer.glob("events.out.tfevents.*")} == written
    assert not other.exists() or not any(other.iterdir()), list(other.iterdir())


def test_a_stopped_node_without_restarts_ends_both_with_the_kept_epoch_and_resume_goes_on(tmp_path):
    """No restarts left: SIGTERM to the machine that is not the endpoint's ends both within 90 s, each with a line of
    ours naming the kept epoch (the same on both: the one the resume takes), where its files are, and --resume True;
    both started again with it go on."""
    port, epochs = free_port(), "--epochs=5"
    nodes = [endpoint_node(port, tmp_path, epochs), node(1, port, tmp_path, epochs)]
    wait_for_rows_of_two_epochs(tmp_path, *nodes)
    os.kill(nodes[1].pid, signal.SIGTERM)
    logs = [n.communicate(timeout=90)[0] for n in nodes]
    kept = max(checkpoint_epoch(tmp_path / str(n)) for n in (0, 1) if csv_rows(tmp_path / str(n)))
    for n, log in enumerate(logs):
        ours = [line for line in log.splitlines() if "--resume True" in line and "traceback :" not in line]
        assert "Root Cause" not in log or f"traceback : {ours[0]}" in log.split("Root Cause")[1], log  # as the summary
        assert len(ours) == 1 and "continue with the same command on every node and --resume True" in ours[0], log
        epoch = int(re.search(r"are from epoch (\d+);", ours[0]).group(1))
        here = csv_rows(tmp_path / str(n)) > 0  # global rank 0's machine names its own files
        assert epoch == kept and (here or "on the node of global rank 0" in ours[0]), log  # every node: the same
    resumed = [endpoint_node(port, tmp_path, epochs, "--resume=True"), node(1, port, tmp_path, epochs, "--resume=True")]
    more = [n.communicate(timeout=HANG_TIMEOUT)[0] for n in resumed]
    assert [n.returncode for n in resumed] == [0, 0], more
    assert epochs_printed(*logs, *more) == list(range(1, 6)), [*logs, *more]
    final = max((tmp_path / str(n) for n in (0, 1)), key=csv_rows)
    assert pd.read_csv(final / "pytorch_res.csv")["epoch"].tolist() == list(range(1, 6))


def test_machines_with_disks_of_their_own_resume_when_the_other_one_becomes_global_rank_0(tmp_path):
    """Each machine its own OUTPUT_DIR (node-local disks). Stopped after epoch 2 (no restarts: SIGTERM to one ends
    both), both started again with --resume True where the rendezvous makes the other machine global rank 0 (their
    addresses swapped): it goes on from the checkpoint in machine 0's folder, says so, and writes from then on; every
    epoch runs once, and the CSV in its folder holds them all."""
    port, epochs = free_port(), "--epochs=4"
    nodes = [endpoint_node(port, tmp_path, epochs), node(1, port, tmp_path, epochs)]
    wait_for_rows_of_two_epochs(tmp_path, *nodes)
    os.kill(nodes[1].pid, signal.SIGTERM)
    logs = [n.communicate(timeout=90)[0] for n in nodes]
    kept, first, second = checkpoint_epoch(tmp_path / "0"), tmp_path / "0", tmp_path / "1"
    assert kept >= 2 and not (second / "checkpoint.pt").exists(), logs
    swapped = [
        endpoint_node(port, tmp_path, epochs, "--resume=True", n=1, address="127.0.0.1"),
        node(0, port, tmp_path, epochs, "--resume=True", address="127.0.0.2"),
    ]
    more = [n.communicate(timeout=HANG_TIMEOUT)[0] for n in swapped]
    assert [n.returncode for n in swapped] == [0, 0], more
    told = f"resuming after epoch {kept} of 4 with the checkpoint in {socket.gethostname()}:{first}, the newest; "
    assert told + f"from now on the files go to {second}" in more[0].splitlines(), more
    assert epochs_printed(*logs, *more) == [1, 2, 3, 4], [*logs, *more]
    assert pd.read_csv(second / "pytorch_res.csv")["epoch"].tolist() == [1, 2, 3, 4] and checkpoint_epoch(second) == 4
    assert checkpoint_epoch(first) == kept  # machine 0's folder as it was


def test_sigterm_to_torchrun_stops_the_job_instead_of_restarting_it(tmp_path):
    """scancel or Kubernetes: SIGTERM to torchrun. Every worker stops after its files, rank 0 says which epoch's are
    kept in one line, and torchrun does not restart the workers although it may."""
    out = tmp_path / "out"
    run = start_torchrun(*standalone(*ARGS, "--epochs=20", f"--output_dir={out}", restarts=2), env=ENV)
    wait_for_rows(out, 1, run)
    ranks = workers(run.pid)
    os.kill(run.pid, signal.SIGTERM)
    log = run.communicate(timeout=HANG_TIMEOUT)[0]
    assert run.returncode == 1, log  # torchrun reports the signal it got as a failure of its own
    kept = checkpoint_epoch(out)
    how = (
        "continue with the same command on every node and --resume True (torchrun's restarts and a SLURM requeue do "
        "so by themselves)"
    )
    stopped = [line for line in log.splitlines() if line.startswith("stopped by")]
    assert stopped == [f"stopped by SIGTERM: the files in {out} are from epoch {kept}; {how}"], log
    assert log.index(stopped[0]) < log.index("Traceback"), log  # torchrun's own report comes after our line
    assert kept >= 1 and csv_rows(out) == kept and not list(out.glob("*.tmp*"))
    assert "resuming" not in log and log.count("epoch 1/20") == 1, "torchrun restarted the workers"
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a worker outlived torchrun's stop"
        time.sleep(0.05)


def test_a_finished_run_started_again_under_torchrun_changes_nothing(tmp_path, reference_run):
    """--resume True again (or a late requeue): one line, exit 0, every file untouched, .lock included."""
    reference, _ = reference_run
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = snapshot(out)
    run = start_torchrun(*standalone(*ARGS, "--epochs=5", f"--output_dir={out}", "--resume=True", restarts=2), env=ENV)
    log = run.communicate(timeout=HANG_TIMEOUT)[0]
    assert run.returncode == 0, log
    ours = [line for line in lines(log) if not line.startswith(TORCHRUN_OWN)]  # torchrun's banner
    assert ours == [f"already finished: all 5 epochs are in {out}; nothing to do"], log
    assert snapshot(out) == before
