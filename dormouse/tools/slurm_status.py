"""Job status under workflow/profiles/slurm: the status command this cluster can answer, and a
guard that fails a job whose status stays unreadable instead of losing it.

snakemake-executor-plugin-slurm 2.8.0 (pyproject's [slurm] extra) queries `sacct` whenever the binary exists.
On a cluster without accounting (AccountingStorageType=accounting_storage/none) every query fails
("Slurm accounting storage is disabled"); after `status_attempts` failed queries in one check the
plugin yields none of its active jobs, so they leave Snakemake's active list neither done nor
failed, and the run waits forever. A job that `squeue` stops listing (it ended more than MinJobAge
ago) is kept active forever the same way.

Installed by workflow/rules/common.smk's `onstart` in the main Snakemake process when the executor
is `slurm` (never inside a job):

1. `choose_status_command`: when the plugin's setting is `sacct` and `sacct` cannot answer here,
   the setting becomes `squeue` (logged as a warning with sacct's own error and MinJobAge).
2. `StatusGuard.install`: wraps the plugin's `check_active_jobs` (and `query_job_status`, to see
   which job ids each query returned and why a query failed). A job the plugin would drop after a
   failed check is kept active; a job whose state no query has returned for `timeout_s` is reported
   failed, with the reason, and cancelled (`scancel`, the plugin's own `cancel_jobs`). Counters:
   `status_queries.failed`, `jobs.kept_after_failed_check`, `jobs.failed_unreadable`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter

PLUGIN_VERSION = "2.8.0"  # the check_active_jobs / query_job_status this guard was written against


def probe_sacct(timeout_s: float = 30) -> str | None:
    """None when `sacct` answers on this machine; else why it does not (its own words)."""
    if not shutil.which("sacct"):
        return "sacct is not installed"
    try:
        proc = subprocess.run(["sacct", "-X", "--noheader", "--parsable2", "--format=JobIdRaw", "-j", "1"],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"sacct did not answer within {timeout_s:.0f} s"
    if proc.returncode != 0:
        return f"sacct exited {proc.returncode}: {(proc.stderr or proc.stdout).strip() or 'no message'}"
    return None


def min_job_age_s() -> int | None:
    """MinJobAge from `scontrol show config` (the plugin's own parser); None when unreadable."""
    from snakemake_executor_plugin_slurm.job_status_query import get_min_job_age

    return get_min_job_age()


def choose_status_command(settings, logger, probe=probe_sacct, min_job_age=min_job_age_s) -> str:
    """Keep the plugin's `status_command` when it works here; `sacct` that cannot answer becomes
    `squeue`. Returns the command in use."""
    if settings.status_command != "sacct":
        return settings.status_command
    why = probe()
    if why is None:
        return "sacct"
    settings.status_command = "squeue"
    age = min_job_age()
    threshold = 3 * settings.init_seconds_before_status_checks
    logger.warning(
        f"dormouse: SLURM job status by squeue, not sacct ({why}). squeue lists a finished job for "
        f"MinJobAge = {age if age is not None else 'unknown'} s after it ends; set "
        f"`slurm-status-command: squeue` in the profile (or --slurm-status-command squeue) to skip this probe.")
    if age is None or age < threshold:
        logger.warning(
            f"dormouse: MinJobAge {age} s is below 3 x slurm-init-seconds-before-status-checks ({threshold} s): "
            f"the plugin then goes back to sacct, so job states stay unreadable and jobs fail after the status timeout.")
    return "squeue"


class _RecordingLogger:
    """Passes everything to the plugin's logger; keeps the last debug line (a failed query's error)."""

    def __init__(self, logger):
        self._logger, self.last_debug = logger, None

    def debug(self, msg, *args, **kwargs):
        self.last_debug = str(msg)
        self._logger.debug(msg, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._logger, name)


class StatusGuard:
    def __init__(self, timeout_s: float, logger, clock=time.monotonic):
        self.timeout_s, self.logger, self.clock = timeout_s, logger, clock
        self.unread_since: dict[str, float] = {}  # SLURM job id -> first check its state was unreadable
        self.unread_reason: dict[str, str] = {}
        self.queries: list[tuple[set | None, str | None]] = []  # (job ids returned or None, error)
        self.counts: Counter = Counter()

    def install(self, executor_cls) -> StatusGuard:
        """Wrap executor_cls.check_active_jobs and its module's query_job_status (plugin 2.8.0).
        Returns the guard in use: an earlier one in this process takes this one's settings."""
        module = sys.modules[executor_cls.__module__]
        existing = getattr(executor_cls.check_active_jobs, "dormouse_guard", None)
        if existing is not None:
            existing.timeout_s, existing.logger, existing.clock = self.timeout_s, self.logger, self.clock
            return existing
        if not hasattr(module, "query_job_status"):
            raise RuntimeError(f"{module.__name__} has no query_job_status: dormouse.tools.slurm_status was written "
                               f"against snakemake-executor-plugin-slurm {PLUGIN_VERSION}; update the guard")
        original_query, original_check = module.query_job_status, executor_cls.check_active_jobs
        guard = self

        async def query_job_status(command, logger):
            recorder = _RecordingLogger(logger)
            status, duration = await original_query(command, recorder)
            if status is None:
                guard.counts["status_queries.failed"] += 1
                guard.queries.append((None, recorder.last_debug or f"`{command.split()[0]}` failed"))
            else:
                guard.queries.append((set(status), None))
            return status, duration

        async def check_active_jobs(executor, active_jobs):
            start = len(guard.queries)
            kept = [j async for j in original_check(executor, active_jobs)]
            for j in guard.review(executor, active_jobs, kept, guard.queries[start:]):
                yield j

        check_active_jobs.dormouse_guard = self
        module.query_job_status = query_job_status
        executor_cls.check_active_jobs = check_active_jobs
        return self

    def review(self, executor, active_jobs, kept, cycle) -> list:
        """The jobs to keep active after the plugin's check; fails those unreadable for too long."""
        if not cycle:  # no query ran (no active jobs): nothing to judge
            return kept
        kept_ids = {j.external_jobid for j in kept}
        last_ids, last_error = cycle[-1]  # the plugin decides on the last query's answer only
        now, out = self.clock(), []
        for j in active_jobs:
            jid = j.external_jobid
            if last_ids is not None and (jid in last_ids or jid.split("_")[0] in last_ids):
                if jid in self.unread_since:
                    self.logger.warning(f"dormouse: SLURM job {jid}: status readable again after "
                                        f"{now - self.unread_since.pop(jid):.0f} s")
                if jid in kept_ids:
                    out.append(j)
                continue  # the plugin reported it done or failed
            reason = last_error if last_ids is None else "not listed by the status query"
            if jid not in self.unread_since:
                self.unread_since[jid] = now
                self.logger.warning(f"dormouse: SLURM job {jid}: status unreadable ({reason}); it fails if it "
                                    f"stays so for {self.timeout_s / 60:g} min")
            self.unread_reason[jid] = reason
            waited = now - self.unread_since[jid]
            if waited >= self.timeout_s:
                self.counts["jobs.failed_unreadable"] += 1
                del self.unread_since[jid]
                executor.report_job_error(j, msg=(
                    f"SLURM job {jid}: status unreadable for {waited / 60:.1f} min (last: {reason}); failed by "
                    f"dormouse.tools.slurm_status and cancelled. On a cluster without accounting use squeue "
                    f"(README, 'Running on SLURM')."))
                try:
                    executor.cancel_jobs([j])
                except Exception as e:  # the job may be gone already; the failure above stands
                    self.logger.warning(f"dormouse: scancel {jid} failed: {e}")
                continue
            if jid not in kept_ids:
                self.counts["jobs.kept_after_failed_check"] += 1
            out.append(j)
        return out


def install(workflow, timeout_s: float) -> StatusGuard | None:
    """From the Snakefile's onstart: choose the status command and guard the checks (slurm executor only)."""
    plugin = workflow.executor_plugin
    if plugin is None or plugin.name != "slurm":
        return None
    from snakemake.logging import logger
    from snakemake_executor_plugin_slurm import Executor

    command = choose_status_command(workflow.executor_settings, logger)
    guard = StatusGuard(timeout_s, logger).install(Executor)
    logger.info(f"dormouse: SLURM job status by {command}; a job unreadable for {timeout_s / 60:g} min fails")
    return guard
