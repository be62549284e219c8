"""`--index-proxy-allow HOST:PORT` (env mine, env build, env-server, env validate, import-swebench):
a host builds may reach besides the package sources of pip's configuration (an index whose pages
link files on another host), pinned at its address like them; a bad value is named."""

from __future__ import annotations

import argparse
import re

import pytest

from composer_jax.env.sandbox import index_proxy
from composer_jax.env.sandbox.factory import add_env_cache_flags, make_env_cache
from composer_jax.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_env_cache_flags(p)
    return p.parse_args(list(argv))


def test_the_flag_reaches_the_cache_and_the_proxy(tmp_path):
    args = _args(
        "--env-cache", str(tmp_path), "--index-url", "https://pypi.org/simple",
        "--index-proxy-allow", "203.0.113.80:443", "--index-proxy-allow", "[2001:db8::1]:8443",
        "--index-proxy-allow", "Files.Example.com:443",
    )  # fmt: skip
    cache = make_env_cache(args, sandbox=None)
    assert cache.proxy_allow == (("203.0.113.80", 443), ("2001:db8::1", 8443), ("files.example.com", 443))
    pins = index_proxy.pin(cache.proxy_allow, resolve=lambda h, p: ["10.0.0.7"])
    proxy = index_proxy.IndexProxy(pins)
    assert proxy.check("files.example.com", 443) == ("10.0.0.7",)
    with pytest.raises(index_proxy.ProxyRefused, match="is not a package source"):
        proxy.check("files.example.com", 80)  # the host at its port, not any port
    assert make_env_cache(_args("--env-cache", str(tmp_path)), sandbox=None).proxy_allow == ()


@pytest.mark.parametrize(
    "bad", ["pypi.org", "203.0.113.80", "203.0.113.80:0", "pypi.org:https", "a b:443", "[pypi.org]:443"]
)
def test_a_bad_value_is_named(tmp_path, bad):
    with pytest.raises(UsageError, match=re.escape(f"--index-proxy-allow '{bad}': expected HOST:PORT")):
        make_env_cache(_args("--env-cache", str(tmp_path), "--index-proxy-allow", bad), sandbox=None)
