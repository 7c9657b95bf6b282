"""A job of a killed Snakemake does not run on as an orphan (issue 24, case 1): the `dormouse` command watches
its Snakemake ancestor, and gpu-run's child gets a parent-death signal. A stand-in named `snakemake` runs
`bash -c 'dormouse gpu-run --gpus 0 -- sleep 120'` exactly as a rule's shell would; it is killed with -9."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dormouse.core.lifeline import snakemake_ancestor

REPO = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(proc.name))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def test_killing_snakemake_ends_its_job(tmp_path):
    fake = tmp_path / "snakemake"
    fake.write_text(f"#!{sys.executable}\nimport subprocess, time\n"
                    f"subprocess.Popen(['bash', '-c', '{sys.executable} -m dormouse.cli gpu-run --gpus 0 -- sleep 120'])\n"
                    "time.sleep(120)\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DORMOUSE_NO_LIFELINE", None)
    snake = subprocess.Popen([str(fake)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        sleeper = None
        while time.monotonic() < deadline and sleeper is None:
            tree = descendants(snake.pid)  # bash may exec its one command: gpu-run is then snakemake's child
            named = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree if alive(pid)}
            runner = next((p for p, argv in named.items() if b"gpu-run" in argv), None)
            sleeper = next((p for p, argv in named.items() if argv.startswith(b"sleep")), None)
            time.sleep(0.1)
        assert sleeper is not None, "the job never started"
        assert snakemake_ancestor(sleeper)[0] == snake.pid
        time.sleep(1.0)  # the watcher thread is up
        os.kill(snake.pid, signal.SIGKILL)  # snakemake alone: its job is orphaned
        snake.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (alive(runner) or alive(sleeper)):
            time.sleep(0.1)
        assert not alive(runner) and not alive(sleeper), "the job outlived its snakemake"
    finally:
        try:
            os.killpg(snake.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
