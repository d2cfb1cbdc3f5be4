"""Stage trainers: each orchestrates; the math lives in rlhfkit.losses and rlhfkit.advantages."""
