"""After pretraining: the verifiable tasks and their splits (`tasks`), held-out and dev evaluation (`task_eval`), SFT
batches (`chat_batches`), decoding and the static decode step (`decode`, `rowrng`, `rowrng_triton`), multiple-choice
scoring (`mc`), GRPO (`grpo`), rl's checkpoint selection (`selection`) and their settings (`settings`)."""
