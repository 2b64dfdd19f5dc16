"""Typed configuration: `load_config` (YAML + overrides), `validate` (cross-field rules)."""

from mlrl.config.loader import ConfigError, config_from_yaml, dump_yaml, load_config
from mlrl.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    CriticConfig,
    DataConfig,
    DynamicSamplingConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    WeightSyncConfig,
    WorkflowConfig,
)
from mlrl.config.validate import Layout, resolve_layout, validate

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DynamicSamplingConfig", "EvalConfig", "Layout",
    "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "RolloutConfig", "SamplingConfig",
    "TrainerConfig", "WeightSyncConfig", "WorkflowConfig", "config_from_yaml", "dump_yaml", "load_config",
    "resolve_layout", "validate",
]
