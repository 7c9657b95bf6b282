import pytest

from dormouse.core.store import ArtifactError, ArtifactWriter, artifact_digest, open_artifact, published


def make(tmp_path, params=None, fail=False):
    params = params or {"k": 1}
    d = artifact_digest("filter", 1, params, {"corpus": "abc"}, [])
    w = ArtifactWriter(tmp_path / "filter" / d, "filter", 1, params, {"corpus": "abc"}, [])
    with w as art:
        art.path("sub/data.txt").write_text("hello")
        art.counters["docs_read"] += 3
        if fail:
            raise RuntimeError("killed")
    return tmp_path / "filter" / d


def test_digest_depends_on_every_part_and_not_on_key_order():
    base = artifact_digest("s", 1, {"a": 1, "b": 2}, {"x": "1"}, [])
    assert base == artifact_digest("s", 1, {"b": 2, "a": 1}, {"x": "1"}, [])
    others = [
        artifact_digest("t", 1, {"a": 1, "b": 2}, {"x": "1"}, []),
        artifact_digest("s", 2, {"a": 1, "b": 2}, {"x": "1"}, []),
        artifact_digest("s", 1, {"a": 1, "b": 3}, {"x": "1"}, []),
        artifact_digest("s", 1, {"a": 1, "b": 2}, {"x": "2"}, []),
        artifact_digest("s", 1, {"a": 1, "b": 2}, {"x": "1"}, ["R1"]),
    ]
    assert len({base, *others}) == 6


def test_manifest_records_files_counters_code_and_environment(tmp_path):
    path = make(tmp_path)
    art = open_artifact(path, stage="filter")
    m = art.manifest
    assert m["files"]["sub/data.txt"]["size"] == 5
    assert m["counters"] == {"docs_read": 3}
    assert m["code"]["package_version"] and m["code"]["source_digest"]
    assert "dormouse/stages/filter.py" in m["code"]["source_files"]
    assert "dormouse/data/readers.py" in m["code"]["source_files"]  # transitive closure
    assert m["environment"]["python"] and m["wall_time_s"] >= 0


def test_failed_stage_leaves_nothing_that_looks_finished(tmp_path):
    with pytest.raises(RuntimeError):
        make(tmp_path, fail=True)
    assert not list((tmp_path / "filter").rglob("manifest.json"))
    # temp dir removed too; the digest's empty lock file stays (removing a flock'ed file races with a waiter)
    digest = artifact_digest("filter", 1, {"k": 1}, {"corpus": "abc"}, [])
    assert [p.name for p in (tmp_path / "filter").iterdir()] == [f".{digest}.lock"]


def test_tampered_file_fails_loudly(tmp_path):
    path = make(tmp_path)
    (path / "sub" / "data.txt").write_text("hellO")
    art = open_artifact(path)  # manifest only: files are checked when a consumer reads them
    with pytest.raises(ArtifactError, match="sha256"):
        art.file("sub/data.txt")
    with pytest.raises(ArtifactError, match="sha256"):
        open_artifact(path, verify=True)


def test_wrong_directory_name_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not the digest"):
        ArtifactWriter(tmp_path / "filter" / ("0" * 20), "filter", 1, {}, {}, [])


def test_finished_artifact_is_never_overwritten(tmp_path):
    # A second writer of the same digest (an orphaned job of a killed Snakemake published first): the
    # published artifact verifies, so the second one succeeds and leaves it exactly as it was.
    path = make(tmp_path)
    before = (path / "manifest.json").read_bytes()
    make(tmp_path)
    assert (path / "manifest.json").read_bytes() == before
    assert not list(path.parent.glob(".*.tmp-*"))
    # ... and one whose files were altered is refused, not rebuilt over
    (path / "sub" / "data.txt").write_text("hellO")
    with pytest.raises(ArtifactError, match="no longer match its manifest"):
        make(tmp_path)
    assert (path / "manifest.json").read_bytes() == before


def test_manifest_deleted_by_snakemake_is_restored_from_its_hidden_link(tmp_path):
    # Snakemake deletes a job's output (manifest.json) before a rerun and after a failure.
    path = make(tmp_path)
    st = (path / "manifest.json").stat()
    (path / "manifest.json").unlink()
    art = published(path)
    assert art is not None and art.digest == path.name
    again = (path / "manifest.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # the same file: no mtime cascade
    assert published(tmp_path / "filter" / ("0" * 20)) is None


def test_scratch_survives_failure_is_keyed_by_digest_and_goes_on_success(tmp_path):
    params = {"k": 2}
    d = artifact_digest("shard", 1, params, {}, [])
    out = tmp_path / "store" / "shard" / d
    with pytest.raises(RuntimeError):
        with ArtifactWriter(out, "shard", 1, params, {}, []) as art:
            (art.scratch / "step-100.pt").write_text("checkpoint")
            raise RuntimeError("killed at step 150")
    assert (tmp_path / "scratch" / "shard" / d / "step-100.pt").read_text() == "checkpoint"
    with ArtifactWriter(out, "shard", 1, params, {}, []) as art:
        assert (art.scratch / "step-100.pt").exists()  # the rerun resumes from it
        art.path("done.txt").write_text("ok")
    assert not (tmp_path / "scratch" / "shard" / d).exists()
    assert open_artifact(out).manifest["files"]["done.txt"]["size"] == 2


def test_leftovers_of_a_killed_writer_are_cleared_and_counted(tmp_path):
    params = {"k": 3}
    d = artifact_digest("shard", 1, params, {}, [])
    stale = tmp_path / "shard" / f".{d}.tmp-99999"
    stale.mkdir(parents=True)
    (stale / "half.bin").write_bytes(b"\0" * 10)
    with ArtifactWriter(tmp_path / "shard" / d, "shard", 1, params, {}, []) as art:
        art.path("x").write_text("1")
    assert not stale.exists()
    assert open_artifact(tmp_path / "shard" / d).manifest["counters"]["store.stale_tmp_dirs_removed"] == 1


def _slow_writer(out, params, files, started, counters_q):
    """A writer that takes its time: one file, the `started` signal, then the rest."""
    import time

    with ArtifactWriter(out, "x", 1, params, {}, []) as art:
        for i, name in enumerate(files):
            art.path(name).write_text(name * 100)
            if i == 0 and started is not None:
                started.set()
            time.sleep(0.2)
        counters = dict(art.counters)
    counters_q.put(counters)


def test_two_writers_of_one_digest_publish_one_whole_artifact(tmp_path):
    """Two clones sharing a store, or a stage run by hand beside Snakemake: the second writer waits for the first's
    lock on the digest. It used to delete the first's temp directory as a killed job's leftover, and the first then
    published a manifest listing the one file written after that, which verify passed."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    params = {"a": 1}
    out = tmp_path / "store" / "x" / artifact_digest("x", 1, params, {}, [])
    started, q = ctx.Event(), ctx.Queue()
    first = ctx.Process(target=_slow_writer, args=(out, params, ["a", "b", "c", "d"], started, q))
    first.start()
    assert started.wait(30)
    second = ctx.Process(target=_slow_writer, args=(out, params, ["z"], None, q))
    second.start()
    first.join(60)
    second.join(60)
    assert first.exitcode == 0 and second.exitcode == 0
    counters = [q.get(timeout=5), q.get(timeout=5)]
    art = published(out)
    assert sorted(art.manifest["files"]) == ["a", "b", "c", "d"]  # the first writer's whole list, verified
    assert sorted(c.get("store.waited_for_writer", 0) for c in counters) == [0, 1]
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))  # nothing left behind


def test_a_dead_writers_temp_directory_is_removed_and_counted(tmp_path):
    params = {"a": 2}
    out = tmp_path / "store" / "x" / artifact_digest("x", 1, params, {}, [])
    dead = out.parent / f".{out.name}.tmp-999999"
    dead.mkdir(parents=True)
    (dead / "half").write_text("x")
    with ArtifactWriter(out, "x", 1, params, {}, []) as art:
        art.path("f").write_text("ok")
    assert not dead.exists() and published(out).manifest["counters"]["store.stale_tmp_dirs_removed"] == 1


def test_verify_finds_an_edited_or_unreadable_manifest(tmp_path):
    """An altered file whose new hash was written into a new manifest.json (the .manifest.json copy keeps the
    published one), a manifest edited in place (its params no longer give its digest), and a truncated manifest
    (one problem line, not a traceback)."""
    import hashlib
    import json

    from dormouse.tools.verify import artifact_problems

    path = make(tmp_path)
    assert artifact_problems(path) == []
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "sub" / "data.txt").write_text("hellO")
    forged = {**manifest, "files": {**manifest["files"], "sub/data.txt": {
        "sha256": hashlib.sha256(b"hellO").hexdigest(), "size": 5}}}
    (path / "manifest.json").unlink()  # a new file: the hard-linked copy keeps what was published
    (path / "manifest.json").write_text(json.dumps(forged))
    assert [p for p in artifact_problems(path) if "differs from its .manifest.json copy" in p]
    (path / ".manifest.json").unlink()
    (path / ".manifest.json").write_text(json.dumps({**forged, "params": {"k": 2}}))
    (path / "manifest.json").unlink()
    (path / "manifest.json").hardlink_to(path / ".manifest.json")  # edited in place, both names alike
    assert [p for p in artifact_problems(path) if "give another digest" in p]
    (path / "manifest.json").unlink()
    (path / "manifest.json").write_text('{"stage": "filter", "files": {')
    problems = artifact_problems(path)
    assert len([p for p in problems if "unreadable manifest (JSONDecodeError" in p]) == 1


def _upstream(store, stage, files: dict[str, bytes]):
    d = artifact_digest(stage, 1, {}, {}, [])
    with ArtifactWriter(store / stage / d, stage, 1, {}, {}, []) as art:
        for name, data in files.items():
            art.path(name).write_bytes(data)
    return store / stage / d


def _job(store, stage, inputs: dict) -> dict:
    inputs = {k: {"kind": "artifact", "stage": p.parent.name, "digest": p.name} for k, p in inputs.items()}
    return {"stage": stage, "format_version": 1, "digest": "0" * 20, "params": {}, "inputs": inputs,
            "retractions": [], "out": str(store / stage / ("0" * 20))}


def test_a_consumer_checks_every_listed_files_size_before_it_reads(tmp_path):
    """A deleted shard-0002.idx.npy did not stop pretrain, which reads only the .bin files: files are hashed when
    read, and nothing looked at the others. Every listed file's size is now checked when the input is opened."""
    from dormouse.planner.job import input_artifact

    store = tmp_path / "store"
    files = {f"train/shard-000{i}.{ext}": bytes([i]) * 64 for i in range(3) for ext in ("bin", "idx.npy")}
    shard = _upstream(store, "shard", {**files, "eval/tail.bin": b"e" * 64})
    job = _job(store, "pretrain", {"shard": shard})
    assert input_artifact(job, "shard").verified == set()  # sizes only: nothing hashed before it is read
    (shard / "train" / "shard-0002.idx.npy").unlink()
    with pytest.raises(ArtifactError, match=rf"{shard}/train/shard-0002.idx.npy: listed in the manifest, missing on "
                                            rf"disk, in the shard artifact {shard}$"):
        input_artifact(job, "shard")
    (shard / "eval" / "tail.bin").write_bytes(b"e" * 63)  # cut short: named first (sorted), the other counted
    with pytest.raises(ArtifactError, match=r"tail.bin: altered \(size 63 != manifest 64\), .* \(and 1 more"):
        input_artifact(job, "shard")


def test_a_stage_whose_input_lost_an_unread_file_fails_in_one_line(tmp_path, capsys):
    """shard reads only the filter's docs-*; the filter's quality model, deleted, now stops it with one line naming
    the artifact and the file (an ArtifactError was a traceback)."""
    import json

    from dormouse.cli import main as dormouse_main

    store = tmp_path / "store"
    filt = _upstream(store, "filter", {"docs-00000.jsonl.zst": b"d" * 10, "per_file.json": b"{}",
                                       "quality_model.bin": b"q" * 100})
    (filt / "quality_model.bin").unlink()
    assert dormouse_main(["shard", "--job", json.dumps(_job(store, "shard", {"filter": filt}))]) == 1
    err = capsys.readouterr().err
    assert err == f"dormouse shard: {filt}/quality_model.bin: listed in the manifest, missing on disk, in the filter artifact {filt}\n"
    assert not (store / "shard").exists()  # failed before writing anything
