"""A real N-node Slurm on one machine for the tests: each compute node a ``slurmd`` in its own network, UTS, IPC
and mount namespaces (own address, hostname, ``/etc/hosts``, ``/dev/shm``) on a bridge this module creates;
``munged`` and ``slurmctld`` on the host side of the bridge. The nodes share the filesystem the way a cluster
shares one. Nothing leaves the machine: the bridge has a private /24 no other interface here uses, and the
nodes have no default route.

``SlurmCluster.start(root, nodes=3)`` brings it up (about 1 s) and ``stop()`` tears it down whatever state it is
in: jobs cancelled, daemons stopped by pid, every process left in a node's namespace killed, veths, namespaces
and the bridge deleted, every wait bounded. Names (bridge, namespaces, veths, subnet, ports) are unique per
start, so two test runs on one machine do not collide. ``kill_node``/``restart_node`` simulate a node failing
(every process on it killed, its ``/dev/shm`` gone) and coming back. Needs root (``available()`` says why not).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import pace
from tests.support.leftovers import free_ports
from tests.support.slurm_local import LocalSlurm, install

TOOLS = ("ip", "nsenter", "unshare", "setpriv", "mount")


def available() -> str | None:
    """``None`` where a cluster can be started here, else the one-line reason it cannot (no root, no
    namespaces, a tool missing). Installs slurm-wlm/munge where missing (raises ``SlurmUnavailable`` when
    apt-get itself fails)."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces, slurmd)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    install()
    probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip() or probe.returncode}"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.x.0/24 that no interface on this machine has an address in (several runs side by side)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken = {int(m.group(1)) for m in re.finditer(r"inet 10\.77\.(\d+)\.", used)}
    for third in secrets.SystemRandom().sample(range(1, 255), 254):
        if third not in taken:
            return ipaddress.ip_network(f"10.77.{third}.0/24")
    raise RuntimeError("no free 10.77.x.0/24 subnet for a test cluster")


def _alive(pid: int) -> bool:
    """Running and not a zombie (PID 1 here may reap late; a zombie holds no socket and no file)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    t0 = time.time()
    while time.time() - t0 < timeout:
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass
class SlurmCluster:
    root: Path
    conf: Path  # slurm.conf: clients find this cluster through SLURM_CONF
    tag: str  # unique part of every name this start created
    subnet: ipaddress.IPv4Network
    nodes: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # "munged", "slurmctld", "n1", ...
    created: list[tuple[str, str]] = field(default_factory=list)  # ("netns"|"link", name), for tear-down
    started_in_s: float = 0.0

    # --- names -------------------------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"frod{self.tag}{node}"

    def addr(self, node: str) -> str:
        return str(self.subnet.network_address + 10 + int(node[1:]))

    @property
    def bridge(self) -> str:
        return f"frbr{self.tag}"

    @property
    def host_addr(self) -> str:
        return str(self.subnet.network_address + 1)

    # --- start -------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, nodes: int = 2, cpus: int = 2) -> SlurmCluster:
        """munged and slurmctld on the host, ``nodes`` slurmds (``n1`` … ``nN``) each advertising ``cpus``
        CPUs (``config_overrides``: may exceed the machine's); waits until every node is idle."""
        t0 = time.time()
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged (user munge) must reach its socket folder
        self = cls(root, root / "slurm.conf", secrets.token_hex(3), _free_subnet(), [f"n{i + 1}" for i in range(nodes)])
        try:
            self._network()
            self._write_config(cpus)
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
            self._wait(lambda: self.run(["scontrol", "ping"]).returncode == 0, "slurmctld", 30)
            for node in self.nodes:
                self.restart_node(node)
            self.wait_nodes("idle", self.nodes, 60)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.time() - t0
        return self

    def _network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.created.append(("link", self.bridge))
        _run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            ns, veth = self.netns(node), f"frv{self.tag}{node}"
            _run(["ip", "netns", "add", ns])
            self.created.append(("netns", ns))
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self.created.append(("link", veth))
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            for cmd in (
                ["ip", "addr", "add", f"{self.addr(node)}/24", "dev", "eth0"],
                ["ip", "link", "set", "eth0", "up"],
                ["ip", "link", "set", "lo", "up"],
            ):
                _run(["ip", "-n", ns, *cmd[1:]])
        host = socket.gethostname().split(".")[0]
        (self.root / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.host_addr} {host}\n" + "".join(f"{self.addr(n)} {n}\n" for n in self.nodes)
        )
        (self.root / "resolv.conf").write_text("")

    def _write_config(self, cpus: int) -> None:
        r = self.root
        for d in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctld_port, d_port = free_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName=frod{self.tag}",
                    f"SlurmctldHost={host}({self.host_addr})",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={d_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    # cred_expire: a requeued job waits it out (default 120 s)
                    "AuthType=auth/munge",
                    "CryptoType=crypto/munge",
                    f"AuthInfo=socket={r / 'munge' / 'munge.socket'},cred_expire=10",
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
                    # a dead node is noticed in ~SlurmdTimeout and the queue looked at every few seconds
                    # (defaults 300, 60); a message to it is given up after MessageTimeout (default 10): a failed
                    # node's job is requeued ~15 s after the failure instead of ~25, and done completing in ~3 s
                    "SlurmdTimeout=6",
                    "MessageTimeout=5",
                    "SchedulerParameters=sched_interval=2,bf_interval=2",
                    "KillWait=5",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool' / '%n'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
                    *(
                        f"NodeName={n} NodeAddr={self.addr(n)} CPUs={cpus} Boards=1 SocketsPerBoard=1 "
                        f"CoresPerSocket={cpus} "
                        "ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN"
                        for n in self.nodes
                    ),
                    f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o755, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        subprocess.run(["chown", "-R", "munge:munge", str(munge)], check=True)
        # setpriv, not runuser: runuser stays as a parent, and the pid we hold must be munged's own
        self._spawn(
            "munged",
            [
                "setpriv",
                "--reuid",
                "munge",
                "--regid",
                "munge",
                "--init-groups",
                "munged",
                "-F",
                f"--socket={munge / 'munge.socket'}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        self._wait(lambda: (munge / "munge.socket").exists(), "munged socket", 20)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "a")
        try:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=self.environ(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait(self, ready, what: str, timeout: float) -> None:
        timeout = pace.scaled(timeout)
        t0 = time.time()
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.time() - t0 > timeout:
                raise RuntimeError(
                    f"test Slurm: {what} not ready ({'exited: ' + str(dead) if dead else 'timeout'})\n{self.logs()}"
                )
            time.sleep(0.1)

    # --- nodes -------------------------------------------------------------------------------------------
    def restart_node(self, node: str) -> None:
        """Start ``node``'s slurmd in fresh UTS/IPC/mount namespaces inside its network namespace: its own
        hostname, ``/etc/hosts`` and an empty ``/dev/shm``. (``nsenter``, not ``ip netns exec``: that remounts
        /sys, and slurmd then finds no cgroup filesystem and dies.)"""
        r = self.root
        inner = (
            f"hostname {node} && mount --bind {r / 'hosts'} /etc/hosts && mount --bind {r / 'resolv.conf'} "
            f"/etc/resolv.conf && mount -t tmpfs -o size=1g,mode=1777 shm-{node} /dev/shm && exec slurmd -D"
        )
        self._spawn(
            node,
            [
                "nsenter",
                f"--net=/run/netns/{self.netns(node)}",
                "unshare",
                "--uts",
                "--ipc",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                inner,
            ],
        )

    def node_pids(self, node: str) -> list[int]:
        out = _run(["ip", "netns", "pids", self.netns(node)], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: str) -> None:
        """Every process on ``node`` (slurmd, job steps, ranks) killed at once: the node has failed."""
        pids = self.node_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = _wait_gone(pids, 20)
        assert not left, f"{node}: processes {left} survived SIGKILL"
        proc = self.procs.pop(node, None)
        if proc is not None:
            proc.wait(timeout=20)

    def node_state(self, node: str) -> str:
        out = self.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.split()
        return out[0] if out else "?"

    def wait_nodes(self, state: str, nodes: list[str], timeout: float) -> None:
        """Until each of ``nodes`` reports ``state`` (``idle``, ``down`` …; a trailing ``*`` ignored)."""
        self._wait(
            lambda: all(self.node_state(n).rstrip("*~#").startswith(state) for n in nodes),
            f"nodes {nodes} {state}",
            timeout,
        )

    def on_node(self, node: str, cmd: list[str]) -> subprocess.CompletedProcess:
        """``cmd`` inside ``node``'s namespaces (its slurmd's: ``sh -c 'exec slurmd'`` keeps the pid we started),
        e.g. to put a file into that node's own ``/dev/shm``."""
        pid = str(self.procs[node].pid)
        return subprocess.run(
            ["nsenter", "-t", pid, "--net", "--uts", "--ipc", "--mount", *cmd],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # --- clients -----------------------------------------------------------------------------------------
    environ = LocalSlurm.environ
    run = LocalSlurm.run
    job = LocalSlurm.job
    wait = LocalSlurm.wait
    logs = LocalSlurm.logs

    # --- stop --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the jobs, stop the daemons by pid, kill what is left in each namespace, delete veths,
        namespaces and bridge. Every wait is bounded; safe to call on a half-started cluster."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                self.run(["scancel", "--full", "--user", "root"], timeout=10)
                t0 = time.time()
                while self.run(["squeue", "-h"], timeout=10).stdout.strip() and time.time() - t0 < 20:
                    time.sleep(0.3)
            except subprocess.TimeoutExpired:
                pass
        for name in [n for n in self.nodes if n in self.procs] + ["slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()  # our own child, by pid
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for kind, name in self.created:
            if kind == "netns":  # job processes a dead slurmd left behind
                pids = [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _wait_gone(pids, 10)
        for kind, name in reversed(self.created):
            _run(["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name], check=False)
        self.created.clear()
