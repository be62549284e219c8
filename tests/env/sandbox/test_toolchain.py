"""The verifier toolchain (env/sandbox/toolchain.py): a virtualenv of pytest (and pip, setuptools
where the server has them) and exactly what they require, built once per key, read-only, naming no
host path, whose interpreter imports pytest and not the server's own packages."""

from __future__ import annotations

import os
import subprocess

import pytest

from composer_jax.env.sandbox import toolchain


def _names(dists) -> set[str]:
    return {toolchain._norm(d.metadata["Name"]) for d in dists}


def test_distributions_are_pytest_and_its_requirements():
    names = _names(toolchain.distributions())
    assert {"pytest", "pluggy", "iniconfig", "packaging"} <= names
    assert not names & {"jax", "fastapi", "composer-jax", "numpy"}


def test_a_missing_root_is_named():
    with pytest.raises(toolchain.ToolchainError, match="needs 'no-such-dist-cj'"):
        toolchain.distributions(("pytest", "no_such_dist_cj"))


def test_built_once_read_only_and_names_no_host_path(tmp_path):
    root = tmp_path / "tc"
    first = toolchain.toolchain(root)
    assert toolchain.toolchain(root) == first and len(list(root.iterdir())) == 1  # reused, no leftovers
    assert oct((first / "bin").stat().st_mode & 0o777) == "0o555"
    for dirpath, _, files in os.walk(first):
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                with open(p, "rb") as f:
                    assert str(tmp_path).encode() not in f.read(), p
    site = toolchain.site_packages(first)
    py = first / "bin" / "python3"
    out = subprocess.run(
        [str(py), "-I", "-c", "import sys, pytest; print(sys.prefix, pytest.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == str(first) and out[1].startswith(site)
    blocked = subprocess.run([str(py), "-I", "-c", "import fastapi"], capture_output=True, text=True)
    assert blocked.returncode != 0 and "No module named 'fastapi'" in blocked.stderr
    script = (first / "bin" / "pytest").read_text()
    assert script.startswith(f"#!{toolchain.TOOLCHAIN_MOUNT}/bin/python3\n")


def test_the_key_follows_the_distributions():
    dists = toolchain.distributions()
    assert toolchain.toolchain_key(dists) == toolchain.toolchain_key(list(dists))
    assert toolchain.toolchain_key(dists[:-1]) != toolchain.toolchain_key(dists)
