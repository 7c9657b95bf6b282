"""Tools over finished artifacts: views, history, plots, headline, verify, the SLURM status probe and the lm-eval adapter."""
