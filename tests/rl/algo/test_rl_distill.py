"""On-policy distillation (`rl.loss.objective: distill`, rl/algo/distill.py): the per-token advantage
against numpy worked by hand, the batch carrying it, the teacher client against a stub endpoint
that answers vLLM's prompt_logprobs from a fixed distribution (its refusals included: another
tokenizer's ids, an endpoint without prompt_logprobs), and a tiny student whose KL to that teacher
falls over a few train steps."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support.serve_thread import app_in_thread, stop_app

import composer_jax as cj
from composer_jax.config import ConfigError
from composer_jax.config.rl import DistillConfig
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.algo.advantages import distill_advantages
from composer_jax.rl.algo.batch import GenerationRecord, ScoredRollout, build_batch
from composer_jax.rl.algo.distill import Teacher, TeacherError
from composer_jax.rl.algo.loss import rl_objective
from composer_jax.sharding import ShardingRules
from composer_jax.train.state import init_train_state
from composer_jax.train.step import make_train_step

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "model" / "tiny.yaml"
TOKENIZER = ROOT / "assets" / "tokenizer"
VOCAB = 512
# the teacher: the same distribution at every position, tokens 1..64 favoured (logit 4, the rest 0:
# 89% of its mass on an eighth of the vocabulary)
TEACHER_LOGP = np.asarray(jax.nn.log_softmax(jnp.where((jnp.arange(VOCAB) >= 1) & (jnp.arange(VOCAB) <= 64), 4.0, 0.0)))


def test_distill_advantages_by_hand():
    # tokens 0..3, policy tokens 1 and 3. A_task = 0.5, task_weight 0.2, weight 2:
    #   token 1: 0.2 * 0.5 + 2 * (-1.0 - -3.0) = 0.1 + 4 = 4.1
    #   token 3: 0.1 + 2 * (-2.5 - -0.5) = 0.1 - 4 = -3.9
    #   tokens 0, 2 (no loss): 0.1, whatever the log-probabilities say there (even inf)
    teacher = np.asarray([0.0, -1.0, -np.inf, -2.5])
    student = np.asarray([0.0, -3.0, -1.0, -0.5])
    got = distill_advantages(0.5, teacher, student, np.asarray([0, 1, 0, 1]), weight=2.0, task_weight=0.2)
    np.testing.assert_allclose(got, [0.1, 4.1, 0.1, -3.9], rtol=1e-12)
    with pytest.raises(ValueError, match="non-finite"):
        distill_advantages(0.0, teacher, student, np.ones(4), weight=1.0, task_weight=0.0)
    with pytest.raises(ValueError, match="give one log-probability per token"):
        distill_advantages(0.0, teacher[:3], student, np.ones(4), weight=1.0, task_weight=0.0)


def _cfg(url: str = "http://127.0.0.1:1/v1", *extra: str) -> cj.Config:
    return cj.load_config(
        TINY,
        [
            "model.num_mtp_layers=0",
            "model.num_layers=2",
            "train.batch_size=8",
            "train.seq_len=16",
            "rl.loss.objective=distill",
            f"rl.distill.teacher_url={url}",
            "rl.distill.model=teacher",
            *extra,
        ],
        num_devices=8,
    )


def test_build_batch_puts_the_mix_on_each_token():
    # two rollouts of one group, rewards 1 and 0 (Dr. GRPO: A = +-0.5); task_weight 1, weight 0.5
    cfg = _cfg(
        "http://127.0.0.1:1/v1", "rl.distill.task_weight=1", "rl.distill.weight=0.5", "rl.loss.router_replay=false"
    )
    gens = [
        GenerationRecord([1, 5, 6, 7], [0, 1, 1, 0], [0.0, -1.0, -2.0, 0.0], teacher_logprobs=[0.0, -3.0, -1.0, -9.0]),
        GenerationRecord([1, 5, 6], [0, 1, 1], [0.0, -0.5, -0.5], teacher_logprobs=[0.0, -0.5, -1.5]),
    ]
    batch = build_batch([ScoredRollout(0, 1.0, [gens[0]]), ScoredRollout(0, 0.0, [gens[1]])], cfg)
    # row 0: 0.5 + 0.5 * (-3 + 1) = -0.5, 0.5 + 0.5 * (-1 + 2) = 1.0; off the policy tokens 0.5
    np.testing.assert_allclose(batch["advantages"][0, :4], [0.5, -0.5, 1.0, 0.5])
    np.testing.assert_allclose(batch["advantages"][1, :3], [-0.5, -0.5, -1.0])
    with pytest.raises(ValueError, match="rl.loss.objective=distill needs the teacher's log-probability"):
        build_batch([ScoredRollout(0, 1.0, [GenerationRecord([1, 5], [0, 1], [0.0, -1.0])])], cfg)


def test_distill_config_checks():
    with pytest.raises(ConfigError, match="rl.loss.objective='distill' needs a teacher: rl.distill.teacher_url"):
        cj.load_config(TINY, ["rl.loss.objective=distill"], num_devices=None)
    with pytest.raises(ConfigError, match="rl.distill.teacher_url='teacher:8000': expected an http"):
        DistillConfig(teacher_url="teacher:8000")
    with pytest.raises(ConfigError, match="rl.loss.objective='kd' is not accepted; accepted: one of 'policy_gradient'"):
        cj.load_config(TINY, ["rl.loss.objective=kd"], num_devices=None)
    with pytest.raises(ConfigError, match="every advantage would be 0"):
        _cfg("http://t/v1", "rl.distill.weight=0")
    with pytest.raises(TeacherError, match="rl.distill.api_key_env='NO_SUCH_TEACHER_KEY_VAR'"):
        Teacher(DistillConfig(teacher_url="http://t/v1", model="m", api_key_env="NO_SUCH_TEACHER_KEY_VAR"))


class StubTeacher:
    """/v1/completions answering vLLM's prompt_logprobs from TEACHER_LOGP (context-free), or, with
    `plain`, without them (an endpoint that does not support the field)."""

    def __init__(self, plain: bool = False):
        self.plain = plain
        self.requests: list[dict] = []
        self.app = Starlette(
            routes=[
                Route("/health", lambda r: JSONResponse({})),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    async def completions(self, request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        self.requests.append(body)
        ids = body["prompt"]
        rows = [None] + [
            {str(t): {"logprob": float(TEACHER_LOGP[t]), "rank": 1, "decoded_token": "x"}} for t in ids[1:]
        ]
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        if not self.plain:
            choice["prompt_logprobs"] = rows
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": "teacher", "choices": [choice]})


@pytest.fixture(scope="module")
def teacher_url():
    stub = StubTeacher()
    url, http, thread = app_in_thread(stub.app)
    yield url + "/v1", stub
    stop_app(http, thread)


def test_teacher_scores_every_generation(teacher_url, tmp_path):
    url, stub = teacher_url
    teacher = Teacher(DistillConfig(teacher_url=url, model="teacher", concurrency=2))
    rollouts = [
        ScoredRollout(0, 1.0, [GenerationRecord([1, 3, 9], [0, 1, 1], [0.0, -1.0, -2.0])]),
        ScoredRollout(0, 0.0, [GenerationRecord([1, 2], [0, 1], [0.0, -1.0]), GenerationRecord([4], [0], [0.0])]),
    ]
    scored = teacher.score(rollouts)
    got = [list(g.teacher_logprobs) for r in scored for g in r.generations]
    assert got == [[0.0, TEACHER_LOGP[3], TEACHER_LOGP[9]], [0.0, TEACHER_LOGP[2]], [0.0]]
    assert [r.reward for r in scored] == [1.0, 0.0] and scored[1].generations[0].tokens == [1, 2]
    sent = sorted(stub.requests, key=lambda b: b["prompt"])[-1]
    assert sent == {"model": "teacher", "prompt": [4], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    teacher.close()


def test_teacher_refuses_what_it_cannot_score(tmp_path):
    plain = StubTeacher(plain=True)
    url, http, thread = app_in_thread(plain.app)
    try:
        teacher = Teacher(DistillConfig(teacher_url=url + "/v1", model="teacher"))
        with pytest.raises(TeacherError, match="no choices\\[0\\].prompt_logprobs; the endpoint must support vLLM's"):
            teacher.logprobs([1, 2, 3])
    finally:
        stop_app(http, thread)
    # a teacher tokenizer with the student's vocabulary but no merges: "hello" is 5 byte tokens there,
    # fewer here, so the ids differ and the generation is refused; the same tokenizer is accepted
    student = load_tokenizer(TOKENIZER)
    data = json.loads((TOKENIZER / "tokenizer.json").read_text())
    data["model"]["merges"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ids = [student.bos_id, *student.encode("hello world")]
    assert len(ids) < 1 + len("hello world")
    other = Teacher(DistillConfig(teacher_url="http://t/v1", model="m", tokenizer=str(tmp_path)), student)
    with pytest.raises(TeacherError, match="re-tokenises the student's text into other ids: at token 1"):
        other.logprobs(ids, "rollout 0 generation 0")
    same = Teacher(DistillConfig(teacher_url="http://127.0.0.1:1/v1", model="m", tokenizer=str(TOKENIZER)), student)
    with pytest.raises(TeacherError, match="did not answer"):  # past the tokenizer check, to the (absent) endpoint
        same.logprobs(ids)


@pytest.mark.slow
def test_student_kl_to_the_teacher_falls(teacher_url):
    """8 rows of 16 tokens sampled from the tiny student (token 0 fixed, then its own samples), scored
    by the stub teacher, trained with the distill objective (weight 1, no task reward) for 12 steps:
    the exact KL(student || teacher) of the student's next-token distributions at the sampled
    positions falls (about 25 s on 2 cores: slow; the default tests test_distill_advantages_by_hand,
    test_build_batch_puts_the_mix_on_each_token and test_teacher_scores_every_generation keep the
    advantage the gradient follows)."""
    url, _ = teacher_url
    cfg = _cfg(
        url,
        "train.optimizer.lr=3e-3",
        "train.optimizer.schedule=constant",
        "train.optimizer.warmup_steps=0",
        "train.optimizer.weight_decay=0",
        "rl.loss.router_replay=false",
        "train.z_loss=0",
    )
    b, s = cfg.train.batch_size, cfg.train.seq_len
    mesh = cj.make_mesh(cj.MeshConfig(data=8, fsdp=1, expert=1, context=1, tensor=1))
    rules = ShardingRules.create()
    state = init_train_state(cfg, mesh, rules)
    step = make_train_step(cfg, mesh, rules, objective=rl_objective(cfg), donate=False)
    teacher = Teacher(cfg.rl.distill)

    @jax.jit
    def logprobs(params, tokens):
        logits = cj.forward(params, tokens, cfg.model, segment_ids=jnp.ones_like(tokens)).logits
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    def sample(params, key):
        tokens = jnp.zeros((b, s), jnp.int32).at[:, 0].set(1)
        for i in range(1, s):  # causal: position i - 1's distribution is final once tokens < i are
            key, sub = jax.random.split(key)
            lp = logprobs(params, tokens)
            tokens = tokens.at[:, i].set(jax.random.categorical(sub, lp[:, i - 1]))
        lp = np.asarray(logprobs(params, tokens))
        tokens = np.asarray(tokens)
        chosen = np.concatenate([np.zeros((b, 1)), np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]], 1)
        kl = float(np.mean(np.sum(np.exp(lp[:, :-1]) * (lp[:, :-1] - TEACHER_LOGP), axis=-1)))
        return tokens, chosen, kl

    kls = []
    key = jax.random.key(0)
    for _ in range(12):
        key, sub = jax.random.split(key)
        tokens, chosen, kl = sample(state.params, sub)
        kls.append(kl)
        mask = np.ones(s)
        mask[0] = 0
        rollouts = [ScoredRollout(r // 2, 0.0, [GenerationRecord(tokens[r], mask, chosen[r])]) for r in range(b)]
        batch = build_batch(teacher.score(rollouts), cfg)
        with jax.set_mesh(mesh):
            state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0
    teacher.close()
    # measured: 1.555, 1.551, 1.539, 1.529, 1.516, 1.495, 1.478, 1.434, 1.394, 1.35, 1.297, 1.247
    # (each an estimate over 120 positions: a trend, asserted by thirds, with the end well below the start)
    thirds = [float(np.mean(kls[i : i + 4])) for i in (0, 4, 8)]
    assert thirds[0] > thirds[1] > thirds[2] and kls[-1] < 0.9 * kls[0], kls
