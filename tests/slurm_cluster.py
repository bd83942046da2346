"""A real two-node SLURM cluster on this machine, for tests/test_slurm.py, and README's batch script for it.

munged, slurmctld and one slurmd per node (n1, n2), all run as root from a temporary folder that SLURM_CONF points
to; both nodes are 127.0.0.1 and each slurmd is pinned to a CPU of its own, so that the ranks of one node do not
fight those of the other for the same cores (torch would give every rank a thread per core). Needs:

    apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge
"""

import contextlib
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

from tests.conftest import ROOT, clean_env, free_port

NODES = ("n1", "n2")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "taskset")
INSTALL = "apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge"
# the states of a job that has ended
DONE = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
CONFIG = """\
ClusterName=ddp-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
# munged's own socket; cred_expire: a requeued job is held for this + 1 s (2 minutes by default)
AuthInfo=socket={folder}/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
# a requeued job waits for its BeginTime (cred_expire + 1 s: starting it sooner fails, its credential is revoked);
# then it starts within 2 s, not at the next scheduling pass a minute later
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
ReturnToService=2
# finished jobs stay visible to scontrol (and can be requeued) for the whole module
MinJobAge=3600
# as on many clusters: one task that exits non-zero kills the others, unless the script's srun says otherwise
KillOnBadExit=1
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
NodeName=n1 NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [name for name in PROGRAMS if not shutil.which(name)]
    if absent:
        return f"SLURM is not installed (no {', '.join(absent)}): {INSTALL}"
    if os.geteuid() != 0:
        return "the SLURM daemons run as root here (SlurmUser=root): run the slurm tests as root"
    return None


class Cluster:
    """The daemons, started in the foreground as this process's children; `env` reaches the cluster."""

    def __init__(self) -> None:
        # munged wants every folder above its socket open to all: /tmp, not pytest's (0700) folders (removed at stop)
        self.folder = Path(tempfile.mkdtemp(prefix="slurm-cluster-", dir="/tmp"))
        self.folder.chmod(0o755)
        self.env = {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []
        self.logs: list = []

    def start(self) -> "Cluster":
        resolve_nodes()
        munge = {name: self.folder / f"munge.{name}" for name in ("socket", "key", "pid", "seed", "log")}
        munge["key"].write_bytes(os.urandom(1024))
        munge["key"].chmod(0o400)
        self._daemon(
            "munged",
            "--foreground",
            f"--socket={munge['socket']}",
            *(f"--{name}-file={munge[name]}" for name in ("key", "pid", "seed", "log")),
        )
        wait_for(munge["socket"].exists, 20, "munged did not start")
        ports = {"controller_port": free_port(), "n1_port": free_port(), "n2_port": free_port()}
        host = socket.gethostname().split(".")[0]  # slurmctld runs only where SlurmctldHost names it
        (self.folder / "slurm.conf").write_text(CONFIG.format(host=host, folder=self.folder, **ports))
        self._daemon("slurmctld", "-D")
        for node, cpus in zip(NODES, node_cpus(), strict=True):
            self._daemon("taskset", "-c", cpus, "slurmd", "-D", "-N", node)
        wait_for(lambda: self.node_states() == ["IDLE", "IDLE"], 60, f"the nodes did not come up: {self.folder}")
        return self

    def _daemon(self, *command: str) -> None:
        self.logs.append(open(self.folder / f"{command[0]}-{len(self.daemons)}.out", "w"))
        self.daemons.append(subprocess.Popen(command, env=self.env, stdout=self.logs[-1], stderr=subprocess.STDOUT))

    def command(self, *args: str) -> str:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, check=True, timeout=30).stdout

    def node_states(self) -> list[str]:
        try:
            nodes = self.command("scontrol", "show", "nodes", "-o").splitlines()
        except subprocess.SubprocessError:  # the controller is still starting
            return []
        return sorted(fields(line).get("State", "") for line in nodes)

    def submit(self, script: str, folder: Path) -> int:
        """sbatch the script from `folder`, which gets train_distribute.py (linked) as a user's copy would be."""
        (folder / "train_distribute.py").symlink_to(ROOT / "train_distribute.py")
        (folder / "job.sh").write_text(script)
        python = os.path.dirname(sys.executable)  # the script calls `torchrun`: this interpreter's
        env = clean_env(SLURM_CONF=self.env["SLURM_CONF"], PATH=f"{python}:{os.environ['PATH']}")
        sbatch = subprocess.run(
            ["sbatch", "--parsable", "job.sh"], cwd=folder, env=env, capture_output=True, text=True, timeout=30
        )
        assert sbatch.returncode == 0, sbatch.stderr
        return int(sbatch.stdout.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        return fields(self.command("scontrol", "show", "job", "-o", str(job_id)))

    def wait(self, job_id: int, timeout: float, until) -> dict[str, str]:
        """Poll the job until `until(job)`."""
        deadline = time.monotonic() + timeout
        while not until(job := self.job(job_id)):
            assert time.monotonic() < deadline, f"job {job_id} still {job['JobState']} after {timeout:.0f} s: {job}"
            time.sleep(0.5)
        return job

    def stop(self) -> None:
        """Cancel every job and wait for them to end, then end the daemons and what they left (job steps)."""
        try:
            for job_id in self.command("squeue", "-h", "-o", "%i").split():
                self.command("scancel", job_id)
            wait_for(lambda: not self.command("squeue", "-h").strip(), 90, "jobs did not end")
        except subprocess.SubprocessError:  # no controller (it did not start): no jobs
            pass
        finally:
            for daemon in reversed(self.daemons):
                daemon.terminate()
            for daemon in reversed(self.daemons):
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
            for pid in processes_of(self.env["SLURM_CONF"]):  # slurmstepd and its tasks are not our children
                os.kill(pid, signal.SIGKILL)
            for log in self.logs:
                log.close()
            shutil.rmtree(self.folder, ignore_errors=True)


def fields(line: str) -> dict[str, str]:
    """scontrol's one-line `Key=Value Key=Value ...`."""
    return dict(re.findall(r"(\S+?)=(\S*)", line))


def node_cpus() -> list[str]:
    """taskset's CPU for each node: one each (as fast here as on a machine with many cores), or both the same one."""
    cpus = sorted(os.sched_getaffinity(0))
    return [str(cpus[0]), str(cpus[1 % len(cpus)])]


def resolve_nodes() -> None:
    """n1 and n2 must resolve (torchrun's rendezvous endpoint is the first node's name): /etc/hosts gets them."""
    try:
        for node in NODES:
            socket.gethostbyname(node)
    except OSError:
        with open("/etc/hosts", "a") as hosts:
            hosts.write(f"127.0.0.1 {' '.join(NODES)}\n")


def processes_of(slurm_conf: str) -> list[int]:
    """The processes whose environment names this cluster's SLURM_CONF (except this one)."""
    needle, found = f"SLURM_CONF={slurm_conf}\0".encode(), []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # gone meanwhile
            if entry.name.isdigit() and int(entry.name) != os.getpid() and needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
    return found


def wait_for(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


# ----------------------------------------------------------------------------- README's batch script


def readme_script() -> str:
    """README's SLURM batch script: its ```bash block that starts with #!/bin/bash and #SBATCH lines."""
    readme = (ROOT / "README.md").read_text()
    found = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", readme, re.DOTALL)
    assert len(found) == 1, f"README.md has {len(found)} ```bash blocks that start with #!/bin/bash and #SBATCH"
    return found[0]


def batch_script(time_limit: str, settings: list[str]) -> str:
    """README's script with this machine's resources (one CPU per node, no GPU, one rank per node, both nodes
    127.0.0.1, a free port), another time limit, and these training settings. Nothing else changes."""
    script = readme_script()
    for pattern, new in (
        (r" --gpus-per-node=\S+", ""),
        (r"--cpus-per-task=\S+", "--cpus-per-task=1"),
        (r"--time=\S+", f"--time={time_limit}"),
        (r"--nproc_per_node=\d+", "--nproc_per_node=1"),
        # a free port for the rendezvous, and the address each torchrun gives the others (else the machine's full
        # name, which may not resolve here)
        (r'(--rdzv_endpoint="\$head:)\d+"', rf'\g<1>{free_port()}"'),
        (r'(--rdzv_id="\$SLURM_JOB_ID")', r"\1 --local_addr=127.0.0.1"),
        (r'(--output_dir="runs/\$SLURM_JOB_ID")', r"\1 " + " ".join(settings)),
    ):
        script, count = re.subn(pattern, new, script)
        assert count == 1, f"README's batch script has {count} matches of {pattern!r}, the tests expect one"
    return script
