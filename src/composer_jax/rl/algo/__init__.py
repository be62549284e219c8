"""The RL algorithm as pure pieces: rewards (length penalty, auxiliary terms), group-relative
advantages, the padded batch, and the Dr. GRPO objective with its k1 KL and router replay."""
