"""The rollout side's half of supervision: a restarted replica back in rotation, a moved child
reached at its new URL.

The supervisor (runtime/local.py) restarts a local child that died or stopped answering
/health, on its port or, when that port was taken meanwhile, on another. The rollout side had taken
the replica out of its `PolicyPool` when a turn on it raised `SamplerUnavailable`. `ReplicaWatch`
runs beside the rollout queue (one asyncio task) and, every `interval_s`:

* **follows moves**: a sampler child whose URL changed is given to the backend (`follow`: the
  policy's base URL), an environment server's to the environment client (`EnvClient.move`);
* **rejoins**: for each policy out of rotation whose child the supervisor reports alive (replicas
  by URL, with no supervisor here: always tried), the backend checks that it answers /health and
  has it serve the current policy version (`SamplerBackend.rejoin`: a serve replica loads it from
  the weight store, a vLLM one is restarted on its export); if a newer version was handed over
  meanwhile the load is repeated, so a rejoined replica never samples an older version than the
  rest of the rotation. Then `PolicyPool.rejoin`, which wakes the rollouts waiting for a policy.
  A failed attempt leaves it out, its reason noted, and is tried again at a later check.

While no policy is in rotation, rollouts wait (`PolicyPool.wait_in_rotation`) at most
`rl.supervision.rejoin_timeout_s`; the error then names each replica out, why it went out and the
supervisor's last word on it (its state, its last failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from composer_jax.env.api.client import EnvClient
from composer_jax.rl.samplers.base import SamplerBackend
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable
from composer_jax.runtime.placement import ALIVE, ServiceStatus

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """What the watch reads of a supervisor (`runtime.local.Launcher`)."""

    def statuses(self) -> list[ServiceStatus]: ...


class ReplicaWatch:
    """Rejoins restarted replicas and follows moved children (module docstring).

    samplers: the supervisor of the backend's replicas (child i is `backend.policies[i]`), None for
    replicas by URL or the in-process sampler; env_servers with env_client: the local environment
    servers' supervisor (child i is the client's server i). version(): the policy version the
    rotation serves now."""

    def __init__(
        self,
        pool: PolicyPool,
        backend: SamplerBackend,
        version: Callable[[], int],
        *,
        samplers: Supervised | None = None,
        env_servers: Supervised | None = None,
        env_client: EnvClient | None = None,
        health_timeout_s: float = 5.0,
    ):
        self.pool, self.backend, self.version = pool, backend, version
        self.samplers, self.env_servers, self.env_client = samplers, env_servers, env_client
        self.health_timeout_s = health_timeout_s
        self._sampler_urls = [s.url for s in samplers.statuses()] if samplers is not None else []
        self._env_urls = [s.url for s in env_servers.statuses()] if env_servers is not None else []
        self._attempts: dict[int, asyncio.Future] = {}  # policy index -> its rejoin attempt in flight
        self.moves = 0  # children followed to a new URL

    async def check(self) -> None:
        """One look: moves followed, a rejoin attempt started for each policy out whose child is up."""
        sampler_states = self.samplers.statuses() if self.samplers is not None else []
        self._follow_samplers(sampler_states)
        self._follow_env_servers()
        for policy, _why in list(self.pool.out):
            i = next((k for k, p in enumerate(self.backend.policies) if p is policy), None)
            if i is None or (i in self._attempts and not self._attempts[i].done()):
                continue
            if i < len(sampler_states):
                st = sampler_states[i]
                self.pool.note(policy, f"supervisor: {st.state}; last failure: {st.last_failure or 'none'}")
                if st.state != ALIVE:
                    continue
            self._attempts[i] = asyncio.ensure_future(self._rejoin(policy))

    async def _rejoin(self, policy) -> None:
        while True:
            version = self.version()
            try:
                await self.backend.rejoin(policy, version, self.health_timeout_s)
            except SamplerUnavailable as exc:
                self.pool.note(policy, f"rejoin failed: {exc}")
                return
            if self.version() == version:  # else a newer version came meanwhile: load that first
                break
        self.pool.rejoin(policy)
        log.warning("sampler %r rejoined on policy version %d", policy, version)

    def _follow_samplers(self, states: list[ServiceStatus]) -> None:
        for i, st in enumerate(states):
            if st.url and i < len(self._sampler_urls) and st.url != self._sampler_urls[i]:
                log.warning("%s moved from %s to %s", st.name, self._sampler_urls[i], st.url)
                self.backend.follow(i, st.url)
                self._sampler_urls[i] = st.url
                self.moves += 1

    def _follow_env_servers(self) -> None:
        if self.env_servers is None or self.env_client is None:
            return
        for i, st in enumerate(self.env_servers.statuses()):
            old = self._env_urls[i] if i < len(self._env_urls) else None
            if st.url and old and st.url != old:
                if self.env_client.move(old, st.url):
                    log.warning("%s moved from %s to %s", st.name, old, st.url)
                    self.moves += 1
                self._env_urls[i] = st.url

    async def run(self, interval_s: float = 0.5) -> None:
        """`check` every `interval_s` seconds until cancelled (a failing check is logged, not fatal)."""
        try:
            while True:
                try:
                    await self.check()
                except Exception:
                    log.exception("watching the samplers failed")
                await asyncio.sleep(interval_s)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Rejoin attempts in flight cancelled."""
        for f in self._attempts.values():
            f.cancel()
        for f in self._attempts.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await f
        self._attempts.clear()
