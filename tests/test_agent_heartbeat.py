"""The agent's heartbeat survives a collector that fails: the node stays alive, the failure is told once."""

from __future__ import annotations

from agent import config as agent_config
from agent.collectors.sim import SimBackend
from agent.main import Agent


class FlakyBackend(SimBackend):
    def __init__(self) -> None:
        super().__init__(2, "node-f", seed=1)
        self.fail: Exception | None = None

    def sample(self):
        if self.fail is not None:
            raise self.fail
        return super().sample()


def test_a_failing_gpu_collector_sends_its_last_reading_and_says_so_once(tmp_path):
    cfg = agent_config.AgentConfig(node_name="node-f", state_dir=str(tmp_path / "state"),
                                   checkpoint_dir=str(tmp_path), nvrx_socket="")
    backend = FlakyBackend()
    agent = Agent(cfg, backend)
    events = []
    agent.link.emit = lambda kind, message, **fields: events.append((kind, message, fields))
    good = agent.heartbeat()
    assert len(good.gpus) == 2 and not events
    backend.fail = OverflowError("int too large to convert")
    for _ in range(3):
        beat = agent.heartbeat()
        assert list(beat.gpus) == list(good.gpus) and beat.host.ByteSize() > 0
    assert events == [("collector_failed", "the gpu collector on node-f failed: OverflowError: int too large to "
                       "convert", {"collector": "gpu"})]
    backend.fail = ValueError("another")
    agent.heartbeat()
    assert events[-1][0] == "collector_failed" and "ValueError: another" in events[-1][1]
    backend.fail = None
    assert len(agent.heartbeat().gpus) == 2
    assert events[-1] == ("collector_recovered", "the gpu collector on node-f works again", {"collector": "gpu"})
    assert len(events) == 3
