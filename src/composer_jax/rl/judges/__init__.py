"""Behaviour terms of the reward judged by a model (`rl.reward.judges`; docs/rl.md, *Judged
behaviour terms*): the shipped rubrics, what a judge reads of a rollout and the rule-based check
(`rubrics.py`), and the panel that asks OpenAI-compatible endpoints for verdicts, batched,
concurrent, cached and bounded in time (`panel.py`)."""
