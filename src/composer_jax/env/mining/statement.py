"""The problem statement and category of a mined task.

The statement is back-translated from the change, as R2E-Gym and SWE-smith do: the commit's
message in the form of an issue, plus the tests that must come to pass and how they fail today
(their assertion messages from the "before" run). It must never hand over the solution, so every
line that contains a line the solution patch adds (stripped, long enough to be telling) is dropped,
whoever wrote it: the template here, or any OpenAI-compatible endpoint (`--writer-url`), whose
answer goes through the same filter and falls back to the template when it fails or comes back
empty.
"""

from __future__ import annotations

import ast
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from composer_jax.env.mining.gitrepo import Commit, FileChange, is_test_path

MIN_LEAK_CHARS = 12  # an added line shorter than this ("return x", "pass") says nothing on its own
MAX_MESSAGE_CHARS = 400
MAX_TESTS_SHOWN = 20
MAX_SOURCE_LINES = 30  # of a test shown as the expected behaviour
_FIX = re.compile(r"\b(fix(e[sd])?|bug|regression|crash(es)?|wrong|incorrect|broken|error|issue)\b", re.I)
_REFACTOR = re.compile(r"\b(refactor(s|ed|ing)?|clean ?up|rename[sd]?|simplif(y|ies|ied))\b", re.I)
_FEATURE = re.compile(r"\b(add(s|ed)?|support(s|ed)?|implement(s|ed)?|introduce[sd]?|new|allow(s|ed)?)\b", re.I)
_TESTS = re.compile(r"^(tests?|testing)\b[:(]?|\b(add|more|improve)\w* tests?\b", re.I)

_MERGE = re.compile(r"^Merge (pull request|branch|remote-tracking branch|tag) ")

Writer = Callable[[dict], str]


def title_and_body(commit: Commit) -> tuple[str, str]:
    """What the change says it is: a merge commit's subject names only the merge ("Merge pull
    request #686 from ..."), so its body's first line (the PR title GitHub writes there) is the
    title and the rest the body."""
    if _MERGE.match(commit.subject) and commit.body.strip():
        first, _, rest = commit.body.strip().partition("\n")
        return first.strip(), rest.strip()
    return commit.subject, commit.body


def category_of(commit: Commit, changes: list[FileChange], before: dict, fail_to_pass: list[str]) -> str:
    """bug fix | feature | refactor | tests: the message's words first, then the change's shape.

    By shape: a change whose FAIL_TO_PASS tests all did not exist before (new tests of new
    behaviour) is "feature"; one that is mostly tests (test lines >= 3x source lines) is "tests";
    the rest are bug fixes (existing tests that failed)."""
    title, body = title_and_body(commit)
    message = f"{title}\n{body}"
    if _TESTS.search(title):
        return "tests"
    if _FIX.search(message):
        return "bug fix"
    if _REFACTOR.search(message):
        return "refactor"
    if _FEATURE.search(title):
        return "feature"
    test_lines = sum(c.added + c.deleted for c in changes if is_test_path(c.path))
    source_lines = sum(c.added + c.deleted for c in changes if not is_test_path(c.path))
    if fail_to_pass and all(t not in before for t in fail_to_pass):
        return "feature"
    if test_lines >= 3 * max(1, source_lines):
        return "tests"
    return "bug fix"


def added_lines(patch: bytes) -> set[str]:
    """The telling lines a patch adds (stripped, at least MIN_LEAK_CHARS long)."""
    out = set()
    for line in patch.decode("utf-8", "replace").splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            text = line[1:].strip()
            if len(text) >= MIN_LEAK_CHARS:
                out.add(text)
    return out


def without_leaks(text: str, solution_patch: bytes) -> str:
    """`text` less every line that contains a telling line of the solution patch."""
    leaks = added_lines(solution_patch)
    kept = [line for line in text.splitlines() if not any(leak in line for leak in leaks)]
    return "\n".join(kept)


def _first_line(message: str) -> str:
    for line in message.strip().splitlines():
        if line.strip():
            return line.strip()[:MAX_MESSAGE_CHARS]
    return ""


def test_source(files: Path, node_id: str, *, imports_wanted: bool = True) -> str | None:
    """The source of the test function `node_id` names, from the test files under `files`
    (after its module's imports, with `imports_wanted`)."""
    path, *names = node_id.split("::")
    try:
        tree = ast.parse((files / path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for name in [*names[:-1], names[-1].split("[")[0]] if names else []:
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    if not isinstance(node, ast.FunctionDef):
        return None
    text = (files / path).read_text()
    imports = [ast.get_source_segment(text, n) or "" for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    imports = imports if imports_wanted else []
    code = "\n".join([*imports, *([""] if imports else []), *(ast.get_source_segment(text, node) or "").splitlines()])
    return "\n".join(code.splitlines()[:MAX_SOURCE_LINES])


def facts(commit: Commit, fail_to_pass: list[str], before: dict, repo: str, files: Path | None = None) -> dict:
    """What a statement may be written from: the message, how the FAIL_TO_PASS tests fail, and for
    tests that do not exist yet their source (the behaviour expected, as a reproduction)."""
    failing = []
    shown: set[str] = set()  # test files whose imports were shown already
    for name in fail_to_pass[:MAX_TESTS_SHOWN]:
        seen = before.get(name)
        entry = {"test": name}
        if seen is None:
            entry["now"] = "does not exist or cannot be collected yet"
            path = name.split("::")[0]
            code = test_source(files, name, imports_wanted=path not in shown) if files is not None else None
            shown.add(path)
            if code:
                entry["expected"] = code
        else:
            entry["now"] = _first_line(seen.get("message", "")) or "fails"
        failing.append(entry)
    title, body = title_and_body(commit)
    return {
        "repo": repo,
        "subject": title,
        "body": body,
        "failing_tests": failing,
        "more_tests": max(0, len(fail_to_pass) - MAX_TESTS_SHOWN),
    }


def template_statement(f: dict) -> str:
    lines = [f"# {f['subject'] or 'A change is needed'}", ""]
    if f["body"]:
        lines += [f["body"].strip(), ""]
    lines += [f"In the repository `{f['repo']}` (checked out at /app), these tests must pass and do not today:", ""]
    for t in f["failing_tests"]:
        lines.append(f"- `{t['test']}`: {t['now']}")
        if t.get("expected"):
            lines += ["", "  The behaviour it expects:", "", "  ```python"]
            lines += [f"  {line}" if line else "" for line in t["expected"].splitlines()]
            lines += ["  ```", ""]
    if f["more_tests"]:
        lines.append(f"- and {f['more_tests']} more")
    lines += [
        "",
        "The tests themselves are not in the workspace and will be put in place when your change is graded; "
        "the existing tests must keep passing. Change the code, not the tests.",
    ]
    return "\n".join(lines)


def write_instruction(commit: Commit, task, before: dict, writer: Writer | None, files: Path | None = None) -> str:
    """The statement of `task` (a taskwrite.RepoTask); the writer's when one is given and usable.
    `files`: the test files as the test patch leaves them (the task's tests/files)."""
    f = facts(commit, task.fail_to_pass, before, task.repo, files)
    text = ""
    if writer is not None:
        try:
            text = without_leaks(writer(f), task.solution_patch).strip()
        except (OSError, ValueError, KeyError) as exc:
            print(f"composer-jax env mine: the statement writer failed ({exc}); using the template")
            text = ""
    if not text:
        text = without_leaks(template_statement(f), task.solution_patch).strip()
    return text


WRITER_PROMPT = (
    "You write GitHub issues. From a commit message and the tests that fail before the fix, write the issue "
    "a user would have filed before the change existed: what is wrong or missing, how to see it, what is "
    "expected. Never describe the implementation, never include code of the fix, never name the tests' "
    "file paths as something to edit. Answer with the issue text only (Markdown)."
)


def openai_writer(url: str, model: str, api_key: str | None = None, timeout: float = 120.0) -> Writer:
    """A statement writer calling an OpenAI-compatible `POST {url}/chat/completions`."""
    endpoint = url.rstrip("/") + "/chat/completions"

    def write(f: dict) -> str:
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": WRITER_PROMPT},
                {"role": "user", "content": json.dumps(f, indent=1)},
            ],
            "temperature": 0.0,
        }
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        req = urllib.request.Request(endpoint, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{endpoint} answered {exc.code}: {exc.read()[:200]!r}") from None
        content = data["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise ValueError(f"{endpoint} returned no text content")
        return content

    return write
