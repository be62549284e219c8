"""`--index-proxy-allow ADDRESS:PORT` (env mine, env build, env-server, env validate, import-swebench):
a machine whose way out to the index is a proxy at a reserved address builds its environments,
and only the index's hosts are let through there."""

from __future__ import annotations

import argparse
import asyncio

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
    )  # fmt: skip
    cache = make_env_cache(args, sandbox=None)
    assert cache.proxy_allow == (("203.0.113.80", 443), ("2001:db8::1", 8443))
    # pypi.org resolving to the reserved address (203.0.113.0/24 is TEST-NET-3): refused without the flag
    hosts = index_proxy.index_hosts([cache.index_url])
    plain = index_proxy.IndexProxy(hosts, resolve=lambda h, p: ["203.0.113.80"])
    with pytest.raises(index_proxy.ProxyRefused, match="not a public address"):
        asyncio.run(plain.check("pypi.org", 443))
    allowed = index_proxy.IndexProxy(hosts, resolve=lambda h, p: ["203.0.113.80"], allow=cache.proxy_allow)
    assert asyncio.run(allowed.check("files.pythonhosted.org", 443)) == "203.0.113.80"
    with pytest.raises(index_proxy.ProxyRefused, match="is not the package index"):
        asyncio.run(allowed.check("example.org", 443))  # the address is allowed, not any host behind it
    assert make_env_cache(_args("--env-cache", str(tmp_path)), sandbox=None).proxy_allow == ()


@pytest.mark.parametrize("bad", ["pypi.org:443", "203.0.113.80", "203.0.113.80:0", "203.0.113.80:https"])
def test_a_bad_address_is_named(tmp_path, bad):
    with pytest.raises(UsageError, match=rf"--index-proxy-allow '{bad}': expected ADDRESS:PORT"):
        make_env_cache(_args("--env-cache", str(tmp_path), "--index-proxy-allow", bad), sandbox=None)
