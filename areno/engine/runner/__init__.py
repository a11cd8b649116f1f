"""One model runner: a step's forwards (prefill planning, chunks, CUDA graphs), encoder cache."""
