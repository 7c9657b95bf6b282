"""The one place that resolves configuration: config.yaml + a preset file, validated against the schemas.

A bad key or value fails with the file and the dotted key that is wrong. Schema defaults are filled in,
so every resolved value a stage sees is written down (and digested) even when a preset omits it.
"""

from __future__ import annotations

import copy
import datetime
import functools
from pathlib import Path

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"  # package data: found wherever dormouse is installed


class ConfigError(ValueError):
    pass


class InputError(ValueError):
    """Bad input data whose message names the file, the place and the policy that would skip it: the command line
    prints it as one line (dormouse/cli.py), not a traceback."""


def _with_defaults(validator_class):
    # The jsonschema FAQ recipe: a validator that also fills in `default` values of missing properties.
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return {} if data is None else data


@functools.lru_cache(maxsize=None)
def _validator(schema_path: Path):
    return _Validator(load_yaml(schema_path))


def validate(instance, schema_name: str, source: str):
    """Validate (and default-fill, in place) `instance` against dormouse/schemas/<schema_name>."""
    errors = sorted(_validator(SCHEMA_DIR / schema_name).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors[:10]:
            where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
            lines.append(f"  {where}: {e.message}")
        raise ConfigError(f"{source}: invalid configuration\n" + "\n".join(lines))
    return instance


def find_project(config: str | Path | None) -> tuple[Path, Path]:
    """(project root, its config.yaml). --config PATH if given (its root: the folder above `config/`, else the
    cwd); otherwise config/config.yaml in the cwd or the nearest parent that has one, as git finds .git, so
    the CLI works from any folder of a clone. Presets, experiments, the corpus and the store are relative
    to the root."""
    if config is not None:
        path = Path(config).resolve()
        if not path.is_file():
            raise ConfigError(f"--config {config}: file not found")
        return (path.parent.parent if path.parent.name == "config" else Path.cwd()), path
    here = Path.cwd()
    for root in (here, *here.parents):
        if (root / "config" / "config.yaml").is_file():
            return root, root / "config" / "config.yaml"
    raise ConfigError(f"no config/config.yaml in {here} or any folder above it: run it inside a dormouse "
                      "clone (where `snakemake` runs), or pass --config PATH")


def load_preset(name: str, root: Path = Path("."), overrides: str = "") -> dict:
    """config/presets/<name>.yaml, with `overrides` (config `set`) applied, validated and default-filled."""
    path = root / "config" / "presets" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (root / "config" / "presets").glob("*.yaml"))
        raise ConfigError(f"{path}: no such preset {name!r} (known: {', '.join(known)})")
    preset = apply_overrides(load_yaml(path), overrides)
    source = f"{path}" + (f" with set={overrides!r}" if overrides else "")
    return validate(preset, "preset.schema.yaml", source)


def split_overrides(spec: str) -> list[tuple[str, str]]:
    """'a.b=1,c=[x, y]' -> [("a.b", "1"), ("c", "[x, y]")]: commas inside brackets or braces stay in the value."""
    items, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(f"set: {item!r} is not key=value (e.g. set='train.steps=500,data.reader.on_bad_record=skip')")
        out.append((key.strip(), value.strip()))
    return out


def apply_overrides(preset: dict, spec: str) -> dict:
    """Each dotted key set to its value read as YAML (so 500 is an int, null is None, [a, b] a list); a key's
    parents must be mappings. The schema then rejects an unknown key or a wrong type, naming it."""
    for key, value in split_overrides(spec):
        node, parts = preset, key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"set: {'.'.join(parts[: i + 1])} is a {type(child).__name__}, not a section, in {key!r}")
            node = child
        node[parts[-1]] = yaml.safe_load(value) if value else ""
    return preset


def load_retractions(path: Path, root: Path = Path(".")) -> list[dict]:
    entries = load_yaml(root / path) if (root / path).exists() else []
    entries = [] if entries == {} else entries
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and isinstance(e.get("date"), datetime.date):  # YAML reads 2026-12-02 as a date
            e["date"] = e["date"].isoformat()
    validate(entries, "retractions.schema.yaml", str(path))
    ids = [e["id"] for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{path}: duplicate retraction ids {dupes}")
    return entries


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; the dotted keys retractions match on."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
