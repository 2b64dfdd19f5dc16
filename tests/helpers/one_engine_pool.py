"""`OneEnginePool`: the slice of `mlrl.rollout.pool.EnginePool` that weight sync drives (live
engines, pause / resume, commit_version), with one engine around a test's fake control client.
Unit tests of the sync orchestration and of adapter sync share it; `events` records pause,
resume and ("commit", version) in order."""

from __future__ import annotations

from typing import Any


class OneEngine:
    def __init__(self, client: Any):
        self.client, self.name, self.index, self.incarnation = client, "engine-0", 0, 1


class OneEnginePool:
    def __init__(self, client: Any):
        self.engines = [OneEngine(client)]
        self.version, self.paused, self.events = 0, False, []
        self.refresher = None

    def live_engines(self):
        return self.engines

    async def pause(self, mode=None):
        self.paused = True
        self.events.append("pause")

    async def resume(self):
        self.paused = False
        self.events.append("resume")

    def commit_version(self, version, engines, *, pushed=True, incarnations=None):
        self.version = version
        self.events.append(("commit", version))
