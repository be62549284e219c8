"""The rollout side of the learner: the agent loop against an environment session, the queue of
groups with its staleness bound, the on-disk group store, the ledger of group ids, and the local
environment servers a run starts."""
