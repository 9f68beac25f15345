"""A store that times its commits, for the metrics (phalanx_store_commit_seconds)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from controller.obs.stats import LAG_BUCKETS_S, Buckets
from controller.store.base import Committed, CredentialRecord, EventRecord, JobRecord, NodeRecord, Store


class TimedStore:
    """Delegates everything to `store`; records how long each commit took (successful or not)."""

    def __init__(self, store: Store, kind: str) -> None:
        self.inner = store
        self.kind = kind  # "sqlite" or "etcd", the metric's label
        self.commit_seconds = Buckets(LAG_BUCKETS_S)

    async def commit(self, *, nodes: Sequence[NodeRecord] = (), events: Sequence[EventRecord] = (),
                     jobs: Sequence[JobRecord] = (), credentials: Sequence[CredentialRecord] = ()) -> Committed:
        t0 = time.perf_counter()
        try:
            return await self.inner.commit(nodes=nodes, events=events, jobs=jobs, credentials=credentials)
        finally:
            self.commit_seconds.observe(time.perf_counter() - t0)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
