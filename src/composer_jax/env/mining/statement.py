"""The problem statement and category of a mined task.

The statement is back-translated from the change, as R2E-Gym and SWE-smith do: the commit's
message in the form of an issue, plus the tests that must come to pass and how they fail today
(their assertion messages from the "before" run). It must never hand over the solution, so every
line that contains a line the solution patch adds (stripped, long enough to be telling), or an
identifier or string literal the solution introduces (`solution_terms`: in its added lines, not in
what it removes or keeps) that the failing tests do not show themselves, is dropped, whoever wrote
it: the commit's own prose, the template here, or any OpenAI-compatible endpoint (`--writer-url`),
whose answer goes through the same filter and falls back to the template when it fails or comes
back empty. But it must say enough: a test that exists before the change and whose failure message
does not show what it expects is shown with the assertion lines the test change gives it.
"""

from __future__ import annotations

import ast
import builtins
import json
import keyword
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
MAX_ASSERTION_LINES = 8  # of a changed assertion shown for a test that exists before
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")
_STRING = re.compile(r"\"([^\"\\\n]{4,})\"|'([^'\\\n]{4,})'")
_COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "args", "kwargs", "return", "None", "True", "False"}
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


_DEFINED = re.compile(r"\b(?:def|class)\s+([A-Za-z_][A-Za-z0-9_]*)|\.([A-Za-z_][A-Za-z0-9_]{3,})")


def _code_like(name: str) -> bool:
    """A name that reads as code, not as a word: snake_case, mixedCase or with digits."""
    return "_" in name.strip("_") or any(c.isdigit() for c in name) or (name[1:] != name[1:].lower())


def _terms(lines: list[str]) -> set[str]:
    """Identifiers that are code-like or that a line defines (def/class) or reaches as an attribute,
    outside strings and comments; and the string literals themselves."""
    found: set[str] = set()
    for line in lines:
        found.update(a or b for a, b in _STRING.findall(line))
        code = _STRING.sub('""', line).split("#", 1)[0]
        found.update(n for n in _IDENT.findall(code) if _code_like(n))
        found.update(a or b for a, b in _DEFINED.findall(code) if len(a or b) >= 4)
    return found - _COMMON


def solution_terms(patch: bytes) -> set[str]:
    """The identifiers (4+ characters, not keywords or builtins) and string literals (4+
    characters) the patch introduces: in its added lines, not in its removed or context lines."""
    added, kept = [], []
    for line in patch.decode("utf-8", "replace").splitlines():
        if line.startswith(("+++", "---")):
            continue
        if line.startswith("+"):
            added.append(line[1:])
        elif line.startswith(("-", " ")):
            kept.append(line[1:])
    return _terms(added) - _terms(kept)


def _mentions(line: str, term: str) -> bool:
    if _IDENT.fullmatch(term):
        return re.search(rf"(?<![A-Za-z0-9_]){re.escape(term)}(?![A-Za-z0-9_])", line) is not None
    return term in line


def without_leaks(text: str, solution_patch: bytes, shown: str = "") -> str:
    """`text` less every line that contains a telling line of the solution patch, or a term it
    introduces (`solution_terms`) that `shown` (what the failing tests show: their names,
    failures, sources, changed assertions) does not hold."""
    leaks = added_lines(solution_patch)
    terms = [t for t in solution_terms(solution_patch) if not _mentions(shown, t)]
    kept = [
        line
        for line in text.splitlines()
        if not any(leak in line for leak in leaks) and not any(_mentions(line, t) for t in terms)
    ]
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


def changed_assertions(files: Path, node_id: str, test_patch: bytes) -> list[str]:
    """The lines of test `node_id` (its source after the test change) that the test change adds and
    that assert: what the test now expects."""
    code = test_source(files, node_id, imports_wanted=False)
    if not code:
        return []
    added = {line[1:].strip() for line in test_patch.decode("utf-8", "replace").splitlines() if line[:1] == "+"}
    asserting = re.compile(r"\bassert\b|raises|match=|\bexpected\b|==|!=")
    out = [ln.strip() for ln in code.splitlines() if ln.strip() in added and asserting.search(ln)]
    return out[:MAX_ASSERTION_LINES]


def _shows_expectation(message: str, assertions: list[str]) -> bool:
    """Whether a failure message already shows what the changed assertions expect: every literal
    of theirs appears in it."""
    literals = [a or b for line in assertions for a, b in _STRING.findall(line)]
    literals += [n for line in assertions for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", line)]
    return bool(literals) and all(lit in message for lit in literals)


def facts(
    commit: Commit,
    fail_to_pass: list[str],
    before: dict,
    repo: str,
    files: Path | None = None,
    test_patch: bytes = b"",
) -> dict:
    """What a statement may be written from: the message, how the FAIL_TO_PASS tests fail, for
    tests that do not exist yet their source (the behaviour expected, as a reproduction), and for
    tests that do but whose failure does not show what they expect, their changed assertions."""
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
            changed = changed_assertions(files, name, test_patch) if files is not None else []
            if changed and not _shows_expectation(seen.get("message", ""), changed):
                entry["asserts"] = "\n".join(changed)
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
        if t.get("asserts"):
            lines += ["", "  What it now checks:", "", "  ```python"]
            lines += [f"  {line}" for line in t["asserts"].splitlines()]
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
    f = facts(commit, task.fail_to_pass, before, task.repo, files, getattr(task, "test_patch", b""))
    shown = shown_by_tests(f)
    text = ""
    if writer is not None:
        try:
            text = without_leaks(writer(f), task.solution_patch, shown).strip()
        except (OSError, ValueError, KeyError) as exc:
            print(f"composer-jax env mine: the statement writer failed ({exc}); using the template")
            text = ""
    if not text:
        text = without_leaks(template_statement(f), task.solution_patch, shown).strip()
    return text


def shown_by_tests(f: dict) -> str:
    """What the failing tests show of themselves in `facts`: names, failures, sources, assertions."""
    parts = []
    for t in f["failing_tests"]:
        parts += [t["test"], t.get("now", ""), t.get("expected", ""), t.get("asserts", "")]
    return "\n".join(parts)


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
