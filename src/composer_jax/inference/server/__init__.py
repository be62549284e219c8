"""The serving side of inference: what turns the engine into `composer-jax serve` and `sample`.

openai_api.py   the OpenAI API's request checks and response shapes (pure functions)
app.py          `OpenAIServer`: the Starlette app over a thread engine (auth, streaming, admin)
metrics.py      the Prometheus metrics of one server (`GET /metrics`)
policy.py       `load_policy`: a checkpoint directory's config, weights and tokenizer hint
cli.py          `composer-jax serve` and `composer-jax sample`
"""
