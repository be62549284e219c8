"""`composer-jax demo` runs end to end on the fake mesh and its loss falls."""

import re

from composer_jax.demo import main


def test_demo_runs_and_learns(capsys):
    assert main(["--quick", "--steps", "16", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "parameters  total 250K" in out and "memory per device" in out
    nll = [float(x) for x in re.findall(r"next-token nll ([0-9.]+)", out)]
    assert len(nll) >= 3 and nll[-1] < nll[0] - 1.0, nll


def test_demo_bad_override_is_clear(capsys):
    assert main(["--quick", "mesh.expert=3"]) == 2
    err = capsys.readouterr().err
    assert "mesh" in err and "8 devices" in err
