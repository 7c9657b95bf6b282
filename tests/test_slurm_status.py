"""dormouse.tools.slurm_status without a cluster: a stand-in executor class shaped like the plugin's
(check_active_jobs an async generator over query_job_status, as in plugin 2.8.0). The real thing
runs in tests/test_slurm_real.py."""

import asyncio
import sys
import types
from dataclasses import dataclass, field

from dormouse.tools import slurm_status


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, msg):
        self.lines.append(("warning", msg))

    def info(self, msg):
        self.lines.append(("info", msg))

    def debug(self, msg):
        self.lines.append(("debug", msg))


@dataclass
class JobInfo:
    external_jobid: str


@dataclass
class Settings:
    status_command: str = "sacct"
    init_seconds_before_status_checks: int = 20


def fake_plugin(answers):
    """A module with query_job_status answering from `answers` (a list of dicts or None, one per
    query) and an Executor whose check_active_jobs reports COMPLETED/FAILED, yields the rest, and
    (like 2.8.0) yields nothing when the query failed."""
    module = types.ModuleType("fake_slurm_plugin")

    async def query_job_status(command, logger):
        answer = answers.pop(0)
        if answer is None:
            logger.debug("SLURM query command failed: Slurm accounting storage is disabled")
            return None, None
        return answer, 0.01

    @dataclass
    class Executor:
        logger: Log = field(default_factory=Log)
        errors: list = field(default_factory=list)
        successes: list = field(default_factory=list)
        cancelled: list = field(default_factory=list)

        async def check_active_jobs(self, active_jobs):
            status, _ = await module.query_job_status("sacct -X", self.logger)
            if status is None:
                return
            for j in active_jobs:
                state = status.get(j.external_jobid)
                if state == "COMPLETED":
                    self.successes.append(j.external_jobid)
                elif state == "FAILED":
                    self.errors.append((j.external_jobid, None))
                else:
                    yield j

        def report_job_error(self, job, msg=None):
            self.errors.append((job.external_jobid, msg))

        def cancel_jobs(self, jobs):
            self.cancelled += [j.external_jobid for j in jobs]

    Executor.__module__ = module.__name__
    module.query_job_status, module.Executor = query_job_status, Executor
    sys.modules[module.__name__] = module
    return module


def check(executor, jobs):
    async def run():
        return [j async for j in executor.check_active_jobs(jobs)]

    return asyncio.run(run())


def test_guard_keeps_jobs_a_failed_check_would_drop_then_fails_them_loudly():
    now = [0.0]
    answers = [None, None, None]
    module = fake_plugin(answers)
    log = Log()
    guard = slurm_status.StatusGuard(timeout_s=120, logger=log, clock=lambda: now[0]).install(module.Executor)
    executor, jobs = module.Executor(), [JobInfo("7"), JobInfo("8")]

    assert [j.external_jobid for j in check(executor, jobs)] == ["7", "8"]  # the plugin alone yields none
    assert guard.counts["jobs.kept_after_failed_check"] == 2 and guard.counts["status_queries.failed"] == 1
    assert any("status unreadable (SLURM query command failed: Slurm accounting storage is disabled)" in m
               for level, m in log.lines if level == "warning")
    now[0] = 60
    assert len(check(executor, jobs)) == 2 and not executor.errors
    now[0] = 121
    assert check(executor, jobs) == []
    assert [e[0] for e in executor.errors] == ["7", "8"] and executor.cancelled == ["7", "8"]
    assert "status unreadable for 2.0 min" in executor.errors[0][1]
    assert "accounting storage is disabled" in executor.errors[0][1]
    assert guard.counts["jobs.failed_unreadable"] == 2


def test_guard_fails_a_job_the_status_query_stops_listing_and_passes_the_rest_through():
    now = [0.0]
    answers = [{"7": "RUNNING", "8": "RUNNING"}, {"8": "RUNNING", "9": "COMPLETED"}, {"8": "RUNNING", "10": "FAILED"}]
    module = fake_plugin(answers)
    guard = slurm_status.StatusGuard(timeout_s=30, logger=Log(), clock=lambda: now[0]).install(module.Executor)
    executor = module.Executor()
    jobs = [JobInfo("7"), JobInfo("8")]
    assert len(check(executor, jobs)) == 2
    now[0] = 10
    assert len(check(executor, jobs + [JobInfo("9")])) == 2  # 7 unlisted (kept for now), 9 done
    assert executor.successes == ["9"] and "7" in guard.unread_since
    now[0] = 45
    left = check(executor, jobs + [JobInfo("10")])
    assert [j.external_jobid for j in left] == ["8"]  # 7 failed by the guard, 10 by the plugin
    errors = dict(executor.errors)  # the plugin reports 10 first, the guard 7 after it
    assert set(errors) == {"7", "10"} and executor.cancelled == ["7"]
    assert "not listed by the status query" in errors["7"]


def test_choose_status_command_switches_to_squeue_only_when_sacct_cannot_answer():
    log = Log()
    settings = Settings()
    assert slurm_status.choose_status_command(settings, log, probe=lambda: None, min_job_age=lambda: 300) == "sacct"
    assert settings.status_command == "sacct" and not log.lines
    why = "sacct exited 1: Slurm accounting storage is disabled"
    assert slurm_status.choose_status_command(settings, log, probe=lambda: why, min_job_age=lambda: 300) == "squeue"
    assert settings.status_command == "squeue"
    (level, msg), = log.lines
    assert level == "warning" and why in msg and "MinJobAge = 300 s" in msg
    low = Settings()
    slurm_status.choose_status_command(low, log, probe=lambda: why, min_job_age=lambda: 30)
    assert "goes back to sacct" in log.lines[-1][1]  # the plugin's own fallback below 3 x init seconds
    explicit = Settings(status_command="squeue")
    assert slurm_status.choose_status_command(explicit, log, probe=lambda: 1 / 0) == "squeue"  # no probe
