"""Corpus discovery (issue 24, case 2): links resolved, each real file read once, every unread path listed."""

import os

from dormouse.engine.raw import expand_raw, ignored_files, scan_raw


def corpus(tmp_path):
    root = tmp_path / "dir"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "y.jsonl").write_text('{"text": "y"}\n')
    os.symlink(tmp_path / "outside", root / "linked")  # a symlinked subdirectory: read
    os.symlink(root, root / "a" / "loop")  # a self-referencing link: not followed twice
    os.symlink(root / "a" / "x.jsonl", root / "x_again.jsonl")  # a second path to x: read once
    os.symlink(tmp_path / "gone.jsonl", root / "broken.jsonl")
    return root


def test_directory_follows_linked_subdirs_reads_each_file_once_and_lists_the_rest(tmp_path):
    root = corpus(tmp_path)
    assert expand_raw(str(root)) == [root / "a" / "x.jsonl", root / "linked" / "y.jsonl"]
    scan = scan_raw(str(root))
    assert (scan.links_followed, scan.duplicate_paths) == (1, 1)
    reasons = {os.path.relpath(e["path"], root): e["reason"] for e in ignored_files(str(root))}
    assert reasons == {"a/loop": "symlink_loop", "x_again.jsonl": "duplicate_path", "broken.jsonl": "broken_symlink"}


def test_glob_over_a_symlink_loop_reads_each_file_once(tmp_path):
    root = corpus(tmp_path)
    files = expand_raw(str(root / "**" / "*.jsonl"))
    assert files == [root / "a" / "x.jsonl", root / "linked" / "y.jsonl"]  # not x 41 times
    scan = scan_raw(str(root / "**" / "*.jsonl"))
    assert scan.duplicate_paths >= 2 and all(e["reason"] in ("duplicate_path", "broken_symlink") for e in scan.skipped)
