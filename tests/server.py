"""A process that imports torch and the project once, and forks the test suite's runs from there.

Each run a test asks for is a fork of this server that runs `train_distribute.main(argv)` (or a worker
function through `distribute_tools.run_distribute`) with its own environment, working folder, output files and
session, exactly as a new `python train_distribute.py` would. That launcher forks its ranks in turn
(`processes.START_METHOD = "fork"`): safe here, since neither this server nor a launcher has run a parallel torch
operation when it forks. A run then starts in a fraction of a second, instead of seconds of imports for the
launcher and for every rank. The reference run, `--help`, the exit-code test and torchrun keep real interpreters
(and the ranks' spawn).

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout.
    {"start": {...}}   fork a run; answers {"pid": N}
    {"poll": N}        answers {"code": exit code or null}
"""

import importlib
import json
import os
import signal
import sys

import torch

import processes
import tests.hooked_run
import tests.workers  # noqa: F401 (imported once here, for the runs that call its workers)
import train_distribute


def run_child(request: dict) -> None:
    """In the forked child: become the run the request describes, then exit with its code."""
    if request.get("new_session", True):
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOCTTY  # a terminal, when a test passes one, stays a file
    stdout = os.open(request["stdout"], flags)
    stderr = stdout if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags)
    for source, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("ignore_sigint") else signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    processes.START_METHOD = "fork"
    tests.hooked_run.install_hooks()
    code = 1
    try:
        if "call" in request:  # "module:function", called with the arguments; returns the exit code
            module, name = request["call"].split(":")
            code = getattr(importlib.import_module(module), name)(*request["args"])
        else:
            sys.argv = ["train_distribute.py", *request["argv"]]
            code = train_distribute.main(request["argv"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the server's own exit handlers


def main() -> None:
    torch.set_num_threads(1)  # never a thread pool here: a forked child could not start its own
    statuses: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                run_child(request["start"])
            answer = {"pid": pid}
        else:
            pid = request["poll"]
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
            answer = {"code": statuses.get(pid)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
