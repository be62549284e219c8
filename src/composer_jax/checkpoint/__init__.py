"""Checkpoints: orbax save/restore of the train state (manager.py) and Hugging Face import/export."""
