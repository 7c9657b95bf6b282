"""Progress a person can watch: Meter lines, and --terminal-progress keeping the terminal for them alone."""

import subprocess
import sys
import textwrap

from dormouse.core import progress


def test_meter_line_has_count_fields_rate_elapsed_and_eta(capsys):
    m = progress.Meter("pretrain", "step", total=100, start=20)
    m.t0 -= 10.0  # 10 s ago: 30 steps in this process -> 3 step/s, 50 left -> eta 17 s
    line = m.update(50, bpb=1.23456, eval_bpb=None, **{"bytes/s": "12.0k"})
    assert line == "[pretrain] step 50/100  bpb 1.235  bytes/s 12.0k  3.0 step/s  elapsed 0:00:10  eta 0:00:17"
    assert capsys.readouterr().err == line + "\n"


def test_meter_waits_every_s_but_always_writes_the_last_line():
    m = progress.Meter("filter", "doc", total=3, every_s=3600)
    assert m.update(1) is None and m.update(2) is None
    assert m.update(3).startswith("[filter] doc 3/3")
    unknown = progress.Meter("filter", "doc")
    assert "eta" not in unknown.update(7) and "doc 7  " in unknown.update(7)


def test_track_yields_every_item_and_ends_with_a_count_line(capsys):
    assert list(progress.track(iter("abcde"), "shard", "doc", every_s=3600)) == list("abcde")
    (line,) = capsys.readouterr().err.splitlines()  # not a terminal: lines, no bar; one at the end
    assert line.startswith("[shard] doc 5  ") and "eta" not in line


def test_terminal_progress_keeps_the_terminal_for_progress_and_logs_the_rest(tmp_path):
    # The rule's redirection: `2>&1 > log` points stderr at the terminal, stdout at the log.
    script = textwrap.dedent("""
        import sys, warnings
        from dormouse.core import progress
        progress.to_terminal()
        print("[x] params {}")
        progress.note("[x] milestone")
        progress.Meter("x", "step", total=2).update(2)
        warnings.warn("a warning for the log")
        raise SystemExit("the cause, for the log")
    """)
    log = tmp_path / "x.log"
    proc = subprocess.run(f"{sys.executable} -c '{script}' 2>&1 > {log}", shell=True, capture_output=True, text=True)
    assert proc.returncode == 1
    terminal = proc.stdout.splitlines()
    assert terminal[0] == "[x] milestone" and terminal[1].startswith("[x] step 2/2") and len(terminal) == 2
    text = log.read_text()
    assert "[x] params {}" in text and "[x] milestone" in text and "a warning for the log" in text
    assert "the cause, for the log" in text and "step 2/2" not in text


def test_track_writes_the_last_line_once_when_the_total_is_known(capsys):
    list(progress.track(range(4), "shard", "doc", total=4, label="pass 2"))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("[shard] pass 2: doc 4/4  ")
