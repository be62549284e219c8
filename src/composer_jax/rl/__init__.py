"""Reinforcement learning: rewards (`rewards.py`), group-relative advantages (`advantages.py`),
the rollouts-to-batch step (`batch.py`) and the policy-gradient objective (`loss.py`) that the
train step optimises; the agent loop and the learner build on them."""
