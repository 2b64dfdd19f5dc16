"""mlrl: reinforcement-learning post-training of LLMs with a Megatron-Core trainer and vLLM engines."""

from mlrl import import_cache as _import_cache

__version__ = "0.1.0"

# every mlrl process (launcher, vLLM server, trainer rank, tool) imports this package before
# transformers: its import then reads two scans from a cache (see mlrl/import_cache.py)
_import_cache.install()
