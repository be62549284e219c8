import pytest

from unitconv import convert


def test_km_to_m():
    assert convert(1.5, "km", "m") == pytest.approx(1500)
