"""Family config-repair: CI fails on the service's config check; fix the config, not the checker.

The workspace has a config checker (``svc/check.py``), unit tests and ``ci.sh`` that runs both on
``config/service.ini``; the seed draws a valid config and plants 1-3 faults in it (out-of-range
port, bad log level, malformed URL, ...). The hidden tests check that CI passes, that the checker,
the unit tests and ci.sh are byte-identical (sha256), that a pristine copy of the checker accepts
the config, and that only the broken keys changed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

from .base import Family, TaskSpec, dedent

FAMILY = Family("config-repair", "CI fails on a config check; repair the INI config minimally.", "devops")

_CHECKER = dedent('''
    """Validation of the service's INI configuration; `python3 -m svc.check FILE` exits 1 on errors."""
    import configparser
    import re
    import sys

    LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR"}
    REQUIRED = {
        "service": ["name", "port", "workers", "log_level"],
        "database": ["url", "pool_size", "timeout"],
        "cache": ["ttl", "max_ttl"],
    }


    def _int(section, key, errors, lo=None, hi=None):
        raw = section.get(key)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            errors.append(f"{section.name}.{key}: expected an integer, got {raw!r}")
            return None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            errors.append(f"{section.name}.{key}: {value} out of range [{lo}, {hi}]")
        return value


    def validate(cfg):
        errors = []
        for sec, keys in REQUIRED.items():
            if not cfg.has_section(sec):
                errors.append(f"missing section [{sec}]")
                continue
            for key in keys:
                if key not in cfg[sec]:
                    errors.append(f"{sec}.{key}: missing")
        if errors:
            return errors
        svc, db, cache = cfg["service"], cfg["database"], cfg["cache"]
        if not re.fullmatch(r"[a-z][a-z0-9-]{2,30}", svc["name"]):
            errors.append(f"service.name: invalid {svc['name']!r}")
        _int(svc, "port", errors, 1024, 65535)
        workers = _int(svc, "workers", errors, 1, 32)
        if svc["log_level"] not in LEVELS:
            errors.append(f"service.log_level: {svc['log_level']!r} not one of {sorted(LEVELS)}")
        if not re.fullmatch(r"(postgres|sqlite)://\\S+", db["url"]):
            errors.append(f"database.url: unsupported {db['url']!r}")
        pool = _int(db, "pool_size", errors, 1, 100)
        if workers is not None and pool is not None and pool < workers:
            errors.append("database.pool_size: must be at least service.workers")
        try:
            if float(db["timeout"]) <= 0:
                errors.append("database.timeout: must be positive seconds")
        except ValueError:
            errors.append(f"database.timeout: not a number {db['timeout']!r}")
        ttl = _int(cache, "ttl", errors, 0)
        max_ttl = _int(cache, "max_ttl", errors, 1)
        if ttl is not None and max_ttl is not None and ttl > max_ttl:
            errors.append("cache.ttl: larger than cache.max_ttl")
        return errors


    def main(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        cfg = configparser.ConfigParser(interpolation=None)
        with open(argv[0], encoding="utf-8") as fh:
            cfg.read_file(fh)
        errors = validate(cfg)
        for err in errors:
            print("config error:", err, file=sys.stderr)
        if not errors:
            print("config ok")
        return 1 if errors else 0


    if __name__ == "__main__":
        sys.exit(main())
    ''')

# fault -> (section, key, bad value, fixed value, symptom hint)
_FAULTS = {
    "port_low": ("service", "port", "80", None, "port"),
    "port_high": ("service", "port", "80800", None, "port"),
    "level": ("service", "log_level", "VERBOSE", "DEBUG", "log level"),
    "level_case": ("service", "log_level", "info", "INFO", "log level"),
    "workers": ("service", "workers", "0", None, "workers"),
    "url": ("database", "url", "postgres//db.internal:5432/app", "postgres://db.internal:5432/app", "db url"),
    "timeout_unit": ("database", "timeout", "2.5s", "2.5", "timeout"),
    "name": ("service", "name", "Billing_API", "billing-api", "service name"),
    "ttl": ("cache", "ttl", "7200", None, "ttl"),
    "pool": ("database", "pool_size", "2", None, "pool"),
    "missing": ("database", "timeout", None, None, "timeout"),
}


def _values(rng: random.Random) -> dict[str, dict[str, str]]:
    workers = rng.randint(2, 16)
    return {
        "service": {
            "name": rng.choice(["billing-api", "search", "ledger", "notify-worker"]),
            "port": str(rng.choice([8080, 8443, 9000, 5000 + rng.randint(0, 999)])),
            "workers": str(workers),
            "log_level": rng.choice(["INFO", "WARNING", "DEBUG"]),
        },
        "database": {
            "url": rng.choice(["postgres://db.internal:5432/app", "sqlite:///var/lib/app.db"]),
            "pool_size": str(workers + rng.randint(0, 10)),
            "timeout": rng.choice(["2.5", "5", "0.75", "10"]),
        },
        "cache": {"ttl": str(rng.choice([60, 300, 600])), "max_ttl": str(rng.choice([900, 3600]))},
    }


def _ini(values: Mapping[str, Mapping[str, str | None]]) -> str:
    out = []
    for sec, kv in values.items():
        out.append(f"[{sec}]")
        out += [f"{k} = {v}" for k, v in kv.items() if v is not None]
        out.append("")
    return "\n".join(out)


_TESTS = """\
import configparser
import hashlib
import pathlib
import subprocess
import sys

ORIGINAL = {original!r}
BROKEN = {broken!r}
PROTECTED = {protected!r}


def load(path):
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(path)
    return {{s: dict(cfg[s]) for s in cfg.sections()}}


def test_ci_passes():
    proc = subprocess.run(["bash", "ci.sh"], cwd="/app", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config ok" in proc.stdout
    assert "passed" in proc.stdout


def test_checker_and_tests_untouched():
    for rel, digest in PROTECTED.items():
        assert hashlib.sha256(pathlib.Path("/app", rel).read_bytes()).hexdigest() == digest, rel


def test_config_valid_by_pristine_checker():
    sys.path.insert(0, "/tests")
    import pristine_check
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read("/app/config/service.ini")
    assert pristine_check.validate(cfg) == []


def test_only_broken_keys_changed():
    now = load("/app/config/service.ini")
    for sec, kv in ORIGINAL.items():
        for key, value in kv.items():
            if (sec, key) in BROKEN:
                continue
            assert now[sec][key] == value, f"{{sec}}.{{key}} should not change"
    for sec, key in BROKEN:
        assert sec in now and key in now[sec], f"{{sec}}.{{key}} must be set"
"""

_APP_TEST = dedent("""
    import configparser

    from svc.check import validate


    def load():
        cfg = configparser.ConfigParser(interpolation=None)
        cfg.read("config/service.ini")
        return cfg


    def test_config_is_valid():
        assert validate(load()) == []


    def test_rejects_bad_level():
        cfg = load()
        cfg["service"]["log_level"] = "LOUD"
        assert any("log_level" in e for e in validate(cfg))
    """)

_CI_SH = """\
#!/usr/bin/env bash
# CI: validate the deployed config, then run the unit tests.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m svc.check config/service.ini
python3 -m pytest -q -p no:cacheprovider tests
"""


def generate(rng: random.Random, seed: int) -> TaskSpec:
    values = _values(rng)
    faults = rng.sample(sorted(_FAULTS), rng.choice([1, 2, 2, 3]))
    # one fault per key
    seen, chosen = set(), []
    for f in faults:
        sec, key = _FAULTS[f][:2]
        if (
            (sec, key) not in seen
            and not (f == "pool" and ("service", "workers") in seen)
            and not (f == "workers" and ("database", "pool_size") in seen)
        ):
            seen.add((sec, key))
            chosen.append(f)
    # a value of None means the key is missing from the broken config
    broken: dict[str, dict[str, str | None]] = {s: dict(kv) for s, kv in values.items()}
    fixed = {s: dict(kv) for s, kv in values.items()}
    for f in chosen:
        sec, key, bad, good, _ = _FAULTS[f]
        if f == "pool":
            broken[sec][key] = str(max(1, int(values["service"]["workers"]) - rng.randint(1, 2)))
        elif f == "ttl":
            broken[sec][key] = str(int(values["cache"]["max_ttl"]) * 2)
        else:
            broken[sec][key] = bad
        fixed[sec][key] = good if good is not None else values[sec][key]
    app = {
        "svc/__init__.py": '"""svc: the service package."""\n',
        "svc/check.py": _CHECKER,
        "tests/test_config.py": _APP_TEST,
        "config/service.ini": _ini(broken),
        "ci.sh": _CI_SH,
    }
    protected = {
        rel: hashlib.sha256(app[rel].encode()).hexdigest() for rel in ("svc/check.py", "tests/test_config.py", "ci.sh")
    }
    original = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in broken.items()}
    broken_keys = sorted({(_FAULTS[f][0], _FAULTS[f][1]) for f in chosen})
    name = values["service"]["name"]
    instr = rng.choice(
        [
            f"CI is red for {name}: `bash ci.sh` fails at the config check. Fix config/service.ini (the checker and "
            "tests are right; leave them alone). Don't change unrelated settings.",
            f"The {name} deploy pipeline fails on `ci.sh`. The config checker is correct, the config is not. Fix "
            "config/service.ini with minimal changes.",
            f"{name}: `ci.sh` rejects our config after the last edit. Repair config/service.ini so CI passes; only "
            "touch the broken settings.",
        ]
    )
    return TaskSpec(
        instruction=instr,
        app=app,
        tests={
            "test_outputs.py": _TESTS.format(original=original, broken=broken_keys, protected=protected),
            "pristine_check.py": _CHECKER,
        },
        solution={"config/service.ini": _ini(fixed)},
        difficulty="easy" if len(chosen) == 1 else "medium",
        category="devops",
        tags=["ci", "config", "devops"] + chosen,
    )
