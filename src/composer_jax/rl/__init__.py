"""Reinforcement learning: the agent loop, rewards, the RL objective and the learner."""
