"""The package away from the repository root: schemas shipped in the wheel, the project found from any
folder of a clone, and the extras at the pins the project is tested with."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def extras() -> dict[str, dict[str, str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {name: pins(reqs) for name, reqs in project["optional-dependencies"].items()}


def test_training_extras_carry_the_tested_pins():
    tested = pins((REPO / "requirements.txt").read_text().splitlines())
    ex = extras()
    for name in ("train", "cuda"):
        assert ex[name], f"[{name}] pins nothing"
    for pkg, version in ex["train"].items():
        assert tested.get(pkg) == version, f"[train] {pkg}=={version}, requirements.txt {tested.get(pkg)}"
    for pkg in ("fla-core", "triton", "einops"):  # the KDA kernels: without them a GPU runs the torch path
        assert ex["cuda"][pkg] == tested[pkg], (pkg, ex["cuda"][pkg], tested[pkg])
    assert ex["cuda"]["torch"] == "2.11.0"  # the torch the H200 figures were measured with (benchmarks/records)


def test_the_slurm_plugin_is_an_extra_not_in_the_base_environment():
    # Snakemake loads every installed executor plugin at start; this one runs `scontrol show config` then (~10 s
    # where no controller answers), so only the SLURM profile's users and `make test` install it.
    base = pins((REPO / "requirements.txt").read_text().splitlines())
    test = pins((REPO / "requirements-test.txt").read_text().splitlines())
    plugin = "snakemake-executor-plugin-slurm"
    assert plugin not in base and plugin not in extras()["train"]
    assert extras()["slurm"] == {plugin: test[plugin]}, (extras()["slurm"], test.get(plugin))


def test_transformers_is_a_benchmark_dependency_only():
    # serve_bench.py's peer (issue #42) runs Hugging Face generate; dormouse itself never imports transformers
    bench = pins((REPO / "requirements-bench.txt").read_text().splitlines())
    assert set(bench) >= {"transformers", "tokenizers"}
    assert "transformers" not in pins((REPO / "requirements.txt").read_text().splitlines())
    assert all("transformers" not in extra for extra in extras().values()), extras()
    assert "-r requirements-bench.txt" in (REPO / "requirements-test.txt").read_text().splitlines()  # CI runs its test
    assert "get .whl_bench -r requirements-bench.txt" in (REPO / "benchmarks" / "prepare_device.sh").read_text()
    imports = [f for f in (REPO / "dormouse").rglob("*.py")
               if re.search(r"^\s*(import|from) transformers\b", f.read_text(), re.M)]
    assert not imports, imports


def test_a_wheel_plans_from_a_subfolder_of_a_clone(tmp_path, workdir, tmp_path_factory):
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "dormouse"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, src / name,
                                                                        **({"ignore": shutil.ignore_patterns("__pycache__")} if (REPO / name).is_dir() else {}))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("dormouse-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    assert (site / "dormouse" / "schemas" / "preset.schema.yaml").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = workdir / "corpus" / "demo"  # a folder inside the clone, not its root
    probe = ("import dormouse, sys; from dormouse.planner.plan import load_plan; p = load_plan(None); "
             "print(dormouse.__file__); print(p.store); print(p.chain['tiny']['pretrain'])")
    run = subprocess.run([sys.executable, "-c", probe], cwd=where, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    file, store, digest = run.stdout.splitlines()
    assert file.startswith(str(site)), file  # the installed wheel, not the repository's package
    assert store == str(workdir / "results" / "store")
    at_root = subprocess.run([sys.executable, "-c", probe], cwd=workdir, env=env, capture_output=True, text=True)
    assert at_root.stdout.splitlines()[2] == digest  # the same plan from the root
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # workdir is tmp_path: its folders are inside the clone
    outside = subprocess.run([sys.executable, "-m", "dormouse.cli", "plan"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert outside.returncode == 2
    assert outside.stderr.strip() == (f"dormouse plan: no config/config.yaml in {elsewhere} or any folder above it: run it "
                                      "inside a dormouse clone (where `snakemake` runs), or pass --config PATH")


@pytest.mark.network
def test_the_cuda_extra_resolves_to_one_consistent_gpu_stack(tmp_path):
    report = tmp_path / "report.json"
    reqs = [f"{k}=={v}" for k, v in extras()["cuda"].items()]
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", str(report),
                    *reqs], check=True, capture_output=True, timeout=600)
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    for pkg, version in extras()["cuda"].items():
        assert got[pkg] == version, (pkg, got[pkg], version)
