"""mlrl: reinforcement-learning post-training of LLMs with a Megatron-Core trainer and vLLM engines."""

__version__ = "0.1.0"
