"""The verifier of a mined or imported task, copied into the task as ``tests/run_tests.py``.

Standard library only and self-contained: it runs inside the sandbox with the task's Python
(``python3 /tests/run_tests.py``, cwd /app). It overlays the test patch's files from
``/tests/files/`` onto /app (and deletes the test files the patch deletes), runs pytest on the
test files that hold the FAIL_TO_PASS and PASS_TO_PASS tests (``-rA``, JUnit XML in the xunit1
family so every case names its file), prints the run between SWE-bench's log markers, and writes:

- ``junit.xml`` (pytest's) and ``test_output.txt`` (the log) under /logs/verifier;
- ``report.json``: ``{"FAIL_TO_PASS": {"success": [...], "failure": [...]}, "PASS_TO_PASS": ...,
  "FAIL_TO_FAIL": ..., "PASS_TO_FAIL": ...}`` in the shape of the ``swebench`` package's
  ``get_eval_tests_report``, outcomes read from the JUnit XML (a test absent from it failed);
- ``reward.txt``: 1 iff every FAIL_TO_PASS and PASS_TO_PASS test succeeded (SWE-bench's resolved).

It is also the miner's runner (``--outcomes FILE`` writes every test's outcome and the modules
that failed to import, and skips the report), so a task is graded by the same code that found its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
PASSED, FAILED, SKIPPED, XFAIL = "passed", "failed", "skipped", "xfail"


def node_id(case: ET.Element) -> str | None:
    """A pytest node id (``tests/test_x.py::TestC::test_a[p]``) from an xunit1 testcase."""
    file, classname, name = case.get("file"), case.get("classname") or "", case.get("name")
    if not file or name is None:
        return None
    file = file.replace(os.sep, "/")
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    classes = classname[len(module) :].lstrip(".") if classname.startswith(module) else ""
    return "::".join([file, *(classes.split(".") if classes else []), name])


def outcome_of(case: ET.Element) -> tuple[str, str]:
    for child in case:
        if child.tag in ("failure", "error"):
            return FAILED, (child.get("message") or child.text or "")[:1000]
        if child.tag == "skipped":  # pytest writes an expected failure as <skipped type="pytest.xfail">
            kind = XFAIL if child.get("type") == "pytest.xfail" else SKIPPED
            return kind, (child.get("message") or "")[:200]
    return PASSED, ""


def read_junit(path: Path, collection_errors: dict[str, str] | None = None) -> dict[str, dict]:
    """{node id: {"outcome", "message"}}; a case reported twice (call and teardown) fails if either did.

    A module that failed to import is no test (pytest reports it as a case named after the module,
    with message "collection failure"): it goes to `collection_errors` {file: message} instead."""
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return out
    for case in root.iter("testcase"):
        nid = node_id(case)
        if nid is None:
            continue
        error = case.find("error")
        if error is not None and error.get("message") == "collection failure" and not case.get("classname"):
            if collection_errors is not None:
                collection_errors[case.get("file") or nid] = (error.text or "")[-1000:]
            continue
        outcome, message = outcome_of(case)
        if nid not in out or outcome == FAILED:
            out[nid] = {"outcome": outcome, "message": message}
    return out


def overlay(files: Path, app: Path, deleted: list[str]) -> None:
    for rel in deleted:
        target = app / rel
        if target.is_file() or target.is_symlink():
            target.unlink()
    if files.is_dir():
        shutil.copytree(files, app, dirs_exist_ok=True, symlinks=True)


# pytest's process imports pytest before the workspace joins sys.path (the cwd entry dropped, no
# PYTHONPATH at start-up, no user site), so a module in /app cannot stand in for the runner and no
# sitecustomize of the workspace runs; the tests' own subprocesses still get PYTHONPATH.
BOOTSTRAP = (
    "import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]; import pytest; "
    "roots = sys.argv.pop(1); sys.path[:0] = roots.split(os.pathsep); os.environ['PYTHONPATH'] = roots; "
    "sys.exit(pytest.console_main())"
)


def run_pytest(app: Path, targets: list[str], junit: Path, log: Path, timeout: float | None, seed: str | None) -> int:
    """Run the targets under pytest; -> its exit code, TIMED_OUT when `timeout` ended it."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **({"PYTHONHASHSEED": seed} if seed else {}))
    roots = [str(app / "src"), str(app)] if (app / "src").is_dir() else [str(app)]
    roots += [p for p in [env.pop("PYTHONPATH", None)] if p]
    env.pop("PYTHONSTARTUP", None)
    argv = [sys.executable, "-s", "-c", BOOTSTRAP, os.pathsep.join(roots)]
    argv += ["-rA", "-p", "no:cacheprovider", "-o", "junit_family=xunit1"]
    argv += [f"--junitxml={junit}", "--rootdir", str(app), *targets]
    with log.open("w") as f:
        f.write(START + "\n")
        f.flush()
        try:
            code = subprocess.run(
                argv, cwd=app, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = TIMED_OUT
            f.write("\n>>>>> Tests Timed Out\n")
        f.write(f"\n{END}\n")
    sys.stdout.write(log.read_text(errors="replace")[-20000:])
    return code


TIMED_OUT = -1


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
    for name in ("reward.txt", "report.json"):
        entry = logs / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.is_symlink() or entry.exists():
            entry.unlink()


def report(results: dict[str, dict], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """SWE-bench's rule (``get_eval_tests_report`` over ``parse_log_pytest``'s status map): a test
    succeeds when it passed or failed as expected; anything else fails, a skip included (pytest's
    ``-rA`` names a skip by file and line, not by node id, so the official grading never sees it)."""

    def split(tests: list[str]) -> dict:
        good = [t for t in tests if results.get(t, {}).get("outcome") in (PASSED, XFAIL)]
        return {"success": good, "failure": [t for t in tests if t not in good]}

    return {
        "FAIL_TO_PASS": split(fail_to_pass),
        "PASS_TO_PASS": split(pass_to_pass),
        "FAIL_TO_FAIL": {"success": [], "failure": []},
        "PASS_TO_FAIL": {"success": [], "failure": []},
    }


def main(argv: list[str] | None = None) -> int:
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
    config = json.loads((args.tests / "config.json").read_text())
    args.logs.mkdir(parents=True, exist_ok=True)
    overlay(args.tests / "files", args.app, config.get("deleted", []))
    junit = args.logs / "junit.xml"
    log = args.logs / "test_output.txt"
    code = run_pytest(args.app, config["test_files"], junit, log, args.timeout, args.hash_seed)
    end_strays()
    clear_outputs(args.logs)
    errors: dict[str, str] = {}
    results = read_junit(junit, errors)
    if args.outcomes is not None:
        outcomes = {"tests": results, "collection_errors": errors, "timed_out": code == TIMED_OUT}
        args.outcomes.write_text(json.dumps(outcomes, indent=1, sort_keys=True))
        return 0
    rep = report(results, config["fail_to_pass"], config["pass_to_pass"])
    (args.logs / "report.json").write_text(json.dumps(rep, indent=1))
    resolved = not rep["FAIL_TO_PASS"]["failure"] and not rep["PASS_TO_PASS"]["failure"]
    (args.logs / "reward.txt").write_text("1\n" if resolved else "0\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
