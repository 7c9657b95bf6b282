"""Move a finished artifact to a machine with no network, in parts small enough to carry one at a time.

    dormouse pack --preset b1 --stage shard --out parts/        # or --artifact results/store/shard/<digest>
    dormouse unpack parts/ --store results/store                 # there: verify every part, then the artifact

`pack` verifies the artifact (every file against its manifest), writes it as one tar stream (sorted members,
no owners or times: the same artifact packs to the same bytes) compressed with zstd, cut into parts of at
most --part-mib MiB (`<stage>-<digest>.tar.zst.000`, `.001`, ...), and `<stage>-<digest>.parts.json` naming
each part with its size and sha256. `unpack` checks the part list (a missing, extra-sized or corrupted part
is an error naming the file), streams the parts through zstd and tar into a temporary directory beside the
store, verifies the artifact against its own manifest, and only then renames it into
`<store>/<stage>/<digest>/`; an artifact already there is verified and left as it is. Parts can arrive over
several carries (a device call carries 64 MiB): keep them in one folder until all are there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import zstandard

from dormouse.core.store import ArtifactError, open_artifact, published, sha256_file

PART_MIB = 60
FORMAT = 1
ZSTD_LEVEL = 3  # shards are bytes of text: level 3 packs them ~3x at several hundred MB/s


class _Parts:
    """A binary sink writing consecutive files of at most `limit` bytes, hashing each."""

    def __init__(self, out: Path, stem: str, limit: int):
        self.out, self.stem, self.limit = out, stem, limit
        self.parts: list[dict] = []
        self._f = None

    def _open(self):
        name = f"{self.stem}.tar.zst.{len(self.parts):03d}"
        self._f = (self.out / name).open("wb")
        self.parts.append({"name": name, "size": 0, "h": hashlib.sha256()})

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._f is None or self.parts[-1]["size"] == self.limit:
                self.close_part()
                self._open()
            n = min(len(view), self.limit - self.parts[-1]["size"])
            self._f.write(view[:n])
            self.parts[-1]["h"].update(view[:n])
            self.parts[-1]["size"] += n
            view = view[n:]
        return len(data)

    def close_part(self):
        if self._f is not None:
            self._f.close()
            self._f = None

    def listing(self) -> list[dict]:
        return [{"name": p["name"], "size": p["size"], "sha256": p["h"].hexdigest()} for p in self.parts]


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def pack(artifact_dir: Path, out: Path, part_mib: int = PART_MIB, level: int = ZSTD_LEVEL) -> Path:
    """Pack a verified artifact into parts under `out`; returns the parts list's path."""
    art = open_artifact(artifact_dir, verify=True)
    stage, digest = art.manifest["stage"], art.manifest["digest"]
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{stage}-{digest}"
    for old in out.glob(f"{stem}.tar.zst.*"):  # a re-pack replaces, never mixes with, older parts
        old.unlink()
    sink = _Parts(out, stem, part_mib << 20)
    names = sorted([*art.files(), "manifest.json"])
    with zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(sink, closefd=False) as zw:  # threads: one stream
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name in names:
                tar.add(art.path / name, arcname=f"{stage}/{digest}/{name}", filter=_normalised)
    sink.close_part()
    listing = {"format": FORMAT, "stage": stage, "digest": digest, "files": len(names), "zstd_level": level,
               "bytes": sum(art.manifest["files"][n]["size"] for n in art.files()), "parts": sink.listing()}
    path = out / f"{stem}.parts.json"
    path.write_text(json.dumps(listing, indent=1) + "\n")
    return path


class _Concat:
    """The parts read one after another as one stream (each part checked before it is opened)."""

    def __init__(self, paths: list[Path]):
        self.paths, self._f = list(paths), None

    def read(self, n: int = -1) -> bytes:
        while True:
            if self._f is None:
                if not self.paths:
                    return b""
                self._f = self.paths.pop(0).open("rb")
            data = self._f.read(n)
            if data:
                return data
            self._f.close()
            self._f = None


def check_parts(listing_path: Path) -> tuple[dict, list[Path]]:
    """The parts list and the part files beside it, each present with its size and sha256, or an error."""
    listing = json.loads(listing_path.read_text())
    if listing.get("format") != FORMAT:
        raise ArtifactError(f"{listing_path}: parts format {listing.get('format')!r}, this dormouse reads {FORMAT}")
    paths = []
    for part in listing["parts"]:
        p = listing_path.parent / part["name"]
        if not p.exists():
            raise ArtifactError(f"{p}: part {part['name']} of {len(listing['parts'])} is missing (carry it, then unpack again)")
        if p.stat().st_size != part["size"]:
            raise ArtifactError(f"{p}: {p.stat().st_size} bytes, the parts list says {part['size']}")
        if sha256_file(p) != part["sha256"]:
            raise ArtifactError(f"{p}: sha256 does not match the parts list (a damaged part: carry it again)")
        paths.append(p)
    return listing, paths


def unpack(listing_path: Path, store: Path) -> Path:
    """Verify the parts, rebuild the artifact under `store` and verify it; returns its directory."""
    from dormouse.planner.registry import STAGES

    listing, paths = check_parts(listing_path)
    stage, digest = listing["stage"], listing["digest"]
    # the listing's names become paths: a stage of the chain and a digest's 20 hex digits, nothing else ("../")
    if stage not in STAGES or not (isinstance(digest, str) and len(digest) == 20 and all(ch in "0123456789abcdef" for ch in digest)):
        raise ArtifactError(f"{listing_path}: stage {stage!r} / digest {digest!r} is not a stage of the chain and a digest")
    final = store / stage / digest

    def files_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        if not (member.isfile() or member.isdir()):  # an artifact holds files; a link verified in tmp breaks in place
            raise ArtifactError(f"{listing_path}: {member.name} is not a regular file or folder")
        return tarfile.data_filter(member, dest)
    if (final / "manifest.json").exists():
        open_artifact(final, stage=stage, verify=True)
        return final
    tmp = store / stage / f".{digest}.unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with zstandard.ZstdDecompressor().stream_reader(_Concat(paths)) as zr:
            with tarfile.open(fileobj=zr, mode="r|") as tar:
                tar.extractall(tmp, filter=files_only)  # and "data"'s: no absolute paths, nothing out of tmp
        got = tmp / stage / digest
        art = open_artifact(got, stage=stage, verify=True)
        if sorted([*art.files(), "manifest.json"]) != sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()):
            raise ArtifactError(f"{listing_path}: the unpacked files are not exactly the manifest's")
        published(got)  # verified whole where it was unpacked (and the hidden manifest link added), then moved in
        got.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def pack_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse pack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--artifact", type=Path, help="an artifact directory (results/store/<stage>/<digest>)")
    which.add_argument("--preset", help="the preset's artifact of --stage, as the plan names it")
    ap.add_argument("--stage", default="shard")
    ap.add_argument("--config", help="config.yaml (default: config/config.yaml of the clone around the cwd)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--part-mib", type=int, default=PART_MIB,
                    help=f"largest part (default {PART_MIB}); a device call carries 64 MiB with the working tree, so "
                         "leave room for it (e.g. 50)")
    ap.add_argument("--level", type=int, default=ZSTD_LEVEL, choices=range(1, 23), metavar="1..22",
                    help=f"zstd level (default {ZSTD_LEVEL}); 9 packs text shards ~4.1x against ~3.6x, still at tens of MB/s")
    args = ap.parse_args(argv)
    artifact = args.artifact
    if args.preset:
        from dormouse.planner.plan import load_plan

        plan = load_plan(args.config)
        if args.preset not in plan.chain:
            raise SystemExit(f"dormouse pack: no preset {args.preset!r} in the plan (known: {', '.join(plan.chain)})")
        artifact = Path(plan.artifact_dir(args.stage, plan.chain[args.preset][args.stage]))
    try:
        listing = pack(artifact, args.out, args.part_mib, args.level)
    except ArtifactError as e:
        raise SystemExit(f"dormouse pack: {e}") from None
    parts = json.loads(listing.read_text())["parts"]
    print(f"packed {artifact} into {len(parts)} parts ({sum(q['size'] for q in parts) / 2**20:.1f} MiB) and {listing}")
    return 0


def unpack_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dormouse unpack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", type=Path, help="a folder holding one <stage>-<digest>.parts.json, or that file")
    ap.add_argument("--store", type=Path, default=Path("results/store"))
    args = ap.parse_args(argv)
    found = [args.parts] if args.parts.is_file() else sorted(args.parts.glob("*.parts.json"))
    if len(found) != 1:
        raise SystemExit(f"dormouse unpack: {args.parts} holds {len(found)} parts lists; name one")
    try:
        print(f"unpacked and verified {unpack(found[0], args.store)}")
    except ArtifactError as e:
        raise SystemExit(f"dormouse unpack: {e}") from None
    return 0
