"""A process that imports torch and the project once, and forks the test suite's runs from there.

Each run a test asks for is a fork of this server that runs `train_distribute.main(argv)` (or a worker
function) with its own environment, working folder, output files and session, exactly as a new
`python train_distribute.py` would. That launcher starts its ranks through torch's elastic agent as always, with
`train_distribute.main` as the entrypoint, so that the agent forks them: safe here, since neither this server nor a
launcher has run a parallel torch operation when it forks. A run then starts in a fraction of a second, instead of
seconds of imports for the launcher and for every rank. Tests of how a run starts and ends keep real interpreters.
The waits of torch's rendezvous are cut short here (main): a run differs from a user's only in starting sooner.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout.
    {"start": {...}}   fork a run (train_distribute's argv, its ranks forked or, with "ranks_as_interpreters", new
                       interpreters as a user's run has them; or a "call", or a "module" run as python -m does);
                       answers {"pid": N}
    {"poll": N}        answers {"code": exit code or null}
"""

import gc
import importlib
import json
import os
import resource
import runpy
import signal
import sys
import traceback

import matplotlib.backends.backend_agg  # noqa: F401 (what the picture's first drawing would import)
import matplotlib.figure  # noqa: F401
import torch
import torch._dynamo  # noqa: F401 (what DDP's constructor would import in every rank)
import torch.distributed.run  # noqa: F401 (torchrun, for the runs that start it)
import torchvision.datasets  # noqa: F401 (CIFAR-10, and torchvision's networks when one is swapped in)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

import tests.hooked_run
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
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])
    os.nice(request.get("nice", 0))  # a background scenario's run: the CPU the tests leave free
    if request.get("file_size_limit"):  # ulimit -f
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"],) * 2)
    tests.hooked_run.install_hooks()
    sys.modules["__main__"] = train_distribute  # as in `python train_distribute.py`: what worker processes import
    code = 1
    try:
        if "call" in request:  # "module:function", called with the arguments; returns the exit code
            module, name = request["call"].split(":")
            code = getattr(importlib.import_module(module), name)(*request["args"])
        elif "module" in request:  # python -m module argv...: torchrun, say
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        elif "script" in request:  # python path/to/script.py argv...: a copy of the project, say
            sys.argv = [request["script"], *request["argv"]]
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        else:
            sys.argv = ["train_distribute.py", *request["argv"]]
            sys.modules["__main__"] = (
                train_distribute  # as in `python train_distribute.py`: what worker processes import
            )
            ranks = sys.executable if request.get("ranks_as_interpreters") else train_distribute.main
            code = train_distribute.main(request["argv"], entrypoint=ranks)
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 0 if error.code is None else 1
    except BaseException:
        traceback.print_exc()  # as the interpreter would before exiting
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the server's own exit handlers


def main() -> None:
    # torch's agent sleeps 0 to 0.3 s before its first rendezvous, to spread many machines' first attempts over time,
    # and 1 s between its looks while it waits for another machine: here one machine starts a hundred runs a session,
    # and each would wait that long with the CPU idle; a look every 0.05 s costs the store nothing here
    sleep = dynamic_rendezvous._delay
    dynamic_rendezvous._delay = lambda seconds: None if isinstance(seconds, tuple) else sleep(min(seconds, 0.05))
    # each of its events names its caller through inspect.stack(), which reads every frame's source file: a quarter
    # of a second of CPU a run; the frame's own name is the same name
    dynamic_rendezvous.get_method_name = lambda depth=2: sys._getframe(depth).f_code.co_name
    torch.set_num_threads(1)  # never a thread pool here: a forked child could not start its own
    gc.freeze()  # the imports' objects: a child's full collection (every rank runs one as it leaves) skips them
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
