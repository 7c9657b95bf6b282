"""After pretraining: verifiable tasks and their evaluation, the chat template, decoding, multiple-choice scoring, quantized export rungs and the lm-eval adapter."""
