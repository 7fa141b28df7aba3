"""Joining a process group (``frod_ds.runtime.rendezvous``): a stale launcher environment (``WORLD_SIZE=2`` and no
other rank) is said after a while, stopped by Ctrl-C and SIGTERM at once, and given up with one line; a join that
succeeds or fails is the caller's as if called directly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from frod_ds.runtime import rendezvous
from frod_ds.runtime.errors import FrodError
from tests.support import pace
from tests.support.leftovers import REPO, clean_env, free_port


def test_a_join_that_returns_or_raises_is_the_callers():
    seen = []
    rendezvous.join(lambda: seen.append(threading.current_thread().name), 0, 2, "h:1")
    assert seen == ["frod-rendezvous"]  # run in the helper thread
    with pytest.raises(ZeroDivisionError):
        rendezvous.join(lambda: 1 / 0, 0, 2, "h:1")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_join_nobody_answers_is_noted_then_given_up_with_what_to_do(monkeypatch, capsys, rank):
    """Every waiting rank says what it waits for (a lone rank 1, its RANK variable set, waited silently)."""
    monkeypatch.setattr(rendezvous, "NOTE_S", 0.2)
    monkeypatch.setenv("RANK", str(rank))
    released = threading.Event()
    t0 = time.monotonic()
    try:
        gave_up = rf"rank {rank} of 2: the other 1 rank\(s\) did not join at h:7 within 1 s"
        with pytest.raises(FrodError, match=gave_up):
            rendezvous.join(lambda: released.wait(30), rank, 2, "h:7", join_s=1.0)
    finally:
        released.set()
    assert time.monotonic() - t0 < pace.scaled(5)
    err = capsys.readouterr().err
    assert err.count(f"note: rank {rank} of 2 has waited") == 1 and "unset WORLD_SIZE and RANK" in err


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


@pytest.mark.parametrize(
    "sig, code, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted (Ctrl-C)")]
)
def test_a_stale_launcher_environment_stops_at_once_on_a_signal(tmp_path, sig, code, said):
    """``frod hjd`` with ``WORLD_SIZE=2 RANK=0`` and no other rank waits in torch's rendezvous (its store listens);
    SIGTERM or Ctrl-C then ends it within seconds, with one line and the command's exit code, nothing written."""
    from frod_ds.testing.toy import write_tiny_llama

    write_tiny_llama(tmp_path / "m", num_hidden_layers=1, hidden_size=16, intermediate_size=24, vocab_size=64)
    port = free_port()
    env = clean_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, "-m", "frod_ds", "hjd", "--model", str(tmp_path / "m"), "--device", "cpu"]
    proc = subprocess.Popen(  # SIGINT as in a terminal's foreground, whatever started this test (a script's
        # background job has it ignored, and Python then installs no Ctrl-C handler)
        [*cmd, "--out", str(tmp_path / "f")],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + pace.scaled(60)
        while not _listening(port) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and _listening(port), "the command never reached the rendezvous"
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=pace.scaled(15))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], err
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize(
    "env, says",
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 with WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT not"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "but MASTER_PORT not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
        ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID='x'"),
    ],
)
def test_a_launcher_environment_no_launcher_sets_is_one_line(env, says):
    """Values no launcher sets (left in a shell, typed by hand) are named with what to do, not torch's ValueError;
    ``RANK=0 WORLD_SIZE=1`` without an address is one process."""
    from frod_ds.runtime.launch_env import ProcessGroupSpec, process_group_spec

    with pytest.raises(FrodError, match=re.escape(says)) as e:
        process_group_spec(env)
    assert "to run one process" in str(e.value) or "free port" in str(e.value)
    assert process_group_spec({"RANK": "0", "WORLD_SIZE": "1"}) == ProcessGroupSpec(0, 1, 0, None)
    ok = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert process_group_spec(ok) == ProcessGroupSpec(1, 2, 1, "env://")


def test_a_command_in_a_half_set_launcher_environment_says_so_in_one_line(tmp_path):
    from tests.support import ranks

    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    res = ranks.run(
        0,
        [
            str(REPO / "tests" / "support" / "frod_main.py"),
            "hjd",
            "--model",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "f"),
        ],
        env,
        REPO,
        60,
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "MASTER_ADDR and MASTER_PORT not" in lines[0], res.stderr
    assert not (tmp_path / "f").exists()


def test_the_stores_own_timeout_waiting_for_ranks_is_the_same_one_line():
    """torch's TCPStore gives up waiting for the other ranks after the group's timeout (a stale ``WORLD_SIZE=2``,
    ``FROD_COLLECTIVE_TIMEOUT_MIN`` shorter than the join's bound): its DistStoreError becomes the line the join's
    own bound gives, not a traceback; another store error stays what it is."""
    import torch.distributed as dist

    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.rendezvous import join

    def timed_out():
        raise dist.DistStoreError("Timed out after 61 seconds waiting for clients. 1/2 clients joined.")

    with pytest.raises(FrodError, match=r"rank 0 of 2: the other 1 rank\(s\) did not join at h:1 within \d+ s"):
        join(timed_out, 0, 2, "h:1")

    def refused():
        raise dist.DistStoreError("connection refused")

    with pytest.raises(dist.DistStoreError, match="connection refused"):
        join(refused, 0, 2, "h:1")


def test_the_stores_other_give_ups_at_the_join_are_one_line_each():
    """A rank that never reaches rank 0 (its node failed, another port), a store's wait that ran out under another
    wording, and a second rank 0 on a port already taken: one line each, not torch's traceback."""
    import torch.distributed as dist

    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.rendezvous import join

    def raising(e: Exception):
        def connect():
            raise e

        return connect

    unreached = dist.DistNetworkError(
        "The client socket has timed out after 60000ms while trying to connect to (h, 1)."
    )
    with pytest.raises(FrodError, match=r"rank 1 of 2: rank 0 was not reached at h:1 within \d+ s"):
        join(raising(unreached), 1, 2, "h:1")
    waited = dist.DistStoreError("wait timeout after 60000ms, keys: /default_pg/0//cpu//0/2")
    with pytest.raises(FrodError, match=r"rank 1 of 3: the other 2 rank\(s\) did not join at h:1"):
        join(raising(waited), 1, 3, "h:1")
    closed = dist.DistNetworkError(
        "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"
    )
    with pytest.raises(FrodError, match=r"rank 1 of 3: rank 0 at h:1 closed the rendezvous before this rank joined"):
        join(raising(closed), 1, 3, "h:1")
    taken = dist.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 1, "
        "useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use"
    )
    with pytest.raises(FrodError, match=r"rank 0 of 2: the rendezvous address h:1 is already in use"):
        join(raising(taken), 0, 2, "h:1")
