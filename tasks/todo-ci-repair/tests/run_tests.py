"""The verifier of every task this project writes, copied into each task as ``tests/run_tests.py``.

Standard library only and self-contained (Python 3.8+): it runs inside the sandbox with the task's
Python (``python3 -I /tests/run_tests.py``, cwd /app), and under Harbor in the task's container.
Two modes, by whether ``/tests/config.json`` exists:

- **repository** (mined and imported tasks): overlays the test patch's files from ``/tests/files/``
  onto /app (and deletes the test files the patch deletes), runs pytest on the test files that hold
  the FAIL_TO_PASS and PASS_TO_PASS tests, rooted at /app; the graded tests are those two lists;
- **suite** (the bundled tasks and the generated families): runs every test under /tests, rooted at
  /tests; the graded tests are every test pytest collects (a module that fails to collect, or a
  deselected test, fails the grade).

The reward reads **per-test verdicts, never pytest's exit status**. The test process is a child
(``python3 -s -c BOOTSTRAP``) that imports pytest and this file's `Reporter` before any workspace
path is on ``sys.path``; the workspace roots are then appended after the standard library and the
runner, and an import guard (`ImportGuard`) resolves every standard-library name from the standard
library only and every installed name from the installed directories only, so nothing the change
adds can stand in for ``xml``, ``unittest``, ``difflib``, pytest or a library the tests use
(``config.json`` ``own_modules``: the repository's own module names, which stay code under test).
The child reads no bytecode from the tree (the verifier deletes every ``__pycache__`` and ``.pyc``
under /app first, `drop_bytecode`; a grade's copy carries none anyway) and writes none. The
reporter writes one record per collection and test phase to a file, each line signed with
HMAC-SHA256 under a key the verifier hands the child on its stdin (never on disk, argv or the
environment), numbered in order; the verifier checks every line, so a record the tests forged,
replayed or dropped is named (``forged``) and grades 0, and a child that left before pytest's
session finished (``os._exit`` at import, a signal) leaves the report incomplete: 0.

After the child ends the verifier kills every process the tests left (inside the sandbox's PID
namespace), removes outputs the tests planted, and writes under /logs/verifier:

- ``verdicts.json``: ``{"format", "mode", "rule", "complete", "forged", "graded", "tests": {node id:
  {"outcome", "message"}}, "collection_errors", "deselected", "exit_status", "timed_out", "reward"}``
  (outcomes: passed, failed, skipped, xfail, xpass); the grader reads this file, not reward.txt;
- ``reward.txt`` (Harbor's contract): 1 iff `decide` says so;
- repository mode: ``report.json`` in the shape of the ``swebench`` package's
  ``get_eval_tests_report``; ``test_output.txt``, pytest's log between SWE-bench's markers (``-rA``
  in repository mode, which SWE-bench's log parser reads), for people (the reward never reads it).

Rules (`decide`): "passed" (every task but imported ones): every graded test passed, at least one
graded, the session complete, nothing forged, and in suite mode no collection error or deselection.
"swebench" (imported SWE-bench instances, ``config.json`` ``rule``): SWE-bench's own, a listed test
succeeds when it passed or failed as expected (xfail), and nothing forged.

It is also the miner's runner (``--outcomes FILE`` writes every test's outcome and the modules
that failed to import, and skips the report), so a task is graded by the same code that found its tests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import sys
from pathlib import Path

FORMAT = "composer-jax-verdicts/1"  # the grader recognises this verifier by this line
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
PASSED, FAILED, SKIPPED, XFAIL, XPASS = "passed", "failed", "skipped", "xfail", "xpass"
RULES = ("passed", "swebench")
TIMED_OUT = -1
MODULE_NAME = "composer_jax_verdicts"
UNFINISHED = (
    "the test did not finish (no call phase reported)"  # the name the reporter is loaded under in the test process
)


# ---- in the test process ------------------------------------------------------------------------


def _signer(path: str, key: bytes):
    """A function writing one signed, numbered record per call to a new file at `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    seq = [0]

    def emit(record: dict) -> None:
        record = dict(record, seq=seq[0])
        seq[0] += 1
        line = json.dumps(record, sort_keys=True)
        mac = hmac.new(key, line.encode("utf-8"), hashlib.sha256).hexdigest()
        os.write(fd, (line + "\t" + mac + "\n").encode("utf-8"))

    return emit


def _message(report) -> str:
    text = getattr(report, "longreprtext", "") or ""
    return text[-1000:]


class Reporter:
    """The pytest plugin that records each verdict (loaded by object, before the workspace is importable)."""

    def __init__(self, path: str, key: bytes):
        self._emit = _signer(path, key)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._emit({"kind": "collect-error", "id": report.nodeid, "message": _message(report)})
        elif report.skipped:  # a module skipped whole at import: its tests never become items
            self._emit({"kind": "collect-skip", "id": report.nodeid, "message": str(report.longrepr)[-200:]})

    def pytest_deselected(self, items) -> None:
        self._emit({"kind": "deselected", "ids": [item.nodeid for item in items]})

    def pytest_collection_finish(self, session) -> None:
        self._emit({"kind": "collected", "ids": [item.nodeid for item in session.items]})

    def pytest_runtest_logreport(self, report) -> None:
        record = {"kind": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome}
        record["xfail"] = hasattr(report, "wasxfail")
        if report.failed or report.skipped:
            record["message"] = _message(report)[-500:] if report.failed else str(report.longrepr)[-200:]
        self._emit(record)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._emit({"kind": "finish", "exit_status": int(exitstatus)})


def _stdlib_names(stdlib_dirs: list) -> set:
    names = set(getattr(sys, "stdlib_module_names", ()))
    if not names:  # Python < 3.10: what the standard library's directories hold
        for d in stdlib_dirs:
            try:
                entries = os.listdir(d)
            except OSError:
                continue
            for entry in entries:
                stem = entry.split(".", 1)[0]
                if entry.endswith((".py", ".so", ".pyd")) or os.path.isfile(os.path.join(d, entry, "__init__.py")):
                    names.add(stem)
        names |= set(sys.builtin_module_names)
    return names - {"__main__", "test", "site-packages", "dist-packages"}


class ImportGuard:
    """A meta path finder, first in sys.meta_path, for top-level imports in the test process:

    - a name the task's own repository defines (`own`: config.json `own_modules`) is looked up in the
      workspace roots first (code under test, even when named like an installed or a
      standard-library module), else as usual;
    - a standard-library name is looked up in the standard library's directories only;
    - any other name an installed distribution provides is looked up in the installed directories
      only: a module the change adds cannot stand in for the runner or a library the tests use
      (pytest's `prepend` import mode puts the test files' folders, in the workspace for a
      repository task, first on sys.path);
    - anything else goes the usual way (sys.path, where the workspace roots are last).

    A module imported before the tests (the runner's, e.g. `statistics`) stays the one in
    sys.modules either way."""

    def __init__(self, stdlib_dirs: list, installed_dirs: list, roots: list, own: set):
        import importlib.machinery

        self._find = importlib.machinery.PathFinder.find_spec
        self._stdlib, self._installed = list(stdlib_dirs), list(installed_dirs)
        self._roots, self._own = list(roots), set(own)
        self._stdlib_names = _stdlib_names(self._stdlib)

    def find_spec(self, name, path=None, target=None):
        if path is not None or name in sys.builtin_module_names:
            return None
        if name in self._own:
            return self._find(name, self._roots)
        if name in self._stdlib_names:
            return self._find(name, self._stdlib)
        return self._find(name, self._installed) if self._installed else None

    def invalidate_caches(self) -> None:
        pass


def start_test_process(roots: str, args: list) -> int:
    """The child's body (called by BOOTSTRAP): read the key and the record path (line 1) and the
    task's own module names (line 2, JSON) from stdin, load the reporter, guard imports
    (`ImportGuard`), put the workspace roots after everything else, and run pytest with the
    reporter. No bytecode is written (the verifier removed the tree's before the run: `drop_bytecode`)."""
    key_hex, path = sys.stdin.buffer.readline().decode("ascii").split()
    own = set(json.loads(sys.stdin.buffer.readline() or b"[]"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    import pytest

    reporter = Reporter(path, bytes.fromhex(key_hex))
    del key_hex
    workspace = [r for r in roots.split(os.pathsep) if r]
    inside = tuple(os.path.join(r, "") for r in workspace)
    bases = (sys.base_prefix, sys.base_exec_prefix)
    site_names = ("site-packages", "dist-packages")
    stdlib = [p for p in sys.path if p.startswith(bases) and os.path.basename(p) not in site_names]
    installed = [p for p in sys.path if p not in stdlib and not os.path.join(p, "").startswith(inside)]
    sys.meta_path.insert(0, ImportGuard(stdlib, installed, workspace, own))
    sys.dont_write_bytecode = True
    sys.path.extend(workspace)
    os.environ["PYTHONPATH"] = roots  # the tests' own subprocesses
    return int(pytest.main(args, plugins=[reporter]))


# Run by `python3 -s -c BOOTSTRAP VERIFIER ROOTS ARGS...`: drops the cwd entry, loads this file
# under MODULE_NAME from its own path (trusted, outside the workspace), and hands over.
BOOTSTRAP = (
    "import os, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]\n"
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location({MODULE_NAME!r}, sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "sys.exit(mod.start_test_process(sys.argv[2], sys.argv[3:]))\n"
)


# ---- in the verifier process --------------------------------------------------------------------


def read_records(path: Path, key: bytes) -> tuple[list[dict], int]:
    """(the records whose signature and number check out, in order; how many lines did not)."""
    good: list = []
    forged = 0
    try:
        data = path.read_bytes()
    except OSError:
        return [], 0
    for raw in data.split(b"\n"):
        if not raw:
            continue
        line, _, mac = raw.rpartition(b"\t")
        want = hmac.new(key, line, hashlib.sha256).hexdigest().encode("ascii")
        try:
            record = json.loads(line) if hmac.compare_digest(mac, want) else None
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("seq") != len(good):
            forged += 1
            continue
        good.append(record)
    return good, forged


def fold(records: list[dict]) -> dict:
    """Verdicts from the records: {"tests": {id: {"outcome", "message"}}, "collected", "deselected",
    "collection_errors", "complete", "exit_status"}. Every report of a test counts (a test with
    subtests has several call reports): it fails if any failed (an error in setup or teardown
    included) or if it never finished its call phase; else the worst of its calls decides, a skip
    over an xfail over an xpass (a call that passed despite a non-strict xfail mark) over a pass."""
    reports: dict = {}
    out: dict = {"collected": [], "deselected": [], "collection_errors": {}, "complete": False, "exit_status": None}
    for r in records:
        kind = r.get("kind")
        if kind == "collected":
            out["collected"] = list(r.get("ids", []))
        elif kind == "deselected":
            out["deselected"] += list(r.get("ids", []))
        elif kind == "collect-error":
            out["collection_errors"][r.get("id", "")] = r.get("message", "")
        elif kind == "collect-skip":
            out["collection_errors"][r.get("id", "")] = "skipped at collection: " + r.get("message", "")
        elif kind == "finish":
            out["complete"], out["exit_status"] = True, r.get("exit_status")
        elif kind == "report":
            reports.setdefault(r.get("id"), []).append(r)
    rank = {SKIPPED: 3, XFAIL: 2, XPASS: 1, PASSED: 0}
    tests = {}
    for nid, seen in reports.items():
        failed = [x for x in seen if x.get("outcome") == "failed"]
        calls = [x for x in seen if x.get("when") == "call"]
        calls += [x for x in seen if x.get("when") == "setup" and x.get("outcome") == "skipped"]
        if failed:
            when = failed[0].get("when")
            prefix = "" if when == "call" else f"error in {when}: "
            tests[nid] = {"outcome": FAILED, "message": prefix + failed[0].get("message", "")}
            continue
        if not calls:
            tests[nid] = {"outcome": FAILED, "message": UNFINISHED}
            continue
        verdicts = []
        for x in calls:
            if x.get("outcome") == "skipped":
                verdicts.append((XFAIL if x.get("xfail") else SKIPPED, x.get("message", "")))
            else:
                verdicts.append((XPASS if x.get("xfail") else PASSED, ""))
        outcome, message = max(verdicts, key=lambda v: rank[v[0]])
        tests[nid] = {"outcome": outcome, "message": message}
    out["tests"] = tests
    return out


def decide(verdicts: dict) -> tuple[float, str]:
    """(reward, why) from a verdicts.json object (see the module docstring for the rules)."""
    if verdicts.get("forged"):
        return 0.0, f"{verdicts['forged']} verdict record(s) failed their signature"
    tests, graded = verdicts.get("tests", {}), list(verdicts.get("graded", []))
    good = (PASSED, XFAIL) if verdicts.get("rule") == "swebench" else (PASSED,)
    if verdicts.get("rule") != "swebench":
        if not verdicts.get("complete"):
            return 0.0, "the test process ended before pytest's session finished"
        if not graded:
            return 0.0, "no graded test"
        if verdicts.get("mode") == "suite" and (verdicts.get("collection_errors") or verdicts.get("deselected")):
            return 0.0, "a test module did not collect, or a test was deselected"
    bad = [t for t in graded if tests.get(t, {}).get("outcome") not in good]
    if bad:
        shown = ", ".join(f"{t} ({tests.get(t, {}).get('outcome', 'missing')})" for t in bad[:5])
        return 0.0, f"{len(bad)} of {len(graded)} graded test(s) did not pass: {shown}"
    return 1.0, f"all {len(graded)} graded test(s) passed"


def report(results: dict, fail_to_pass: list, pass_to_pass: list, rule: str = "swebench") -> dict:
    """The ``swebench`` package's report shape. Under its rule a test succeeds when it passed or
    failed as expected; anything else fails, a skip included (pytest's ``-rA`` names a skip by file
    and line, not by node id, so the official grading never sees it). Under "passed" only a pass."""
    good = (PASSED, XFAIL) if rule == "swebench" else (PASSED,)

    def split(tests: list) -> dict:
        ok = [t for t in tests if results.get(t, {}).get("outcome") in good]
        return {"success": ok, "failure": [t for t in tests if t not in ok]}

    return {
        "FAIL_TO_PASS": split(fail_to_pass),
        "PASS_TO_PASS": split(pass_to_pass),
        "FAIL_TO_FAIL": {"success": [], "failure": []},
        "PASS_TO_FAIL": {"success": [], "failure": []},
    }


def own_modules(tree: Path) -> list:
    """Every name the repository at `tree` could import a top-level module by (each `.py` file's stem,
    each folder's name, outside hidden and cache folders): the task's own code, which the import
    guard lets the workspace supply ahead of an installed or a standard-library module."""
    names: set = set()
    for _dirpath, dirnames, filenames in os.walk(str(tree)):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        names.update(d for d in dirnames if d.isidentifier())
        names.update(f[:-3] for f in filenames if f.endswith(".py") and f[:-3].isidentifier())
    names.discard("__init__")
    return sorted(names)


def overlay(files: Path, app: Path, deleted: list) -> None:
    for rel in deleted:
        target = app / rel
        if target.is_file() or target.is_symlink():
            target.unlink()
    if files.is_dir():
        shutil.copytree(str(files), str(app), dirs_exist_ok=True, symlinks=True)


def drop_bytecode(root: Path) -> int:
    """Remove every `__pycache__` folder and `.pyc` / `.pyo` file under `root` (not following links),
    so the interpreter reads no bytecode from the tree: a grade's copy carries none from the
    workspace (sandbox/snapshot.py), and this holds for any copy, a Harbor container's included.
    -> how many entries went."""
    gone = 0
    for dirpath, dirnames, filenames in os.walk(str(root)):
        for d in [d for d in dirnames if d == "__pycache__"]:
            shutil.rmtree(os.path.join(dirpath, d), ignore_errors=True)
            dirnames.remove(d)
            gone += 1
        for f in filenames:
            if f.endswith((".pyc", ".pyo")):
                try:
                    os.unlink(os.path.join(dirpath, f))
                    gone += 1
                except OSError:
                    pass
    return gone


def child_env(seed: str | None) -> dict:
    """The test process's variables: no PYTHON* the sandbox or a caller set (a PYTHONPATH, a
    PYTHONSTARTUP, a PYTHONHOME) but the hash seed; no bytecode written (see start_test_process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1"
    )  # (no PYTHONSAFEPATH: the tests' own `python -m` need their cwd)
    if seed:
        env["PYTHONHASHSEED"] = seed
    return env


def run_pytest(
    app: Path,
    rootdir: Path,
    targets: list,
    logs: Path,
    timeout: float | None,
    seed: str | None,
    own: list,
    summary: bool,
) -> tuple[int, list, int]:
    """Run the targets under pytest in a child: (exit code or TIMED_OUT, verified records, forged lines)."""
    import subprocess
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="verdicts-"))
    key, records = os.urandom(32), work / "records"
    roots = [str(app / "src"), str(app)] if (app / "src").is_dir() else [str(app)]
    argv = [sys.executable, "-s", "-c", BOOTSTRAP, str(Path(__file__).resolve()), os.pathsep.join(roots)]
    argv += ["-rA" if summary else "-q", "-p", "no:cacheprovider", "--rootdir", str(rootdir)]
    argv += targets
    log = logs / "test_output.txt"
    stdin = (key.hex() + " " + str(records) + "\n" + json.dumps(sorted(own)) + "\n").encode("utf-8")
    try:
        with log.open("w") as f:
            f.write(START + "\n")
            f.flush()
            try:
                code = subprocess.run(
                    argv,
                    cwd=str(app),
                    env=child_env(seed),
                    input=stdin,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                code = TIMED_OUT
                f.write("\n>>>>> Tests Timed Out\n")
            f.write(f"\n{END}\n")
        end_strays()
        found, forged = read_records(records, key)
    finally:
        shutil.rmtree(str(work), ignore_errors=True)
    sys.stdout.write(log.read_text(errors="replace")[-20000:])
    return code, found, forged


def end_strays() -> None:
    """Kill every process the tests left running, so that nothing writes after the verifier reads
    the results; only inside the sandbox's own PID namespace (SANDBOX_PID_NAMESPACE=1), where
    everything but PID 1, this process and its parents was started by the tests."""
    if os.environ.get("SANDBOX_PID_NAMESPACE") != "1":
        return
    keep, pid = {1}, os.getpid()
    while pid > 1:
        keep.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep:
            try:
                os.kill(int(entry), 9)
            except OSError:
                pass


def clear_outputs(logs: Path) -> None:
    """Remove the outputs the tests may have planted where this verifier writes its own (a
    reward.json it never writes is left for the grader to find and refuse)."""
    logs.chmod(0o755)
    for name in ("reward.txt", "report.json", "verdicts.json"):
        entry = logs / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(str(entry))
        elif entry.is_symlink() or entry.exists():
            entry.unlink()


def main(argv: list | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--app", type=Path, default=Path("/app"))
    p.add_argument("--tests", type=Path, default=Path("/tests"))
    p.add_argument("--logs", type=Path, default=Path("/logs/verifier"))
    p.add_argument("--outcomes", type=Path, help="write every test's outcome here (the miner's runs)")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument(
        "--hash-seed", help="PYTHONHASHSEED for the run (the miner varies it to expose order-dependent tests)"
    )
    args = p.parse_args(argv)
    args.app, args.tests, args.logs = (x.absolute() for x in (args.app, args.tests, args.logs))
    config_path = args.tests / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    args.logs.mkdir(parents=True, exist_ok=True)
    if config is not None:
        overlay(args.tests / "files", args.app, config.get("deleted", []))
        rootdir, targets, own = args.app, list(config["test_files"]), list(config.get("own_modules", []))
    else:
        rootdir, targets, own = args.tests, [str(args.tests)], []
    drop_bytecode(args.app)
    code, records, forged = run_pytest(
        args.app, rootdir, targets, args.logs, args.timeout, args.hash_seed, own, summary=config is not None
    )
    clear_outputs(args.logs)
    folded = fold(records)
    if args.outcomes is not None:
        errors = {nid.split("::")[0]: m for nid, m in folded["collection_errors"].items()}
        # a test the run never finished (it hung until the time limit, or the process left) is
        # absent for the miner, not failed: a run cut off at its limit decides nothing about it
        finished = {n: v for n, v in folded["tests"].items() if v["message"] != UNFINISHED}
        outcomes = {"tests": finished, "collection_errors": errors, "timed_out": code == TIMED_OUT}
        args.outcomes.write_text(json.dumps(outcomes, indent=1, sort_keys=True))
        return 0
    rule = config.get("rule", "passed") if config is not None else "passed"
    if rule not in RULES:
        raise SystemExit(f"config.json rule {rule!r}; accepted: {', '.join(RULES)}")
    if config is not None:
        graded = list(config["fail_to_pass"]) + list(config["pass_to_pass"])
    else:
        graded = list(folded["collected"]) + list(folded["deselected"])
    verdicts = {
        "format": FORMAT,
        "mode": "repository" if config is not None else "suite",
        "rule": rule,
        "complete": folded["complete"],
        "forged": forged,
        "graded": graded,
        "tests": folded["tests"],
        "collection_errors": folded["collection_errors"],
        "deselected": folded["deselected"],
        "exit_status": folded["exit_status"],
        "timed_out": code == TIMED_OUT,
    }
    verdicts["reward"], verdicts["why"] = decide(verdicts)
    (args.logs / "verdicts.json").write_text(json.dumps(verdicts, indent=1))
    if config is not None:
        rep = report(folded["tests"], config["fail_to_pass"], config["pass_to_pass"], rule)
        (args.logs / "report.json").write_text(json.dumps(rep, indent=1))
    (args.logs / "reward.txt").write_text("1\n" if verdicts["reward"] == 1.0 else "0\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
