"""benchmarks/bench_env.git_rev: a changed tree is named by its git tree, which matches the commit of the same files."""

import subprocess

from benchmarks.bench_env import git_rev


def git(root, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_dirty_tree_is_named_by_the_tree_its_commit_would_have(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_rev(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")  # a change, a new file, and an ignored one that must not count
    (tmp_path / "b.py").write_text("y = 1\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "c.bin").write_text("z")
    rev = git_rev(tmp_path)
    assert rev.startswith(f"{head}+dirty tree ")
    assert git(tmp_path, "diff", "--cached", "--name-only") == ""  # the repo's own index is left alone
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "two")
    assert rev.endswith(git(tmp_path, "rev-parse", "HEAD^{tree}")[:10])
