"""Corpus discovery (issue 24, case 2): links resolved, each real file read once, every unread path listed."""

import os

from dormouse.data.raw import expand_raw, ignored_files, scan_raw


def corpus(tmp_path):
    root = tmp_path / "dir"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "y.jsonl").write_text('{"text": "y"}\n')
    os.symlink(tmp_path / "outside", root / "linked")  # a symlinked directory out of the root: not followed
    os.symlink(root, root / "a" / "loop")  # a self-referencing link: not followed twice
    os.symlink(root / "a" / "x.jsonl", root / "x_again.jsonl")  # a second path to x: read once
    os.symlink(tmp_path / "gone.jsonl", root / "broken.jsonl")
    return root


def test_directory_follows_linked_subdirs_reads_each_file_once_and_lists_the_rest(tmp_path):
    root = corpus(tmp_path)
    os.symlink(root / "a", root / "a_again")  # a symlinked subdirectory inside the root: followed, x read once
    assert expand_raw(str(root)) == [root / "a" / "x.jsonl"]
    scan = scan_raw(str(root))
    assert (scan.links_followed, scan.duplicate_paths) == (0, 2)
    reasons = {os.path.relpath(e["path"], root): e["reason"] for e in ignored_files(str(root))}
    assert reasons == {"a/loop": "symlink_loop", "x_again.jsonl": "duplicate_path", "broken.jsonl": "broken_symlink",
                       "a_again/x.jsonl": "duplicate_path", "a_again/loop": "symlink_loop", "linked": "link_outside_root"}


def test_glob_over_a_symlink_loop_reads_each_file_once(tmp_path):
    root = corpus(tmp_path)
    files = expand_raw(str(root / "**" / "*.jsonl"))
    assert files == [root / "a" / "x.jsonl"]  # not x 41 times, nor y through the link out of the root
    scan = scan_raw(str(root / "**" / "*.jsonl"))
    assert scan.duplicate_paths >= 2
    assert {e["reason"] for e in scan.skipped} == {"duplicate_path", "broken_symlink", "link_outside_root"}
    assert {e["resolves_to"] for e in scan.skipped if e["reason"] == "link_outside_root"} == {
        str((tmp_path / "outside" / "y.jsonl").resolve())}  # reached through each level of the loop


def test_a_link_up_out_of_the_corpus_is_not_followed(tmp_path):
    """`ln -s .. corp/loop_up` read the corpus's parent directory: its documents were kept. A link that resolves
    outside the root is listed with its reason and what it resolves to, whether the spec is the directory or a glob."""
    root = tmp_path / "parent" / "corp"
    root.mkdir(parents=True)
    (root / "in.jsonl").write_text('{"text": "in"}\n')
    (tmp_path / "parent" / "out.jsonl").write_text('{"text": "out"}\n')
    os.symlink("..", root / "loop_up")
    for spec in (root, root / "**" / "*.jsonl"):
        assert expand_raw(str(spec)) == [root / "in.jsonl"], spec
    ignored = ignored_files(str(root))
    assert ignored == [{"path": str(root / "loop_up"), "reason": "link_outside_root",
                        "resolves_to": str((tmp_path / "parent").resolve())}]
