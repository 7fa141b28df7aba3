"""A real single-node Slurm for the tests: Debian's ``slurm-wlm`` and ``munge``, daemons started by hand.

``install()`` installs the packages with apt-get where they are missing (root only) or raises
``SlurmUnavailable`` saying why Slurm cannot be had. ``LocalSlurm.start(root)`` runs a private munged, slurmctld and
slurmd for this
host with every file under ``root`` (configuration via ``SLURM_CONF``, free ports, nothing in /etc touched) and
``stop()`` cancels the jobs left and ends the daemons. No systemd or cgroups: ``proctrack/linuxproc``,
``task/none``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import pace
from tests.support.leftovers import free_ports, is_launcher_var

BINARIES = ("sbatch", "scontrol", "scancel", "squeue", "srun", "slurmctld", "slurmd", "munged")
PACKAGES = ("slurm-wlm", "munge")
DONE_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class SlurmUnavailable(Exception):
    """Slurm cannot be had here. ``tried_apt``: root and apt-get were there and the install itself failed."""

    def __init__(self, reason: str, tried_apt: bool):
        super().__init__(reason)
        self.tried_apt = tried_apt


def install() -> float:
    """Install slurm-wlm and munge with apt-get where a binary is missing; returns the seconds it took.
    Raises ``SlurmUnavailable`` without root, without apt-get, or when apt-get fails."""
    t0 = time.time()
    if os.geteuid() != 0:
        raise SlurmUnavailable("needs root (to install slurm-wlm and munge and to run slurmd)", tried_apt=False)
    if not _missing():
        return 0.0
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"{', '.join(_missing())} missing and no apt-get to install {' '.join(PACKAGES)}", tried_apt=False
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed: {' '.join(last)}", tried_apt=True)
    if _missing():
        raise SlurmUnavailable(
            f"installed {' '.join(PACKAGES)} but {', '.join(_missing())} still missing", tried_apt=True
        )
    return time.time() - t0


@dataclass
class Job:
    id: str
    state: str
    exit_code: str  # "<code>:<signal>"
    restarts: int
    fields: dict[str, str] = field(repr=False)


@dataclass
class LocalSlurm:
    root: Path
    conf: Path  # slurm.conf: clients find this cluster through SLURM_CONF
    procs: list[subprocess.Popen]
    started_in_s: float

    @classmethod
    def start(cls, root: Path, cpus: int = 4) -> LocalSlurm:
        """munged, slurmctld and slurmd for this host, all state under ``root``; waits until the node is idle.

        ``cpus``: CPUs the node advertises (``config_overrides``: may exceed the machine's, so that 2-task jobs
        run on a 1- or 2-core machine)."""
        t0 = time.time()
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged (user munge) must reach its socket folder
        munge = root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        subprocess.run(["chown", "-R", "munge:munge", str(munge)], check=True)
        for d in ("state", "spool", "log"):
            (root / d).mkdir()
        host = socket.gethostname().split(".")[0]
        ctld_port, d_port = free_ports(2)
        conf = root / "slurm.conf"
        conf.write_text(
            "\n".join(
                [
                    "ClusterName=frodtest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={d_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CryptoType=crypto/munge",
                    # a requeued job waits cred_expire + 1 s
                    f"AuthInfo=socket={munge / 'munge.socket'},cred_expire=10",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "ReturnToService=2",
                    "MailProg=/bin/true",
                    "MinJobAge=3600",
                    "SlurmdParameters=config_overrides",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                    f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} "
                    "ThreadsPerCore=1 State=UNKNOWN",
                    f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )
        self = cls(root, conf, [], 0.0)
        try:
            self._spawn(
                [
                    "runuser",
                    "-u",
                    "munge",
                    "--",
                    "munged",
                    "-F",
                    f"--socket={munge / 'munge.socket'}",
                    f"--key-file={key}",
                    f"--log-file={munge / 'munged.log'}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--seed-file={munge / 'munged.seed'}",
                ],
                "munged",
            )
            self._wait(lambda: (munge / "munge.socket").exists(), "munged socket", 20)
            self._spawn(["slurmctld", "-D", "-i"], "slurmctld")
            self._wait(lambda: self._ok(["scontrol", "ping"]), "slurmctld", 30)
            self._spawn(["slurmd", "-D", "-N", host], "slurmd")
            self._wait(lambda: "idle" in self.run(["sinfo", "-h", "-o", "%T"]).stdout, "node idle", 60)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.time() - t0
        return self

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(
            subprocess.Popen(cmd, env=self.environ(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def _wait(self, ready, what: str, timeout: float) -> None:
        t0 = time.time()
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.time() - t0 > timeout:
                raise RuntimeError(
                    f"local Slurm: {what} not ready ({'exited: ' + str(dead) if dead else 'timeout'})\n{self.logs()}"
                )
            time.sleep(0.2)

    def _ok(self, cmd: list[str]) -> bool:
        return self.run(cmd).returncode == 0

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) without Slurm's job and input variables, with
        ``SLURM_CONF`` naming this cluster."""
        base = os.environ if base is None else base
        env = {
            k: v
            for k, v in base.items()
            if not is_launcher_var(k) and not k.startswith(("SBATCH_", "SRUN_", "SALLOC_"))
        }
        return dict(env, SLURM_CONF=str(self.conf))

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, or a script calling them) against this cluster, in ``env``."""
        timeout = pace.scaled(timeout)
        return subprocess.run(cmd, env=self.environ(env), capture_output=True, text=True, timeout=timeout, **kw)

    def job(self, job_id: str) -> Job:
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))
        return Job(
            job_id,
            fields.get("JobState", "?"),
            fields.get("ExitCode", "?"),
            int(fields.get("Restarts", "0") or 0),
            fields,
        )

    def wait(self, job_id: str, timeout: float = 300, states: set[str] = DONE_STATES) -> Job:
        """Poll until the job is in one of ``states`` (default: ended), or waits on a dependency that failed;
        fails with the daemon logs on timeout (the reference machine's seconds: ``tests.support.pace``)."""
        timeout = pace.scaled(timeout)
        t0 = time.time()
        while True:
            job = self.job(job_id)
            if job.state in states or job.fields.get("Reason") == "DependencyNeverSatisfied":
                return job
            if time.time() - t0 > timeout:
                raise AssertionError(f"job {job_id} still {job.state} after {timeout} s\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 15) -> str:
        parts = []
        for p in sorted((self.root / "log").glob("*")):
            lines = p.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {p.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what is still queued or running, wait for it to end, then stop slurmd, slurmctld, munged."""
        if self.procs and self.procs[-1].poll() is None and len(self.procs) == 3:
            self.run(["scancel", "--full", "--user", "root"])
            t0 = time.time()
            while self.run(["squeue", "-h"]).stdout.strip() and time.time() - t0 < 60:
                time.sleep(0.5)
        for p in reversed(self.procs):  # each daemon leads its own process group (start_new_session)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs.clear()
