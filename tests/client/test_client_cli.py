"""`shardserve up` as a real subprocess, used through `shardserve status/create/fetch/delete`, stopped by SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from waiting import wait_until

from shardserve.client.cli.main import main as cli_main
from shardserve.server.common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def shardserve(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "shardserve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`shardserve up --ranks 2` in the foreground of a subprocess; yields (process, coordinator address)."""
    state = tmp_path_factory.mktemp("state")
    log = (state / "up.log").open(
        "w"
    )  # the ranks log at INFO: a pipe nobody reads would fill and block them
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardserve",
            "up",
            "--ranks",
            "2",
            "--port",
            str(free_port()),
            "--state-dir",
            str(state),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True
    ).start()  # "": EOF
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None:  # the launcher prints this line once every rank registered
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line:
                break
            if line.startswith("coordinator: "):
                address = line.split(":", 1)[1].strip()
        assert address, f"no 'coordinator:' line in time; exit {proc.poll()}"
        yield proc, address
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert all(word in done.stderr for word in words), done.stderr


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """`shardserve ARGS` run by the console script's main() in this process (what a command does once the
    interpreter is up, without paying for one that imports torch): its exit code and output."""
    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["shardserve", *args], code, out, err)


@pytest.mark.slow
def test_create_status_fetch_delete(up, tmp_path, capsys):
    """Commands as processes (create, delete and a refusal, the coordinator taken from the environment) and
    through main() in this process (status, fetches, refusals: one line each)."""
    _, address = up
    env = {"SHARDSERVE_COORDINATOR": address}
    on = ("--coordinator", address)
    created = shardserve(
        "create", "cli-t", "--shape", "6,4", "--init", "arange", "--dim", "1", env=env
    )
    assert "created cli-t" in created.stdout
    status = in_process(capsys, *on, "status").stdout
    assert "cli-t" in status and "6x4" in status and "float32" in status and "split dim 1" in status
    assert "healthy" in status
    assert re.search(r"collective jobs: epoch \d+", status)
    assert status.count("127.0.0.1:") >= 3 and "yes" in status
    expected = torch.arange(24.0).reshape(6, 4)
    printed = in_process(capsys, *on, "fetch", "cli-t", "--offsets", "1,1", "--sizes", "2,2").stdout
    assert printed.split() == str(expected[1:3, 1:3]).split()
    out = tmp_path / "box.pt"
    box = ("--offsets", "2,0", "--sizes", "3,4", "-o", str(out))
    saved = in_process(capsys, *on, "fetch", "cli-t", *box)
    assert saved.returncode == 0 and "saved cli-t" in saved.stdout, saved.stderr
    assert torch.equal(torch.load(out), expected[2:5])
    one_line_error(
        in_process(capsys, *on, "fetch", "cli-t", "--offsets", "5,3", "--sizes", "2,2"),
        "sizes",
        "exceeds",
    )
    one_line_error(
        in_process(capsys, *on, "fetch", "cli-t", "--offsets=7,0"), "offsets"
    )  # no sizes given
    one_line_error(
        in_process(capsys, *on, "fetch", "cli-t", "-o", str(tmp_path / "no" / "dir.pt")),
        "-o ",
        "does not exist",
    )
    one_line_error(
        in_process(capsys, *on, "create", "cli-t", "--shape", "6,4"),
        "already exists",
        "pass --overwrite",
    )
    assert shardserve("delete", "cli-t", env=env).stdout.strip() == "deleted cli-t"
    one_line_error(shardserve("fetch", "cli-t", env=env, check=False), "cli-t", "not found")


def test_sigterm_stops_every_child(up):
    proc, _ = up
    children = descendants(proc.pid)
    assert len(children) >= 2  # at least the two rank processes
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) is not None
    wait_until(lambda: not any(alive(p) for p in children), 30, "every rank process to exit")
