"""Bazel's py_test main for the pytest-style test files: `bazel test //:tests_config_test_config`
runs `pytest <file>` in the test's runfiles tree (where tests/conftest.py, pyproject.toml, configs/ and
tasks/ are), with Bazel's test conventions: JUnit XML to $XML_OUTPUT_FILE, --test_filter as `-k`,
scratch files under $TEST_TMPDIR. Extra arguments (`--test_arg=-x`) go to pytest.
"""

import os
import sys


def main(argv: list[str]) -> int:
    try:
        import pytest
    except ImportError:
        print(
            f"bazel_pytest: pytest is not importable by {sys.executable}; run `make venv` (or set "
            "COMPOSER_JAX_PYTHON) and `bazel sync --configure`",
            file=sys.stderr,
        )
        return 2
    import importlib.util

    spec = importlib.util.find_spec("composer_jax")  # where it imports from, without importing it
    print(f"bazel_pytest: {sys.executable}; composer_jax from {spec.origin if spec else None}", file=sys.stderr)
    # The runfiles root of this workspace: the directory above tools/.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(root)
    args = ["-p", "no:cacheprovider", "--rootdir", root, "-c", os.path.join(root, "pyproject.toml")]
    if os.environ.get("XML_OUTPUT_FILE"):
        args += ["--junitxml", os.environ["XML_OUTPUT_FILE"]]
    if os.environ.get("TESTBRIDGE_TEST_ONLY"):
        args += ["-k", os.environ["TESTBRIDGE_TEST_ONLY"]]
    if os.environ.get("TEST_TMPDIR"):
        args += ["--basetemp", os.path.join(os.environ["TEST_TMPDIR"], "pytest")]
    return pytest.main(args + argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
