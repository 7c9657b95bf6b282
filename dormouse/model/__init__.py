"""The byte-level language model: KDA mixer, SwiGLU / MoE FFN, loop, Engram memory."""
