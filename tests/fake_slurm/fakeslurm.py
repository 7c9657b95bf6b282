"""A fake SLURM for tests: sbatch runs the job locally, sacct/squeue report what happened.

Put this directory first on PATH. Every command appends one JSON line
{"cmd", "argv", "cwd", ...} to $FAKE_SLURM_LOG (default $FAKE_SLURM_STATE/calls.jsonl);
job state lives in $FAKE_SLURM_STATE (default ${TMPDIR:-/tmp}/fake_slurm_<uid>):
next_id (counter) and jobs/<id>.json, jobs/<id>.sh.

- sbatch: parses the options it knows (anything else is an error, as on a real cluster), assigns
  an incrementing id, runs the script (--wrap string, a script file, or stdin) synchronously in
  -D with the SLURM_* variables a job sees, output to --output (%j/%x expanded), records
  COMPLETED/FAILED, prints "<id>" with --parsable ("Submitted batch job <id>" without).
- sacct / squeue: the recorded jobs, filtered by -j/--jobs, --name, -u; sacct fields by --format
  (JobIdRaw, JobID, State, ExitCode, JobName, Account, Partition, NodeList, Reason, ...),
  --parsable2 / --parsable / fixed width, --noheader; squeue %i %T %j %P %a tokens, --states.
- scancel: marks unfinished jobs CANCELLED.
- srun: drops its own options and execs the command (stdin passes through: `srun ... sh -s`).
- sinfo -o %P: partitions from $FAKE_SLURM_PARTITIONS (default "cpu*,gpu"; * = default).
- sacctmgr ... list user ... format=account: accounts from $FAKE_SLURM_ACCOUNTS (default "fake_account").
- scontrol show config: MaxArraySize / MinJobAge ($FAKE_SLURM_MIN_JOB_AGE, default 300).
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

FIRST_JOB_ID = 1001
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"}


def state_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"fake_slurm_{os.getuid()}"
    path = Path(os.environ.get("FAKE_SLURM_STATE") or default)
    (path / "jobs").mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def locked(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield fh
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def log_call(cmd: str, argv: list[str], **extra) -> None:
    path = Path(os.environ.get("FAKE_SLURM_LOG") or state_dir() / "calls.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"cmd": cmd, "argv": argv, "cwd": os.getcwd(), "time": time.time(), **extra}) + "\n"
    with locked(path) as fh:
        fh.write(line)


def die(cmd: str, msg: str, code: int = 1):
    print(f"{cmd}: error: {msg}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# option parsing: {long name: (short alias or None, takes a value)}

SBATCH_OPTS = {
    "parsable": (None, False), "job-name": ("J", True), "output": ("o", True), "error": ("e", True),
    "export": (None, True), "comment": (None, True), "account": ("A", True), "partition": ("p", True),
    "time": ("t", True), "mem": (None, True), "mem-per-cpu": (None, True), "cpus-per-task": ("c", True),
    "cpus-per-gpu": (None, True), "ntasks": ("n", True), "ntasks-per-gpu": (None, True),
    "ntasks-per-node": (None, True), "nodes": ("N", True), "gpus": ("G", True), "gres": (None, True),
    "chdir": ("D", True), "wrap": (None, True), "array": ("a", True), "clusters": ("M", True),
    "constraint": ("C", True), "qos": ("q", True), "requeue": (None, False), "no-requeue": (None, False),
    "exclude": ("x", True), "reservation": (None, True),
}
SRUN_OPTS = {
    "ntasks": ("n", True), "nodes": ("N", True), "cpus-per-task": ("c", True), "cpus-per-gpu": (None, True),
    "cpu-bind": (None, True), "gpus": ("G", True), "gres": (None, True), "mem": (None, True),
    "mem-per-cpu": (None, True), "job-name": ("J", True), "jobid": (None, True), "partition": ("p", True),
    "account": ("A", True), "time": ("t", True), "output": ("o", True), "error": ("e", True),
    "chdir": ("D", True), "exclusive": (None, False), "export": (None, True), "ntasks-per-gpu": (None, True),
}


def parse_opts(cmd: str, argv: list[str], spec: dict, strict: bool = True) -> tuple[dict, list[str]]:
    """GNU-style options up to the first positional; returns ({long: value or True}, rest)."""
    short = {s: name for name, (s, _) in spec.items() if s}
    opts, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return opts, argv[i + 1:]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name not in spec:
                if strict:
                    die(cmd, f"unrecognized option '{arg}'")
                opts[name] = value if eq else True
                i += 1
                continue
            takes = spec[name][1]
        elif arg.startswith("-") and len(arg) > 1:
            if arg[1] not in short:
                if strict:
                    die(cmd, f"invalid option -- '{arg[1]}'")
                i += 1
                continue
            name, takes = short[arg[1]], spec[short[arg[1]]][1]
            if not takes and len(arg) > 2:  # bundled flags: -nu user == -n -u user
                opts[name] = True
                argv = argv[:i] + ["-" + arg[2:]] + argv[i + 1:]
                continue
            eq, value = ("=", arg[2:]) if len(arg) > 2 else ("", "")
        else:
            return opts, argv[i:]
        if takes and not eq:
            if i + 1 >= len(argv):
                die(cmd, f"option '{arg}' requires an argument")
            value = argv[i + 1]
            i += 1
        opts[name] = value if takes else True
        i += 1
    return opts, []


# ---------------------------------------------------------------------------------------------
# job records


def job_path(job_id: str) -> Path:
    return state_dir() / "jobs" / f"{job_id}.json"


def write_job(job: dict) -> None:
    path = job_path(job["id"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    tmp.replace(path)


def all_jobs() -> list[dict]:
    jobs = []
    for p in sorted((state_dir() / "jobs").glob("*.json"), key=lambda p: int(p.stem)):
        try:
            jobs.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            pass  # being replaced right now
    return jobs


def next_job_id() -> str:
    with locked(state_dir() / "next_id") as fh:
        fh.seek(0)
        text = fh.read().strip()
        job_id = int(text) if text else FIRST_JOB_ID
        fh.seek(0)
        fh.truncate()
        fh.write(str(job_id + 1))
    return str(job_id)


def expand_filename(pattern: str, job_id: str, name: str) -> str:
    subs = {"j": job_id, "J": job_id, "x": name, "u": getpass.getuser(), "A": job_id, "a": "0", "%": "%",
            "N": "fakenode", "n": "0", "t": "0", "s": "batch"}
    return re.sub(r"%(\d*)([%jJxuAaNnts])", lambda m: subs[m.group(2)].zfill(int(m.group(1) or 0)), pattern)


def to_int(value, default: int) -> int:
    try:
        return int(str(value).split(":")[-1].rstrip("GMTK"))
    except (TypeError, ValueError):
        return default


def sbatch(argv: list[str]) -> int:
    stdin = None
    opts, rest = parse_opts("sbatch", argv, SBATCH_OPTS)
    if "array" in opts:
        die("sbatch", "the fake sbatch does not implement --array")
    if "wrap" in opts:
        if rest:
            die("sbatch", "script arguments not permitted with --wrap option")
        script = f"#!/bin/sh\n# This script was created by sbatch --wrap.\n\n{opts['wrap']}\n"
    elif rest and rest[0] != "-":
        script = stdin = sys.stdin.read() if rest[0] == "/dev/stdin" else Path(rest[0]).read_text()
    else:
        script = stdin = sys.stdin.read()
    if not script.startswith("#!"):
        die("sbatch", "This does not look like a batch script.  The first line must start with #! "
                      "followed by the path to an interpreter.")
    job_id = next_job_id()
    submit_dir = os.getcwd()
    workdir = opts.get("chdir") or submit_dir
    name = opts.get("job-name") or (Path(rest[0]).name if rest else "wrap" if "wrap" in opts else "sbatch")
    job = {
        "id": job_id, "name": name, "state": "PENDING", "exit_code": None, "user": getpass.getuser(),
        "account": opts.get("account") or "", "partition": opts.get("partition") or default_partition(),
        "comment": opts.get("comment") or "", "opts": opts, "submit_time": time.time(),
    }
    write_job(job)
    log_call("sbatch", argv, job_id=job_id, opts=opts, script=script, stdin=stdin)

    script_path = state_dir() / "jobs" / f"{job_id}.sh"
    script_path.write_text(script)
    script_path.chmod(0o755)
    env = dict(os.environ) if opts.get("export", "ALL").split(",")[0] != "NONE" else {"PATH": os.environ["PATH"]}
    cpus = to_int(opts.get("cpus-per-task"), 1)
    env.update({
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": name,
        "SLURM_SUBMIT_DIR": submit_dir, "SLURM_SUBMIT_HOST": os.uname().nodename,
        "SLURM_JOB_PARTITION": job["partition"], "SLURM_JOB_ACCOUNT": job["account"],
        "SLURM_CLUSTER_NAME": "fake", "SLURMD_NODENAME": "fakenode", "SLURM_JOB_NODELIST": "fakenode",
        "SLURM_NODELIST": "fakenode", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
        "SLURM_NTASKS": str(to_int(opts.get("ntasks"), 1)), "SLURM_CPUS_PER_TASK": str(cpus),
        "SLURM_CPUS_ON_NODE": str(cpus), "SLURM_JOB_CPUS_PER_NODE": str(cpus),
    })
    if opts.get("mem"):
        env["SLURM_MEM_PER_NODE"] = str(to_int(opts["mem"], 0))
    if opts.get("mem-per-cpu"):
        env["SLURM_MEM_PER_CPU"] = str(to_int(opts["mem-per-cpu"], 0))
    if opts.get("time"):
        env["SLURM_JOB_TIME_LIMIT"] = str(opts["time"])  # not a real SLURM variable; for tests
    if opts.get("gpus"):
        env["SLURM_GPUS"] = str(opts["gpus"])
    if opts.get("gres"):
        env["SLURM_JOB_GRES"] = str(opts["gres"])

    output = expand_filename(opts.get("output") or "slurm-%j.out", job_id, name)
    output = Path(workdir, output)
    job.update(state="RUNNING", start_time=time.time(), output=str(output))
    write_job(job)
    if not output.parent.is_dir():  # real SLURM does not create it either: the job fails, no log
        rc = 1
    else:
        with open(output, "w") as out:
            rc = subprocess.call([str(script_path)], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT)
    job = json.loads(job_path(job_id).read_text())
    if job["state"] == "RUNNING":
        job["state"] = "COMPLETED" if rc == 0 else "FAILED"
    job.update(exit_code=rc, end_time=time.time())
    write_job(job)
    print(job_id if "parsable" in opts else f"Submitted batch job {job_id}")
    return 0


# ---------------------------------------------------------------------------------------------
# queries

SACCT_OPTS = {
    "allusers": ("a", False), "allocations": ("X", False), "brief": ("b", False), "clusters": ("M", True),
    "endtime": ("E", True), "format": ("o", True), "jobs": ("j", True), "long": ("l", False),
    "name": (None, True), "noheader": ("n", False), "parsable": ("p", False), "parsable2": ("P", False),
    "starttime": ("S", True), "state": ("s", True), "user": ("u", True), "units": (None, True),
}


def field_value(job: dict, field: str, job_id: str) -> str:
    key = field.lower()
    if key in ("jobidraw", "jobid"):
        return job_id
    if key == "state":
        return job["state"]
    if key == "exitcode":
        return f"{job['exit_code'] or 0}:0"
    if key in ("jobname", "name"):
        return job["name"]
    if key == "nodelist":
        return "fakenode"
    if key == "reason":
        return "None"
    if key == "comment":
        return job["comment"]
    if key in ("account", "partition", "user"):
        return job[key]
    if key == "elapsed":
        secs = int((job.get("end_time") or time.time()) - (job.get("start_time") or time.time()))
        return time.strftime("%H:%M:%S", time.gmtime(secs))
    return ""


def sacct(argv: list[str]) -> int:
    # strict=False: the plugin's account guess passes "| tail -1" through shlex as arguments
    opts, rest = parse_opts("sacct", argv, SACCT_OPTS, strict=False)
    log_call("sacct", argv)
    fields = [f.split("%")[0] for f in str(opts.get("format", "JobID,JobName,Partition,Account,State,ExitCode")).split(",") if f]
    widths = [to_int(f.split("%")[1].lstrip("-"), 10) if "%" in f else 10 for f in str(opts.get("format", "")).split(",") if f] or [10] * len(fields)
    rows = []
    wanted = str(opts["jobs"]).split(",") if "jobs" in opts else None
    names = str(opts["name"]).split(",") if "name" in opts else None
    for job in all_jobs():
        if names and job["name"] not in names:
            continue
        if "user" in opts and job["user"] != opts["user"]:
            continue
        if wanted is not None:
            if job["id"] in wanted:
                rows.append([field_value(job, f, job["id"]) for f in fields])
            # job steps (<id>.<step>) have no record: print nothing for them
            continue
        rows.append([field_value(job, f, job["id"]) for f in fields])
    if opts.get("parsable2") or opts.get("parsable"):
        end = "|" if opts.get("parsable") and not opts.get("parsable2") else ""
        lines = ([] if opts.get("noheader") else ["|".join(fields) + end]) + ["|".join(r) + end for r in rows]
    else:
        fmt = lambda cells: " ".join(c[:w].ljust(w) for c, w in zip(cells, widths)).rstrip()
        lines = ([] if opts.get("noheader") else [fmt(fields), fmt(["-" * w for w in widths])]) + [fmt(r) for r in rows]
    if lines:
        print("\n".join(lines))
    return 0


SQUEUE_OPTS = {
    "format": ("o", True), "states": ("t", True), "noheader": ("h", False), "name": ("n", True),
    "jobs": ("j", True), "user": ("u", True), "me": (None, False), "clusters": ("M", True),
}


def squeue(argv: list[str]) -> int:
    opts, _ = parse_opts("squeue", argv, SQUEUE_OPTS, strict=False)
    log_call("squeue", argv)
    fmt = str(opts.get("format", "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"))
    states = str(opts.get("states", "PENDING,RUNNING")).upper().split(",")
    names = str(opts["name"]).split(",") if "name" in opts else None
    wanted = str(opts["jobs"]).split(",") if "jobs" in opts else None
    tokens = {"i": lambda j: j["id"], "A": lambda j: j["id"], "T": lambda j: j["state"], "j": lambda j: j["name"],
              "P": lambda j: j["partition"], "a": lambda j: j["account"], "u": lambda j: j["user"],
              "t": lambda j: {"COMPLETED": "CD", "FAILED": "F", "RUNNING": "R", "PENDING": "PD"}.get(j["state"], "CA"),
              "k": lambda j: j["comment"], "N": lambda j: "fakenode", "R": lambda j: "fakenode"}
    lines = [] if opts.get("noheader") else [re.sub(r"%[.\-\d]*([A-Za-z])", lambda m: m.group(1).upper(), fmt)]
    for job in all_jobs():
        if "ALL" not in states and job["state"] not in states:
            continue
        if (names and job["name"] not in names) or (wanted and job["id"] not in wanted):
            continue
        lines.append(re.sub(r"%[.\-\d]*([A-Za-z])", lambda m, job=job: str(tokens.get(m.group(1), lambda j: "")(job)), fmt))
    if lines:
        print("\n".join(lines))
    return 0


def scancel(argv: list[str]) -> int:
    opts, ids = parse_opts("scancel", argv, {"clusters": ("M", True), "name": ("n", True)}, strict=False)
    log_call("scancel", argv)
    for job_id in ids:
        path = job_path(job_id)
        if path.exists():
            job = json.loads(path.read_text())
            if job["state"] not in FINISHED:
                job["state"] = "CANCELLED"
                write_job(job)
    return 0


def srun(argv: list[str]) -> int:
    opts, command = parse_opts("srun", argv, SRUN_OPTS)
    log_call("srun", argv, opts=opts, command=command, job_id=os.environ.get("SLURM_JOB_ID"))
    if not command:
        die("srun", "no command given")
    if opts.get("chdir"):
        os.chdir(opts["chdir"])
    os.environ["SLURM_STEP_ID"] = "0"
    os.execvp(command[0], command)


def default_partition() -> str:
    for p in os.environ.get("FAKE_SLURM_PARTITIONS", "cpu*,gpu").split(","):
        if p.endswith("*"):
            return p[:-1]
    return ""


def sinfo(argv: list[str]) -> int:
    opts, _ = parse_opts("sinfo", argv, {"format": ("o", True), "noheader": ("h", False)}, strict=False)
    log_call("sinfo", argv)
    if opts.get("format", "%P") != "%P":
        die("sinfo", f"the fake sinfo only implements -o %P, not {opts['format']!r}")
    parts = [p for p in os.environ.get("FAKE_SLURM_PARTITIONS", "cpu*,gpu").split(",") if p]
    print("\n".join(([] if opts.get("noheader") else ["PARTITION"]) + parts))
    return 0


def sacctmgr(argv: list[str]) -> int:
    log_call("sacctmgr", argv)
    words = [a.lower() for a in argv if not a.startswith("-")]
    if words[:2] not in (["list", "user"], ["show", "user"]) or not any(w.startswith("format=account") for w in words):
        die("sacctmgr", f"the fake sacctmgr only implements 'list user <name> format=account', not {argv}")
    accounts = [a for a in os.environ.get("FAKE_SLURM_ACCOUNTS", "fake_account").split(",") if a]
    print("\n".join(([] if "-n" in argv else ["Account", "-" * 10]) + accounts))
    return 0


def scontrol(argv: list[str]) -> int:
    log_call("scontrol", argv)
    if argv[:2] != ["show", "config"]:
        die("scontrol", f"the fake scontrol only implements 'show config', not {argv}")
    print(f"MaxArraySize            = 1001\nMinJobAge               = {os.environ.get('FAKE_SLURM_MIN_JOB_AGE', '300')} sec")
    return 0


COMMANDS = {f.__name__: f for f in (sbatch, sacct, squeue, scancel, srun, sinfo, sacctmgr, scontrol)}


def main() -> None:
    cmd = Path(sys.argv[0]).name
    sys.exit(COMMANDS[cmd](sys.argv[1:]))
