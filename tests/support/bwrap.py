"""Whether the sandbox tests can run here: bubblewrap (`bwrap`, the environment server's sandbox)
installed, and what a test that needs it does when it is not.

Where nothing could install it, such a test is skipped. Where `make system-deps` would install it
(root with apt-get: a CI image or a fresh box that left that step out) it fails, saying so: a skip
there would pass a run green with every sandbox test unrun. `needs_bwrap` marks a test, a class or
a module (`pytestmark`); it asks for tests/conftest.py's session fixture `bwrap_required`, which
comes before the module fixtures that start servers. `require_bwrap()` is the same check inline."""

from __future__ import annotations

import os
import shutil
from typing import Literal

import pytest

HAVE_BWRAP = shutil.which("bwrap") is not None
MISSING = "bubblewrap (bwrap) is not installed"

needs_bwrap = pytest.mark.usefixtures("bwrap_required")


def missing_bwrap_outcome(*, have_bwrap: bool, root: bool, apt_get: bool) -> Literal["run", "skip", "fail"]:
    """What a test that needs bubblewrap does: run when it is there; fail when `make system-deps`
    could install it (root, with apt-get); else skip."""
    if have_bwrap:
        return "run"
    return "fail" if root and apt_get else "skip"


def require_bwrap(why: str = MISSING) -> None:
    """Return when bubblewrap is installed; else skip the calling test, or fail it where `make
    system-deps` would install bubblewrap (`missing_bwrap_outcome` on this machine)."""
    outcome = missing_bwrap_outcome(
        have_bwrap=HAVE_BWRAP, root=os.geteuid() == 0, apt_get=shutil.which("apt-get") is not None
    )
    if outcome == "fail":
        pytest.fail(
            f"{why}, and this machine can install it (root with apt-get): run `make system-deps`", pytrace=False
        )
    if outcome == "skip":
        pytest.skip(f"{why}; `make system-deps` installs it (as root, with apt-get)")
