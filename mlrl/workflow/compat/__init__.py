"""Adapters that run workflows written for other RL systems unchanged except for their imports:
`mlrl.workflow.compat.trinity` (Trinity-RFT) and `mlrl.workflow.compat.rllm` (rLLM)."""
