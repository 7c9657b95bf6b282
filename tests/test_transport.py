"""dormouse pack / unpack: an artifact carried in parts to a store elsewhere, verified on both sides."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dormouse.planner import transport
from dormouse.core.store import ArtifactError, ArtifactWriter, artifact_digest, open_artifact


def make_artifact(store: Path, first: bytes | None = None) -> Path:
    """A shard-like artifact: 2.5 MiB of incompressible train bytes (several 1-MiB parts; `first`: the first
    shard's bytes instead) and a small eval file."""
    params = {"num_shards": 2}
    digest = artifact_digest("shard", 4, params, {}, [])
    with ArtifactWriter(store / "shard" / digest, "shard", 4, params, {}, []) as art:
        art.path("train/00000.bin").write_bytes(os.urandom(1_500_000) if first is None else first)
        art.path("train/00001.bin").write_bytes(os.urandom(1_100_000))
        art.path("eval/tail.bin").write_bytes(b"an eval tail of real-looking text\n" * 500)
    return store / "shard" / digest


def test_round_trip_in_parts_to_another_store(tmp_path):
    src = make_artifact(tmp_path / "here")
    listing = transport.pack(src, tmp_path / "parts", part_mib=1)
    parts = json.loads(listing.read_text())["parts"]
    assert len(parts) == 3 and all(p["size"] <= 1 << 20 for p in parts)
    again = transport.pack(src, tmp_path / "parts2", part_mib=1)  # the same artifact packs to the same bytes
    assert [p["sha256"] for p in json.loads(again.read_text())["parts"]] == [p["sha256"] for p in parts]

    there = tmp_path / "there"
    out = transport.unpack(listing, there)
    assert out == there / "shard" / src.name
    open_artifact(out, stage="shard", verify=True)
    for name in ["manifest.json", "train/00000.bin", "train/00001.bin", "eval/tail.bin"]:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not list((there / "shard").glob(".*"))  # no temporary directory left
    assert transport.unpack(listing, there) == out  # already there: verified, left as it is


def test_a_missing_or_damaged_part_is_named_and_nothing_is_written(tmp_path):
    src = make_artifact(tmp_path / "here")
    listing = transport.pack(src, tmp_path / "parts", part_mib=1)
    part1 = tmp_path / "parts" / json.loads(listing.read_text())["parts"][1]["name"]
    data = part1.read_bytes()
    part1.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ArtifactError, match=rf"{part1.name}: sha256 does not match"):
        transport.unpack(listing, tmp_path / "there")
    part1.unlink()
    with pytest.raises(ArtifactError, match=rf"{part1.name}: part .* of 3 is missing"):
        transport.unpack(listing, tmp_path / "there")
    assert not (tmp_path / "there" / "shard" / src.name).exists()


def test_a_crafted_listing_cannot_place_an_artifact_elsewhere_or_carry_a_link(tmp_path):
    """The listing's stage and digest become paths, and a link verified where it was unpacked breaks once moved: both
    are refused before anything reaches the store."""
    import hashlib
    import io
    import tarfile

    import zstandard

    src = make_artifact(tmp_path / "here")
    listing = transport.pack(src, tmp_path / "parts", part_mib=1)
    spec = json.loads(listing.read_text())
    bad = tmp_path / "parts" / "bad.parts.json"
    bad.write_text(json.dumps({**spec, "digest": f"../pretrain/{spec['digest']}"}))
    with pytest.raises(ArtifactError, match="is not a stage of the chain and a digest"):
        transport.unpack(bad, tmp_path / "there")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ["manifest.json", "train/00001.bin", "eval/tail.bin"]:
            tar.add(src / name, arcname=f"shard/{src.name}/{name}")
        link = tarfile.TarInfo(f"shard/{src.name}/train/00000.bin")
        link.type, link.linkname = tarfile.SYMTYPE, "../../../../here/shard/" + src.name + "/train/00000.bin"
        tar.addfile(link)
    part = tmp_path / "evil" / "x.tar.zst.000"
    part.parent.mkdir()
    part.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    evil = tmp_path / "evil" / "x.parts.json"
    evil.write_text(json.dumps({**spec, "parts": [{"name": part.name, "size": part.stat().st_size,
                                                   "sha256": hashlib.sha256(part.read_bytes()).hexdigest()}]}))
    with pytest.raises(ArtifactError, match="is not a regular file or folder"):
        transport.unpack(evil, tmp_path / "there")
    assert not (tmp_path / "there" / "shard" / src.name).exists() and not (tmp_path / "there" / "pretrain").exists()


def test_an_artifact_that_fails_its_own_manifest_is_not_packed(tmp_path):
    src = make_artifact(tmp_path / "here")
    (src / "eval" / "tail.bin").write_bytes(b"changed")
    with pytest.raises(ArtifactError, match="tail.bin"):
        transport.pack(src, tmp_path / "parts")


def test_the_commands(tmp_path):
    src = make_artifact(tmp_path / "here")
    run = lambda *a: subprocess.run([sys.executable, "-m", "dormouse.cli", *a], capture_output=True, text=True, timeout=120)
    out = run("pack", "--artifact", str(src), "--out", str(tmp_path / "parts"), "--part-mib", "2")
    assert out.returncode == 0 and "into 2 parts" in out.stdout, out.stderr
    out = run("unpack", str(tmp_path / "parts"), "--store", str(tmp_path / "there"))
    assert out.returncode == 0 and "unpacked and verified" in out.stdout, out.stderr
    out = run("unpack", str(tmp_path / "nothing"), "--store", str(tmp_path / "there"))
    assert out.returncode != 0 and "holds 0 parts lists" in out.stderr


def test_a_higher_level_packs_smaller_and_round_trips(tmp_path):
    """--level trades pack time for fewer carries; the list records it and unpack needs no flag."""
    rng = random.Random(0)  # text-like bytes (random words): they compress, and more at a higher level
    words = [bytes(rng.choices(range(97, 123), k=rng.randint(2, 9))) for _ in range(3000)]
    src = make_artifact(tmp_path / "here", b" ".join(rng.choices(words, k=300_000)))
    fast = json.loads(transport.pack(src, tmp_path / "l1", part_mib=8, level=1).read_text())
    small = json.loads((listing := transport.pack(src, tmp_path / "l19", part_mib=8, level=19)).read_text())
    assert (fast["zstd_level"], small["zstd_level"]) == (1, 19)
    assert sum(p["size"] for p in small["parts"]) < sum(p["size"] for p in fast["parts"])
    out = transport.unpack(listing, tmp_path / "there")
    assert (out / "eval" / "tail.bin").read_bytes() == (src / "eval" / "tail.bin").read_bytes()
