"""GPU slot locks: concurrent jobs get disjoint CUDA_VISIBLE_DEVICES; a full pool makes a job wait."""

import os
import subprocess
import sys
import time

import pytest

from dormouse.train.devices import gpu_slots

HOLD = "import os, sys, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(float(sys.argv[1]))"


def gpu_run(env, gpus, hold_s):
    return subprocess.Popen([sys.executable, "-m", "dormouse.cli", "gpu-run", "--gpus", str(gpus), "--",
                             sys.executable, "-c", HOLD, str(hold_s)], env=env, stdout=subprocess.PIPE, text=True)


@pytest.fixture()
def env(tmp_path):
    return {**os.environ, "DORMOUSE_GPUS": "0,1", "DORMOUSE_GPU_LOCK_DIR": str(tmp_path / "locks")}


def test_concurrent_jobs_get_disjoint_devices(env):
    a, b = gpu_run(env, 1, 1.5), gpu_run(env, 1, 1.5)
    seen = {a.stdout.readline().strip(), b.stdout.readline().strip()}
    assert seen == {"0", "1"}
    assert a.wait() == 0 and b.wait() == 0


def test_full_pool_waits_and_two_gpu_job_gets_both(env):
    first = gpu_run(env, 2, 1.0)
    assert first.stdout.readline().strip() == "0,1"
    t0 = time.monotonic()
    second = gpu_run(env, 1, 0)
    assert second.stdout.readline().strip() in {"0", "1"}
    assert time.monotonic() - t0 > 0.5  # it waited for the first job's slots
    assert first.wait() == 0 and second.wait() == 0


def test_killed_holder_frees_its_slot(env, monkeypatch):
    holder = gpu_run(env, 2, 3)
    assert holder.stdout.readline().strip() == "0,1"
    holder.kill()
    holder.wait()
    for k in ("DORMOUSE_GPUS", "DORMOUSE_GPU_LOCK_DIR"):
        monkeypatch.setenv(k, env[k])
    # The runner (parent of the killed child) still holds the lock until it exits; it exits with the child.
    with gpu_slots(2, poll_s=0.05, timeout_s=10) as devices:
        assert devices == ["0", "1"]


def test_asking_for_more_than_the_pool_is_an_error(env, monkeypatch):
    monkeypatch.setenv("DORMOUSE_GPUS", "0")
    with pytest.raises(RuntimeError, match="2 GPU"):
        with gpu_slots(2):
            pass
