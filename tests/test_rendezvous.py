"""torchrun's rendezvous rounds in the controller, under a fake clock (no sleeps, no sockets)."""

import asyncio

import pytest

from controller import access
from controller.api.rendezvous_service import RendezvousService
from controller.config import RecoveryConfig
from controller.errors import FailedPrecondition, NotFound
from controller.nodes.health import Health
from controller.recovery.detectors import NodeView
from controller.rendezvous.book import (
    CLOSED_RUN_TTL_S,
    IDLE_RUN_TTL_S,
    LEASE_S,
    READMIT_AFTER_S,
    RELEARN_GRACE_S,
    SWEEP_EVERY_S,
    Drop,
    Form,
    Member,
    Outcome,
    RendezvousBook,
    Settings,
    StaleParticipant,
    StoreAddress,
    Worker,
    decide,
)
from controller.store.memory import MemoryStore
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, rendezvous_pb2

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

RUN = "job"
TWO = Settings(min_nodes=2, max_nodes=2, last_call_s=2.0)


class Nodes:
    """A book and a fake clock, with one-line helpers for participants A, B, C..."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.changed: list[str] = []
        self.book = RendezvousBook(on_change=self.changed.append)
        self.attempts: dict[str, int] = {}

    def join(self, pid, settings=TWO, timeout=600.0, run=RUN, retry=False):
        """A new join (torchrun's next_rendezvous), or with `retry` the same Join sent again."""
        self.attempts[pid] = self.attempts.get(pid, 0) + (0 if retry else 1)
        return self.book.join(run, pid, self.attempts[pid], settings, timeout, store(pid), self.clock.monotonic())

    def poll(self, pid, number, run=RUN):
        return self.book.poll(run, pid, number, self.clock.monotonic())

    def waiting(self, pid, number, run=RUN):
        return self.book.num_waiting(run, pid, number, self.clock.monotonic())

    def form(self, *pids, settings=TWO):
        """Join everyone and return {pid: rank} of the round they form."""
        replies = [self.join(pid, settings) for pid in pids]
        self.clock.advance(settings.last_call_s)
        replies = [self.poll(pid, r.round) for pid, r in zip(pids, replies, strict=True)]
        assert {r.outcome for r in replies} == {Outcome.FORMED}, replies
        return {pid: r.rank for pid, r in zip(pids, replies, strict=True)}


def store(pid):
    return StoreAddress(f"host-{pid}", 29000 + ord(pid[0]))


@pytest.fixture
def n():
    return Nodes()


def test_round_forms_when_max_nodes_join_and_hands_out_rank_0s_store(n):
    first = n.join("A")
    assert (first.outcome, first.round, first.joined) == (Outcome.WAITING, 1, 1)
    second = n.join("B")
    assert (second.outcome, second.rank, second.world_size, second.store) == (Outcome.FORMED, 1, 2, store("A"))
    mine = n.poll("A", 1)
    assert (mine.outcome, mine.rank, mine.world_size, mine.store) == (Outcome.FORMED, 0, 2, store("A"))


def test_with_min_nodes_the_round_waits_out_the_last_call():
    n = Nodes()
    elastic = Settings(min_nodes=2, max_nodes=3, last_call_s=2.0)
    n.join("A", elastic)
    n.clock.advance(5)  # alone: no quorum, no last call running
    assert n.join("B", elastic).outcome is Outcome.WAITING
    n.clock.advance(1.9)
    assert n.poll("A", 1).outcome is Outcome.WAITING
    n.clock.advance(0.1)
    assert (n.poll("B", 1).outcome, n.poll("B", 1).world_size) == (Outcome.FORMED, 2)
    late = n.join("C", elastic)
    assert (late.outcome, late.round) == (Outcome.WAITING, 2)


def test_a_join_within_the_last_call_is_admitted():
    n = Nodes()
    elastic = Settings(min_nodes=1, max_nodes=3, last_call_s=2.0)
    n.join("A", elastic)
    n.clock.advance(1.5)
    n.join("B", elastic)
    n.clock.advance(0.5)
    assert (n.poll("A", 1).outcome, n.poll("A", 1).world_size) == (Outcome.FORMED, 2)


def test_ranks_keep_the_previous_order_and_newcomers_follow_in_join_order():
    n = Nodes()
    three = Settings(min_nodes=3, max_nodes=4, last_call_s=1.0)
    assert n.form("A", "B", "C", settings=three) == {"A": 0, "B": 1, "C": 2}
    assert n.form("D", "C", "B", "A", settings=three) == {"A": 0, "B": 1, "C": 2, "D": 3}


def test_a_member_that_rejoins_makes_the_others_restart(n):
    n.form("A", "B")
    assert n.waiting("A", 1) == 0
    n.join("B")  # B's worker failed: its agent joins round 2
    assert n.waiting("A", 1) == 1
    assert n.join("A").outcome is Outcome.FORMED
    assert n.waiting("A", 2) == 0
    assert (n.poll("B", 2).rank, n.poll("B", 2).store) == (1, store("A"))


def test_a_spare_waiting_on_a_full_group_does_not_restart_it(n):
    n.form("A", "B")
    n.join("C")
    assert n.waiting("A", 1) == n.waiting("B", 1) == 0


def test_a_newcomer_restarts_a_group_with_room_to_grow():
    n = Nodes()
    elastic = Settings(min_nodes=1, max_nodes=3, last_call_s=2.0)
    n.form("A", "B", settings=elastic)
    n.join("C", elastic)
    assert n.waiting("A", 1) == 1


def test_a_node_left_behind_by_a_newer_round_is_told_to_rejoin(n):
    n.form("A", "B")
    n.join("C")   # a spare
    n.join("B")   # B restarts; the round fills with C and B, without A
    assert n.poll("B", 2).outcome is Outcome.FORMED
    assert n.waiting("A", 1) == 1


def test_a_participant_of_an_older_round_cannot_take_part_in_a_newer_one(n):
    n.form("A", "B")
    n.join("B")   # round 2 opens
    with pytest.raises(StaleParticipant) as info:
        n.poll("A", 2)   # A never joined round 2
    assert str(info.value) == ("A is not in round 2 of rendezvous 'job' (round 1 formed, 2 open); a participant of an "
                               "older round cannot take part in a newer one without joining again")
    assert n.poll("B", 2).joined == 1  # A's poll did not count it in
    n.join("A")
    with pytest.raises(StaleParticipant):
        n.poll("A", 1)   # round 1 is gone: no rank in it any more
    with pytest.raises(NotFound, match="has no round 9"):
        n.poll("A", 9)


def test_join_timeout_tells_the_participant_why_and_takes_it_out(n):
    n.join("A", timeout=10)
    n.clock.advance(9.9)
    assert n.poll("A", 1).outcome is Outcome.WAITING
    n.clock.advance(0.1)
    reply = n.poll("A", 1)
    assert (reply.outcome, reply.message) == (
        Outcome.TIMED_OUT, "round 1 of rendezvous 'job' did not form within the join timeout: 1 node(s) joined, it "
        "needs 2 (at most 2); start the missing nodes with the same --rdzv-id, or lower --nnodes")
    assert n.join("B").outcome is Outcome.WAITING  # B does not form a round with the timed-out A


def test_a_participant_not_heard_from_is_dropped(n):
    n.join("A")
    n.clock.advance(LEASE_S)
    assert decide(n.book.get(RUN), n.clock.monotonic()) == [Drop("A", 1, "A was dropped from round 1 of rendezvous "
                                                                  "'job': not heard from for 15s; join again", False)]
    with pytest.raises(StaleParticipant, match="not heard from for 15s"):
        n.poll("A", 1)
    assert n.join("B").joined == 1  # A is not counted any more


def test_polls_keep_a_participant_in(n):
    n.join("A")
    for _ in range(10):
        n.clock.advance(LEASE_S / 2)
        assert n.poll("A", 1).outcome is Outcome.WAITING
    assert n.join("B").outcome is Outcome.FORMED


def test_decide_is_pure(n):
    n.join("A", timeout=5)
    run = n.book.get(RUN)
    later = n.clock.monotonic() + 5
    assert decide(run, later) == decide(run, later) == [Drop("A", 1, decide(run, later)[0].reason, True)]
    assert run.open is not None and "A" in run.open.waiting
    n.join("B")
    assert n.book.get(RUN).formed.number == 1 and decide(n.book.get(RUN), later) == []


def test_the_last_call_is_a_decision_of_time_alone():
    n = Nodes()
    n.join("A", Settings(1, 2, 3.0))
    run = n.book.get(RUN)
    assert decide(run, n.clock.monotonic() + 2.9) == []
    assert decide(run, n.clock.monotonic() + 3.0) == [Form(1)]
    assert n.book.next_wakeup(RUN) == n.clock.monotonic() + 3.0


def test_every_node_of_a_round_must_agree_on_its_settings(n):
    n.join("A")
    with pytest.raises(FailedPrecondition) as info:
        n.join("B", Settings(1, 2, 2.0))
    assert str(info.value) == ("round 1 of rendezvous 'job' was opened with nnodes 2:2 and last_call_timeout 2s, but B "
                               "asks for 1:2 and 2s; give every node the same --nnodes and --rdzv-conf")


def test_a_closed_run_answers_closed_to_waiters_and_joiners(n):
    n.join("A")
    n.book.close(RUN, n.clock.monotonic())
    assert n.poll("A", 1).outcome is Outcome.CLOSED
    reply = n.join("B")
    assert (reply.outcome, reply.message) == (Outcome.CLOSED, "rendezvous 'job' is closed (a node finished or shut "
                                              "down); use a new --rdzv-id to start another job")
    assert RUN in n.changed


def test_shutdown_closes_the_run_and_the_last_to_leave_frees_the_id(n):
    n.form("A", "B")
    n.book.leave(RUN, "A", 1, True, n.clock.monotonic())
    assert n.book.get(RUN).closed
    assert n.join("C").outcome is Outcome.CLOSED
    n.book.leave(RUN, "B", 1, True, n.clock.monotonic())
    assert n.book.get(RUN) is None
    reply = n.join("C")
    assert (reply.outcome, reply.round) == (Outcome.WAITING, 1)  # the id is free for the next job


def test_leaving_names_the_round_so_a_stale_leave_harms_no_newer_round(n):
    n.form("A", "B")
    n.join("B")
    n.book.leave(RUN, "B", 1, False, n.clock.monotonic())  # an old instance of B, from round 1
    assert n.poll("B", 2).joined == 1
    n.book.leave(RUN, "B", 2, False, n.clock.monotonic())
    assert n.book.get(RUN).open.waiting == {}


def test_abandoned_runs_are_forgotten(n):
    n.form("A", "B")  # and then both agents are SIGKILLed: nobody leaves
    n.book.close("other", n.clock.monotonic())
    n.clock.advance(CLOSED_RUN_TTL_S)
    n.book.sweep(n.clock.monotonic())
    assert n.book.get("other") is None and n.book.get(RUN) is not None
    n.clock.advance(IDLE_RUN_TTL_S)
    n.book.sweep(n.clock.monotonic())
    assert n.book.get(RUN) is None


def test_a_running_group_that_keeps_asking_is_not_forgotten(n):
    n.form("A", "B")
    for _ in range(int(IDLE_RUN_TTL_S / SWEEP_EVERY_S) + 2):
        n.clock.advance(SWEEP_EVERY_S)
        assert n.waiting("A", 1) == 0
        n.book.sweep(n.clock.monotonic())
    assert n.book.get(RUN).formed.number == 1


def test_a_forgotten_run_asks_waiters_to_join_again_and_running_groups_to_carry_on(n):
    with pytest.raises(NotFound, match="join again"):
        n.poll("A", 3)
    assert n.waiting("A", 3) == 0


def test_a_retried_join_keeps_its_place(n):
    n.join("A")
    again = n.join("A", retry=True)
    assert (again.outcome, again.joined) == (Outcome.WAITING, 1)
    assert n.join("B").rank == 1


def test_a_join_retried_after_its_reply_was_lost_gets_the_same_answer_not_a_new_round(n):
    n.join("A")
    n.join("B")  # this Join formed round 1, but B never saw the reply
    again = n.join("B", retry=True)
    assert (again.outcome, again.round, again.rank) == (Outcome.FORMED, 1, 1)
    assert n.book.get(RUN).open is None and n.waiting("A", 1) == 0
    assert n.join("B").round == 2  # a new join (B's workers failed) does open the next round


def test_the_wire_protocol_is_versioned_and_its_enum_starts_unspecified():
    from phalanx.v1 import rendezvous_pb2
    assert rendezvous_pb2.DESCRIPTOR.package == "phalanx.v1"
    first = rendezvous_pb2.RoundOutcome.DESCRIPTOR.values[0]
    assert (first.name, first.number) == ("ROUND_OUTCOME_UNSPECIFIED", 0)
    assert {o.value for o in Outcome} == {1, 2, 3, 4}


# --- health: a node the controller finds wanting is left out, and a round that has one restarts ----------------

CFG = RecoveryConfig()


def as_view(node: str, verdict: str) -> NodeView | None:
    """The controller's view of a node from a verdict in words: 'it is DOWN', 'it is drained: why', 'it is FAILING:
    why' (or FAILED)."""
    if not verdict:
        return None
    if verdict.startswith("it is DOWN"):
        return NodeView(node, True, Health.HEALTHY, "")
    if verdict.startswith("it is drained"):
        return NodeView(node, False, Health.HEALTHY, "", drained=True, drain_reason=verdict.partition(": ")[2])
    health, _, reason = verdict.removeprefix("it is ").partition(": ")
    return NodeView(node, False, Health[health], reason)


class Fleet:
    """Participants A, B, C on nodes node-a, node-b, node-c, with the controller's verdicts in `unfit`."""

    def __init__(self, **policy) -> None:
        self.clock = FakeClock()
        self.unfit: dict[str, str] = {}
        self.events: list[tuple[str, str]] = []
        self.book = self.new_book(policy=RecoveryConfig(**policy))
        self.attempts: dict[str, int] = {}

    def view(self, node: str) -> NodeView | None:
        return as_view(node, self.unfit.get(node, ""))

    def new_book(self, **kwargs) -> RendezvousBook:
        """A book on this fleet's verdicts (the controller restarts: it knows nothing else)."""
        return RendezvousBook(view=self.view, on_event=lambda kind, message, run: self.events.append((kind, message)),
                              **kwargs)

    def join(self, pid, settings=TWO):
        self.attempts[pid] = self.attempts.get(pid, 0) + 1
        return self.book.join(RUN, pid, self.attempts[pid], settings, 600.0, store(pid), self.clock.monotonic(),
                              node=f"node-{pid.lower()}")

    def poll(self, pid, number):
        return self.book.poll(RUN, pid, number, self.clock.monotonic())


def test_a_failing_node_does_not_count_toward_a_round_and_is_left_out_when_it_forms():
    f = Fleet()
    f.unfit["node-a"] = "it is FAILING: GPU 0: row remap pending"
    first = f.join("A")
    assert first.outcome is Outcome.WAITING and "node node-a is left out of rounds while it is FAILING" in first.message
    assert f.join("B").outcome is Outcome.WAITING  # A does not make up the two nodes
    formed = f.join("C")
    assert formed.outcome is Outcome.FORMED and formed.world_size == 2
    told = f.poll("A", formed.round)
    assert told.outcome is Outcome.TIMED_OUT and "A on node node-a was left out of round 1" in told.message \
        and "FAILING: GPU 0: row remap pending" in told.message
    assert [k for k, _ in f.events] == ["rendezvous.left_out", "rendezvous.formed"]
    assert "2 nodes (node-b, node-c)" in f.events[-1][1]


def test_a_member_turning_failing_restarts_the_round_and_the_waiting_spare_takes_its_place():
    f = Fleet()
    f.join("A")
    formed = f.join("B")
    assert formed.outcome is Outcome.FORMED
    spare = f.join("C")  # beyond --nnodes's MAX: waits
    assert spare.outcome is Outcome.WAITING
    assert f.book.num_waiting(RUN, "A", formed.round, f.clock.monotonic()) == 0  # a spare alone restarts nothing
    f.unfit["node-b"] = "it is FAILING: GPU 1: row remap pending"
    assert f.book.num_waiting(RUN, "A", formed.round, f.clock.monotonic()) >= 1  # torchrun restarts its workers
    assert f.events[-1][0] == "rendezvous.restart" and "without node node-b (it is FAILING" in f.events[-1][1]
    f.book.num_waiting(RUN, "B", formed.round, f.clock.monotonic())
    assert sum(k == "rendezvous.restart" for k, _ in f.events) == 1  # said once per round
    # A joins again and the round forms with the spare in B's place, A keeping rank 0; B, joining again, waits
    # in the next round and is told why (its torchrun agent times out there: the node is out until repaired)
    assert f.join("A").outcome is Outcome.FORMED
    again = f.poll("C", spare.round)
    assert again.outcome is Outcome.FORMED and again.world_size == 2 and f.poll("A", spare.round).rank == 0
    held = f.join("B")
    assert held.outcome is Outcome.WAITING and "node node-b is left out of rounds while it is FAILING" in held.message


# --- checkpoint first: a round's trainlib workers save the same step before it restarts for an unfit node --------

def formed_with_spare(f):
    f.join("A")
    formed = f.join("B")
    f.join("C")
    return formed.round


def report(f, number, rank, step, done=(0, -1), world=2, step_s=0.1, saving=False, finished=False, compute=()):
    """Worker `rank` reports; rank 0 runs on node-a, rank 1 on node-b (A and B formed the round, in that order)."""
    return f.book.report_worker(RUN, number, Worker(rank, world, step, step_s, f.clock.monotonic(), *done,
                                                    node=f"node-{'abc'[rank]}", saving=saving, finished=finished,
                                                    compute_s=tuple(compute)), f.clock.monotonic())


def asked(f, step=5):
    """A formed round with a spare, both workers at `step`, node-b FAILING: the workers are asked to checkpoint."""
    number = formed_with_spare(f)
    report(f, number, 0, step)
    report(f, number, 1, step)
    f.unfit["node-b"] = "it is FAILING"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    return number


def test_a_round_whose_workers_report_checkpoints_the_same_step_before_it_restarts():
    f = Fleet()
    number = formed_with_spare(f)
    assert report(f, number, 0, 40) is None and report(f, number, 1, 41) is None  # nothing asked while all is well
    f.unfit["node-b"] = "it is FAILING: GPU 1: row remap pending"
    now = f.clock.monotonic()
    assert f.book.num_waiting(RUN, "A", number, now) == 0  # not yet: the workers checkpoint first
    kind, message = f.events[-1]
    ask = report(f, number, 0, 42)
    assert kind == "rendezvous.checkpoint" and f"after step {ask.at_step} before the round restarts without node " \
        "node-b (it is FAILING" in message
    # a second ahead at 0.1 s a step, plus the request's way down (a report interval), plus two
    assert ask.at_step == 41 + 15 + 2 and ask.world_size == 2
    assert report(f, number, 1, 43).id == ask.id  # every worker gets the same request
    assert f.book.num_waiting(RUN, "B", number, now) == 0
    f.clock.advance(1.0)
    report(f, number, 0, ask.at_step, done=(ask.id, ask.at_step))
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0  # one of two committed
    report(f, number, 1, ask.at_step, done=(ask.id, ask.at_step))
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1  # both: torchrun restarts the round
    kinds = [k for k, _ in f.events]
    assert kinds[-2:] == ["rendezvous.checkpointed", "rendezvous.restart"], f.events
    assert f"every worker (2) committed the checkpoint of step {ask.at_step}" in f.events[-1][1]
    assert f.book.num_waiting(RUN, "B", number, f.clock.monotonic()) >= 1  # the other member restarts too
    f.unfit.clear()  # the node recovering now does not call the restart off: the workers stopped stepping
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1


def test_a_round_without_reporting_workers_restarts_at_once_and_a_stuck_checkpoint_is_not_waited_for_ever():
    f = Fleet()
    number = formed_with_spare(f)
    f.unfit["node-b"] = "it is FAILING"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1  # no trainlib: as before
    assert "rendezvous.checkpoint" not in [k for k, _ in f.events]

    g = Fleet()
    number = asked(g)
    for i in range(int(CFG.checkpoint_deadline_s) + 1):  # the workers keep stepping, far slower than their pace
        g.clock.advance(1.0)                             # said: the agreed step is not reached by the deadline
        report(g, number, 0, 6 + i // 5)
        report(g, number, 1, 6 + i // 5)
        if g.book.num_waiting(RUN, "A", number, g.clock.monotonic()):
            break
    assert g.clock.monotonic() >= CFG.checkpoint_deadline_s
    assert g.events[-2][0] == "rendezvous.checkpoint_failed" and "only 0 of 2 workers committed" in g.events[-2][1]

    h = Fleet()
    number = asked(h)
    h.clock.advance(3.0)
    report(h, number, 0, 6)
    h.clock.advance(3.0)  # worker 1 died (a sudden fault besides): its peer can never reach the step
    assert h.book.num_waiting(RUN, "A", number, h.clock.monotonic()) >= 1
    assert "1 of 2 workers stopped reporting before the checkpoint" in h.events[-2][1]


def test_a_round_that_lost_a_worker_or_hangs_is_not_held_for_a_checkpoint():
    f = Fleet()
    number = formed_with_spare(f)
    report(f, number, 0, 5)
    report(f, number, 1, 5)
    f.clock.advance(6.0)
    report(f, number, 0, 5)  # worker 1 is silent: its node is lost (DOWN), a collective can never complete
    f.unfit["node-b"] = "it is DOWN (its agent is not heard from)"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
    assert "rendezvous.checkpoint" not in [k for k, _ in f.events]

    g = Fleet()  # a node that FAILED (xid 79): its GPU is gone, a collective can never complete: no checkpoint either
    number = formed_with_spare(g)
    report(g, number, 0, 5)
    report(g, number, 1, 5)
    g.unfit["node-b"] = "it is FAILED: GPU 1: XID 79 (fallen off the bus)"
    assert g.book.num_waiting(RUN, "A", number, g.clock.monotonic()) >= 1
    assert "rendezvous.checkpoint" not in [k for k, _ in g.events]
    assert "without node node-b (it is FAILED: GPU 1: XID 79" in g.events[-1][1]


def test_a_report_for_another_round_gets_no_request_and_the_agreed_step_reckons_with_time():
    f = Fleet()
    number = formed_with_spare(f)
    assert report(f, number + 1, 0, 5) is None and f.book.report_worker("other", 1, Worker(0, 1, 0, 0.1, 0.0),
                                                                        0.0) is None
    report(f, number, 0, 10)
    f.clock.advance(2.0)  # 2 s since worker 0's report of step 10, at 0.1 s a step: it is at step 30 by now
    report(f, number, 1, 29)
    f.unfit["node-b"] = "it is FAILING"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    # the lifecycle's rule (lifecycle.checkpoint_step): recovery.checkpoint_lead_s (1 s) and the request's way down
    # (a report interval, 0.5 s) ahead at the workers' pace, plus two
    assert report(f, number, 0, 30).at_step == 30 + 15 + 2


# --- a controller that restarted (or took over) re-learns running rounds from their members --------------------

def member(f, pid, rank, world=2):
    return Member(rank, world, store(pid), TWO, f"node-{pid.lower()}", f.attempts.get(pid, 1))


def test_a_restarted_controller_relearns_a_running_round_from_its_members_and_still_restarts_it_for_health():
    f = Fleet()
    f.join("A")
    first = f.join("B")
    ranks = {pid: f.poll(pid, first.round).rank for pid in "AB"}
    spare = f.join("C")
    assert spare.outcome is Outcome.WAITING
    f.book = f.new_book()  # the controller restarts: nothing known
    with pytest.raises(NotFound):
        f.poll("C", spare.round)
    again = f.join("C")  # the spare re-joins before any member has asked: round 1 opens in the new book
    assert (again.outcome, again.round) == (Outcome.WAITING, 1)
    now = f.clock.monotonic()
    assert f.book.num_waiting(RUN, "A", first.round, now, member(f, "A", ranks["A"])) == 0  # a full group
    assert f.events[-1][0] == "rendezvous.relearned" and "round 1 of rendezvous 'job' re-learned" in f.events[-1][1]
    assert f.book.num_waiting(RUN, "B", first.round, now, member(f, "B", ranks["B"])) == 0
    f.clock.advance(RELEARN_GRACE_S)
    now = f.clock.monotonic()
    run = f.book.get(RUN)
    assert [p.id for p in run.formed.ranks] == sorted("AB", key=ranks.get) and run.open.number == 2
    waiting = f.poll("C", again.round)  # its round was renumbered past the re-learned one: still its place
    assert (waiting.outcome, waiting.round) == (Outcome.WAITING, 2)
    f.unfit["node-b"] = "it is FAILING"
    assert f.book.num_waiting(RUN, "A", first.round, now, member(f, "A", ranks["A"])) >= 1
    assert f.events[-1][0] == "rendezvous.restart" and "without node node-b" in f.events[-1][1]
    formed = f.join("A")
    assert formed.outcome is Outcome.FORMED and formed.round == 2 and formed.world_size == 2
    assert f.poll("C", 2).outcome is Outcome.FORMED


def test_a_member_of_a_round_this_book_formed_or_superseded_cannot_rewrite_it():
    f = Fleet()
    f.join("A")
    formed = f.join("B")
    now = f.clock.monotonic()
    assert f.book.num_waiting(RUN, "X", formed.round, now, member(f, "X", 0)) == 0  # not a member: ignored
    assert [p.id for p in f.book.get(RUN).formed.ranks] == ["A", "B"]
    f.join("A")  # A restarts: round 2 opens, the group restarts
    assert f.book.num_waiting(RUN, "B", formed.round, now, member(f, "B", 1)) >= 1
    assert f.book.get(RUN).formed.number == 1 and "rendezvous.relearned" not in [k for k, _ in f.events]


def test_a_relearned_round_with_a_member_that_never_asks_restarts_after_the_grace():
    f = Fleet()
    f.join("A")
    first = f.join("B")
    f.join("C")
    f.book = f.new_book()
    f.join("C")  # the spare re-joins; B's node died while the controller was away: it never asks
    assert f.book.num_waiting(RUN, "A", first.round, f.clock.monotonic(), member(f, "A", 0)) == 0
    f.clock.advance(RELEARN_GRACE_S)
    assert f.book.num_waiting(RUN, "A", first.round, f.clock.monotonic(), member(f, "A", 0)) >= 1
    assert "1 of its 2 nodes did not ask after the controller restarted" in f.events[-1][1]
    # the renumbered round's participant and the re-learned round's member both keep their own round 1
    f.book.leave(RUN, "A", first.round, False, f.clock.monotonic())
    assert "A" in f.book.get(RUN).left


def test_a_fresh_controller_forms_no_round_before_running_rounds_had_time_to_re_teach_theirs():
    clock = FakeClock()
    book = RendezvousBook(hold_until=clock.monotonic() + RELEARN_GRACE_S)
    book.join(RUN, "A", 1, TWO, 600.0, store("A"), clock.monotonic())
    assert book.join(RUN, "B", 1, TWO, 600.0, store("B"), clock.monotonic()).outcome is Outcome.WAITING
    assert book.next_wakeup(RUN) == clock.monotonic() + RELEARN_GRACE_S
    clock.advance(RELEARN_GRACE_S)
    assert book.poll(RUN, "A", 1, clock.monotonic()).outcome is Outcome.FORMED


def test_a_worker_past_the_agreed_step_or_one_that_saved_another_step_is_no_consistent_checkpoint():
    f = Fleet()
    number = asked(f, 40)
    ask = report(f, number, 0, 41)
    report(f, number, 1, ask.at_step + 3, done=(ask.id, ask.at_step + 3))  # the request came too late for it
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
    assert f.events[-2][0] == "rendezvous.checkpoint_failed" and f"went past step {ask.at_step}" in f.events[-2][1]
    with pytest.raises(FailedPrecondition, match="says the round has 3 workers; its first report said 2"):
        report(f, number, 1, 50, world=3)


def test_a_round_that_has_not_stepped_yet_restarts_at_once_and_request_ids_start_where_the_book_is_told():
    f = Fleet()
    f.book = f.new_book(first_ask_id=1_000_000)
    number = formed_with_spare(f)
    report(f, number, 0, -1, step_s=0.0)  # just started: no step, no pace
    report(f, number, 1, 3)
    f.unfit["node-b"] = "it is FAILING"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1

    g = Fleet()
    g.book = g.new_book(first_ask_id=1_000_000)
    number = formed_with_spare(g)
    report(g, number, 0, 3)
    report(g, number, 1, 3)
    g.unfit["node-b"] = "it is FAILING"
    g.book.num_waiting(RUN, "A", number, g.clock.monotonic())
    assert report(g, number, 0, 3).id == 1_000_001


def stepped(f, number, steps=50, step_s=0.1, workers=2):
    """Every worker steps `steps` times at `step_s`, reporting each step: past the start-up's first steps."""
    for step in range(steps):
        f.clock.advance(step_s)
        for rank in range(workers):
            report(f, number, rank, step, step_s=step_s)


def test_a_round_whose_workers_stop_stepping_restarts_but_not_while_one_saves_or_before_the_first_step():
    f = Fleet()
    number = formed_with_spare(f)
    report(f, number, 0, -1, step_s=0.0)  # loading: no step yet, for less than recovery.startup_s
    report(f, number, 1, -1, step_s=0.0)
    f.clock.advance(CFG.startup_s - 1)
    report(f, number, 0, -1, step_s=0.0)
    report(f, number, 1, -1, step_s=0.0)
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    stepped(f, number)
    for _ in range(10):  # a save at step 49 takes long (10 s; the hang limit is 2 s): no hang
        f.clock.advance(1.0)
        report(f, number, 0, 49, saving=True)
        report(f, number, 1, 49)
        assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    report(f, number, 0, 49)  # the save is over: its time was no hang (the others waited for it)
    f.clock.advance(CFG.hang_min_s + 1)
    report(f, number, 0, 49)  # both wait in a collective that will not complete
    report(f, number, 1, 49)
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
    kind, message = f.events[-1]
    assert kind == "rendezvous.hang" and "restarts (hung): rank 0 made no progress for 3.0s" in message, message


def test_the_end_of_training_is_no_hang_even_after_the_worker_that_said_it_exited():
    """Worker 0 ended training at step 49 (destroy_process_group, exit) and went silent; worker 1 is still in its
    teardown, at step 49, long past the hang floor: no verdict. A round whose training did not end is judged."""
    for ended in (True, False):
        f = Fleet()
        number = formed_with_spare(f)
        stepped(f, number)
        report(f, number, 0, 49, finished=ended)
        for _ in range(int(CFG.hang_min_s) * 3):  # worker 0 has exited: only worker 1 reports
            f.clock.advance(1.0)
            report(f, number, 1, 49)
        hung = f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
        assert hung is not ended, (ended, f.events)


def test_the_controllers_recovery_config_sets_the_hang_rule_for_torchrun_rounds_as_for_every_job():
    """[recovery] hang_min_s and hang_factor (of the 90th percentile step time) judge a round as they judge a job
    Phalanx launched: 5 s without a step is a hang under the defaults (2 s, 3 x 0.1 s), not under a floor of 10 s;
    nor under a factor of 20 on 0.5 s steps (10 s)."""
    for policy, step_s, hung in (({}, 0.1, True), ({"hang_min_s": 10.0}, 0.1, False), ({"hang_factor": 20.0}, 0.5,
                                                                                      False)):
        f = Fleet(**policy)
        number = formed_with_spare(f)
        stepped(f, number, 20, step_s)
        f.clock.advance(5.0)
        report(f, number, 0, 19, step_s=step_s)
        report(f, number, 1, 19, step_s=step_s)
        assert (f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1) is hung, (policy, f.events)


def test_the_hang_floor_comes_from_the_rounds_settings_and_grows_with_slow_steps():
    f = Fleet()
    slow = Settings(min_nodes=2, max_nodes=2, last_call_s=2.0, hang_s=60.0)  # --rdzv-conf hang_timeout=60
    f.join("A", slow)
    number = f.join("B", slow).round
    stepped(f, number, 20)
    f.clock.advance(30.0)
    report(f, number, 0, 19)
    report(f, number, 1, 19)
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    g = Fleet()
    number = formed_with_spare(g)
    stepped(g, number, 20, 2.0)  # 2 s steps: 3 x that is 6 s
    g.clock.advance(5.0)
    report(g, number, 0, 19, step_s=2.0)
    report(g, number, 1, 19, step_s=2.0)
    assert g.book.num_waiting(RUN, "A", number, g.clock.monotonic()) == 0
    g.clock.advance(2.0)
    report(g, number, 0, 19, step_s=2.0)
    assert g.book.num_waiting(RUN, "A", number, g.clock.monotonic()) >= 1


def straggling(f, number, steps=40, slow=1.5):
    """Both workers step at 0.1 s; worker 1's compute takes `slow` x worker 0's (its GPU is throttled)."""
    for step in range(steps):
        f.clock.advance(0.1)
        report(f, number, 0, step, compute=[0.06])
        report(f, number, 1, step, compute=[0.06 * slow])


def test_a_straggling_worker_is_found_as_in_any_job_and_its_node_leaves_the_run_after_a_checkpoint():
    f = Fleet()
    number = formed_with_spare(f)  # C waits: a spare to take the straggler's place
    straggling(f, number)
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0  # predictable: checkpoint first
    kind, message = f.events[-1]
    assert kind == "rendezvous.checkpoint" and "without node node-b (rank 1 computes 1.50x slower" in message
    ask = report(f, number, 0, 40, compute=[0.06])
    report(f, number, 0, ask.at_step, done=(ask.id, ask.at_step))
    report(f, number, 1, ask.at_step, done=(ask.id, ask.at_step))
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
    assert f.events[-1][0] == "rendezvous.restart" and "rank 1 computes 1.50x slower" in f.events[-1][1]
    again = f.join("A")  # the next round forms of A and the spare C
    assert again.outcome is Outcome.FORMED and f.poll("C", again.round).outcome is Outcome.FORMED
    held = f.join("B")  # B's node is out of the run: it waits, and is told why
    assert held.outcome is Outcome.WAITING and "node node-b is left out of rounds while it was evicted from " \
        "rendezvous 'job' as a straggler" in held.message


def evicted_b_then_c_fails(f) -> int:
    """B evicted as a straggler, the round of A and the spare C formed; then C's node turns FAILING and B's agent
    joins the next round first (healthy, but out of the run). Returns that round's number."""
    number = formed_with_spare(f)
    straggling(f, number)
    f.book.num_waiting(RUN, "A", number, f.clock.monotonic())
    ask = report(f, number, 0, 40, compute=[0.06])
    for rank in (0, 1):
        report(f, number, rank, ask.at_step, done=(ask.id, ask.at_step))
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) >= 1
    second = f.join("A")
    assert second.outcome is Outcome.FORMED and f.poll("C", second.round).outcome is Outcome.FORMED
    f.unfit["node-c"] = "it is FAILING: GPU 0: row remap pending"
    third = f.join("B")
    assert third.outcome is Outcome.WAITING and "evicted from rendezvous 'job' as a straggler" in third.message
    return third.round


def keep_alive(f, number, seconds, *pids) -> None:
    """`seconds` pass while `pids` wait in round `number`, asking every second as torchrun's agents do."""
    for _ in range(int(seconds)):
        f.clock.advance(1)
        for pid in pids:
            assert f.poll(pid, number).outcome is Outcome.WAITING, pid


def test_a_node_evicted_as_a_straggler_is_taken_back_when_the_round_cannot_form_without_it():
    """A slow node is better than no job: the round that cannot reach its minimum without B forms with it once
    READMIT_AFTER_S has passed, says so, and B is no longer out of the run (a99503e's CI: the round timed out)."""
    f = Fleet()
    number = evicted_b_then_c_fails(f)
    assert f.join("A").round == number and f.join("C").round == number
    keep_alive(f, number, READMIT_AFTER_S - 1, "A", "B", "C")  # the fit members of the last round may still come
    f.clock.advance(1)
    formed = f.poll("A", number)
    assert formed.outcome is Outcome.FORMED and formed.world_size == 2, formed
    assert f.poll("B", number).outcome is Outcome.FORMED
    assert f.poll("C", number).outcome is Outcome.TIMED_OUT  # FAILING: left out
    kinds = [k for k, _ in f.events]
    said = dict(f.events)["rendezvous.readmitted"]
    assert "node node-b takes part in round" in said and "though it was evicted from rendezvous 'job' as a " \
        "straggler" in said and f"for {READMIT_AFTER_S:g}s" in said, said
    assert kinds[-3:] == ["rendezvous.readmitted", "rendezvous.left_out", "rendezvous.formed"], kinds
    assert "node-b" not in f.book.get(RUN).evicted


def test_as_few_evicted_stragglers_are_taken_back_as_make_the_minimum_and_the_wait_wakes_the_round():
    """nnodes 2:3, A fit, B and C evicted: after READMIT_AFTER_S (the run's next wake-up, so a waiting AwaitRound
    is not late) the round forms of A and B alone (the first evicted to join); C stays out of the run."""
    f = Fleet()
    wide = Settings(min_nodes=2, max_nodes=3, last_call_s=2.0)
    f.join("A", wide)
    run = f.book.get(RUN)
    for node in ("node-b", "node-c"):
        run.evicted[node] = "it was evicted from rendezvous 'job' as a straggler: rank 1 computes 1.50x slower"
    f.join("B", wide)
    number = f.join("C", wide).round
    keep_alive(f, number, READMIT_AFTER_S - 1, "A", "B", "C")
    assert f.book.next_wakeup(RUN) == f.clock.monotonic() + 1  # (before any lease or join timeout runs out)
    f.clock.advance(1)
    formed = f.poll("A", number)
    assert formed.outcome is Outcome.FORMED and formed.world_size == 2, formed
    assert f.poll("B", number).outcome is Outcome.FORMED and f.poll("C", number).outcome is Outcome.TIMED_OUT
    assert [k for k, _ in f.events].count("rendezvous.readmitted") == 1
    assert "node-b" not in run.evicted and "node-c" in run.evicted


def test_places_finds_every_position_of_the_names_gone_in_order():
    from controller.recovery.lifecycle import _places
    nodes = ["a", "b", "c", "b", "d"]
    assert _places(nodes, {"b"}) == [1, 3]
    assert _places(tuple(nodes), {"d", "a", "x"}) == [0, 4]
    many = {f"n{i}" for i in range(10)} | {"c"}
    assert _places(nodes, many) == [2]  # (more than a few gone: one pass)


def test_an_evicted_straggler_waiting_first_does_not_start_the_clock_and_a_fit_node_makes_the_round():
    """B waits alone past READMIT_AFTER_S: nothing forms (one node). A joins: the clock starts only now, and C,
    fit again within it, makes the round with A; B stays out of the run."""
    f = Fleet()
    number = evicted_b_then_c_fails(f)
    keep_alive(f, number, READMIT_AFTER_S + 5, "B")
    assert f.join("A").outcome is Outcome.WAITING
    keep_alive(f, number, READMIT_AFTER_S - 1, "A", "B")
    f.unfit.pop("node-c")
    formed = f.join("C")
    assert formed.outcome is Outcome.FORMED and f.poll("A", number).outcome is Outcome.FORMED
    assert "rendezvous.readmitted" not in [k for k, _ in f.events]
    assert "node-b" in f.book.get(RUN).evicted


def test_a_round_short_of_nodes_says_which_joined_ones_were_left_out_and_why():
    f = Fleet()
    f.unfit["node-a"] = "it is FAILING: GPU 0: row remap pending"
    f.join("A")
    f.join("B")
    f.clock.advance(600)
    told = f.poll("B", 1)
    assert told.outcome is Outcome.TIMED_OUT and "2 node(s) joined, 1 of them fit to take part (left out: node " \
        "node-a: it is FAILING: GPU 0: row remap pending), it needs 2 (at most 2)" in told.message, told.message


def test_a_straggler_verdict_is_held_while_no_torchrun_agent_waits_to_take_its_place():
    f = Fleet()
    f.join("A")
    number = f.join("B").round  # no spare
    straggling(f, number)
    for _ in range(3):
        assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
        straggling(f, number, 5)
    held = [m for k, m in f.events if k == "rendezvous.straggler_held"]
    assert len(held) == 1 and "no torchrun agent waits to take its node's place" in held[0], f.events  # said once
    assert "rendezvous.checkpoint" not in [k for k, _ in f.events]


def test_a_torchrun_run_is_running_while_its_round_trains_and_shows_how_it_ended():
    """The docs' torchrun tutorial, re-run: a node left out of the next round shut down and closed the
    rendezvous, and `phalanx jobs` said SUCCEEDED while round 2 trained on; once the run ended it vanished. Now
    it is RUNNING while members of its formed round remain, and ended it stays listed: SUCCEEDED when every
    worker said training ended, FAILED when one never did."""
    from controller.api.rendezvous_service import RendezvousService
    from phalanx.v1 import common_pb2

    for finished in (True, False):
        service = RendezvousService(FakeClock())
        f = Fleet()
        f.book, f.clock = service.book, service._clock
        number = formed_with_spare(f)
        report(f, number, 0, 9)
        report(f, number, 1, 9)
        f.book.leave(RUN, "C", number + 1, True, f.clock.monotonic())  # the waiting node's torchrun shuts down
        (job,) = service.jobs()
        assert job.state == common_pb2.JOB_STATE_RUNNING and "rendezvous closed" in job.reason, job
        assert job.spec.ranks_per_node == 1
        report(f, number, 0, 9, finished=finished)
        report(f, number, 1, 9, finished=True)
        for pid in ("A", "B"):
            f.book.leave(RUN, pid, number, True, f.clock.monotonic())
        assert f.book.get(RUN) is None  # forgotten by the book: everyone left
        (job,) = service.jobs()
        expected = common_pb2.JOB_STATE_SUCCEEDED if finished else common_pb2.JOB_STATE_FAILED
        assert job.state == expected and job.id == f"torchrun-{RUN}", job


# --- a run is kept in the store: a restart or a takeover keeps its owner, its evictions and how it shows ---------

class Aborted(Exception):
    pass


class Context:
    """What the servicer's methods use of a gRPC context."""

    async def abort(self, code, details):
        raise Aborted(code, details)

    def peer(self) -> str:
        return "test"


def join_request(pid: str, node: str, port: int) -> rendezvous_pb2.JoinRequest:
    return rendezvous_pb2.JoinRequest(
        run_id=RUN, participant_id=pid, attempt=1, node=node, join_timeout_s=60,
        settings=rendezvous_pb2.RoundSettings(min_nodes=2, max_nodes=2, last_call_s=0),
        store=rendezvous_pb2.StoreAddress(host="127.0.0.1", port=port))


async def as_(who, method, request):
    access.set_caller(who)
    return await method(request, Context())


@pytest.fixture(params=["memory", "etcd"])
def store_kind(request):
    """A store of each kind the controllers share: in memory, and a real etcd (a fresh key prefix on the session's
    member), where an HA set keeps its records."""
    if request.param == "memory":
        return MemoryStore
    import uuid

    from controller.store.etcd import Etcd, EtcdStore
    member = request.getfixturevalue("etcd_server")
    return lambda: EtcdStore(Etcd([member.endpoint]), f"/test/{uuid.uuid4().hex}/")


def test_a_takeover_keeps_a_torchrun_runs_owner_and_evictions_from_its_stored_record(store_kind):
    """The book lived in the leader's memory only: after a takeover a run was the first identity's that acted on
    it, and it showed nowhere until its members asked. Now each run is a record in the store."""
    alice, bob = access.Identity("alice", "user"), access.Identity("bob", "user")

    async def story():
        clock, store = FakeClock(), store_kind()
        leader = RendezvousService(clock, store=store)
        assert (await as_(alice, leader.Join, join_request("A", "node-a", 2001))).outcome == \
            rendezvous_pb2.ROUND_OUTCOME_WAITING
        formed = await as_(alice, leader.Join, join_request("B", "node-b", 2002))
        assert formed.outcome == rendezvous_pb2.ROUND_OUTCOME_FORMED
        leader.book.get(RUN).evicted["node-c"] = "it was evicted as a straggler"  # as _evict does
        leader._mark(RUN)
        await leader.flush()
        [record] = [r for r in await store.load_jobs() if r.id == f"torchrun-{RUN}"]
        stored = common_pb2.Job.FromString(record.data)
        assert (stored.user, stored.state, list(stored.nodes), stored.generation) == (
            "alice", common_pb2.JOB_STATE_RUNNING, ["node-a", "node-b"], formed.round)
        assert list(stored.incident_nodes) == ["node-c"] and f"--rdzv-id={RUN}" in stored.spec.command

        standby = RendezvousService(clock, store=store, restarted=True)  # takes over: its book knows nothing else
        await standby.load()
        shown = {j.id: j for j in standby.jobs()}[f"torchrun-{RUN}"]
        assert (shown.user, shown.state, list(shown.nodes)) == ("alice", common_pb2.JOB_STATE_RUNNING,
                                                                ["node-a", "node-b"])
        with pytest.raises(Aborted, match="belongs to 'alice'"):  # not the first identity to act on it any more
            await as_(bob, standby.Join, join_request("M", "node-m", 2009))
        assert "node-c" in standby.book.get(RUN).evicted
        member = rendezvous_pb2.RoundMember(rank=0, world_size=2, node="node-a", attempt=1,
                                            store=rendezvous_pb2.StoreAddress(host="127.0.0.1", port=2001),
                                            settings=rendezvous_pb2.RoundSettings(min_nodes=2, max_nodes=2))
        await as_(alice, standby.NumNodesWaiting, rendezvous_pb2.NumNodesWaitingRequest(
            run_id=RUN, participant_id="A", round=formed.round, member=member))
        assert standby.book.get(RUN).formed.number == formed.round  # re-taught by its member

        # a run whose members never come back is kept an hour for them, then shows as failed, and its id is free
        lost = RendezvousService(clock, store=store, restarted=True)
        await lost.load()
        clock.advance(IDLE_RUN_TTL_S + SWEEP_EVERY_S)
        lost.book.sweep(clock.monotonic())
        ended = {j.id: j for j in lost.jobs()}[f"torchrun-{RUN}"]
        assert ended.state == common_pb2.JOB_STATE_FAILED and "no member" in ended.reason
        await lost.flush()
        [record] = [r for r in await store.load_jobs() if r.id == f"torchrun-{RUN}"]
        assert common_pb2.Job.FromString(record.data).state == common_pb2.JOB_STATE_FAILED
        await as_(bob, lost.Join, join_request("M", "node-m", 2009))  # a new run of that id: bob's
        await store.close()

    try:
        asyncio.run(story())
    finally:
        access.set_caller(None)


def test_a_drain_once_training_ended_restarts_nothing_and_only_a_fit_participant_is_a_spare():
    """A node drained as its job ends (an operator's habit) does not restart a finished round; a participant waiting
    on an unfit node is no spare for a straggler's place (the round would form smaller, or never)."""
    f = Fleet()
    number = formed_with_spare(f)
    stepped(f, number)
    report(f, number, 0, 49, finished=True)
    f.unfit["node-b"] = "it is drained: maintenance"
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0
    assert "rendezvous.checkpoint" not in [k for k, _ in f.events]

    g = Fleet()
    number = formed_with_spare(g)
    g.unfit["node-c"] = "it is FAILING: GPU 0: row remap pending"  # the waiting participant C is on a failing node
    straggling(g, number)
    assert g.book.num_waiting(RUN, "A", number, g.clock.monotonic()) == 0
    assert [k for k, _ in g.events][-1] == "rendezvous.straggler_held", g.events


def test_a_resumed_rounds_first_report_counts_one_step_so_its_start_up_allowance_runs():
    """A round that resumes at step 500 reports step 500 first: one step taken, not 501, so recovery.startup_s
    covers its first steps (loading, the first collectives) as it does a job's."""
    f = Fleet()
    number = formed_with_spare(f)
    for rank in (0, 1):
        report(f, number, rank, 500)
    f.clock.advance(CFG.hang_min_s * 10)  # a slow second step after the resume: within startup_s
    for rank in (0, 1):
        report(f, number, rank, 500)
    assert f.book.num_waiting(RUN, "A", number, f.clock.monotonic()) == 0, f.events
