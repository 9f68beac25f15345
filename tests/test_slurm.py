"""Beside Slurm: `phalanx run` in an sbatch job protects it as a submitted job is protected, an evicted node is
drained in Slurm, and `phalanx slurm-healthcheck` drains and resumes nodes as NHC does. Against a real Slurm
(Debian's slurm-wlm, its own munged) whose slurmd, Phalanx agent and ranks run per node in a network namespace
of their own (tests/slurm_cluster.py); the controller and slurmctld share the hub namespace."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import remove_cgroups
from tests.eventually import eventually
from tests.slurm_cluster import TERMINAL, SlurmCluster, available
from tests.test_recovery_e2e import CONTROLLER, TRAIN, trained_as, until_resumed

pytestmark = pytest.mark.slurm  # the tier (tests/conftest.py)

needs_slurm = pytest.mark.skipif(bool(available()), reason=available() or "Slurm can run here")
PORT = 7370  # the hub namespace is the test's own: nothing else listens there


class Fleet:
    """A real Slurm cluster with a Phalanx controller in its hub and an agent on every node."""

    def __init__(self, sc: SlurmCluster, root: Path, controller: str = CONTROLLER) -> None:
        self.sc, self.root = sc, root
        self.address = f"{sc.hub_ip}:{PORT}"
        self.cgroup_parent = f"phalanx-test/slurm-{sc.hub_ns}"
        self.env = {**sc.env, "PHALANX_CONTROLLER": self.address, "PHALANX_INSECURE": "1"}
        root.mkdir(parents=True, exist_ok=True)
        config = root / "controller.toml"
        config.write_text(f'listen = "{self.address}"\nstate_db = "{root / "controller.db"}"\n'
                          f'log_format = "console"\n[security]\ninsecure = true\n' + controller)
        self.logs = {"controller": root / "controller.log"}
        sc.popen_in("hub", [sys.executable, "-m", "controller.main", "--config", str(config)],
                    stdout=self.logs["controller"].open("w"), stderr=subprocess.STDOUT)
        for node in sc.node_names:
            self.start_agent(node)
        self.wait_for(lambda: all(n.get("state") == "UP" for n in self.nodes().values())
                      and len(self.nodes()) == len(sc.node_names), "every agent UP")

    def agent_config(self, node: str) -> Path:
        return self.root / node / "agent.toml"

    def start_agent(self, node: str) -> None:
        d = self.root / node
        d.mkdir(exist_ok=True)
        self.agent_config(node).write_text(
            f'node_name = "{node}"\ncontroller = "{self.address}"\nadvertise_address = "{self.sc.ip(node)}"\n'
            f'state_dir = "{d / "state"}"\ncheckpoint_dir = "{d / "ckpt"}"\nsnapshot_dir = "{d / "snapshots"}"\n'
            f'nvrx_socket = "{d / "nvhcd.sock"}"\ncgroup_parent = "{self.cgroup_parent}"\nlog_format = "console"\n'
            'warm_start = false\n'  # warm standbys: tests/cluster.py start_agent
            '[gpu]\nbackend = "sim"\nsim_count = 2\n[reconnect]\nmax_backoff_s = 1.0\n[security]\ninsecure = true\n')
        self.logs[node] = d / "agent.log"
        self.sc.popen_in(node, [sys.executable, "-m", "agent.main", "--config", str(self.agent_config(node))],
                         stdout=self.logs[node].open("w"), stderr=subprocess.STDOUT)

    def cli(self, *args: str, where: str = "hub", timeout: float = 120):
        return self.sc.run_in(where, [sys.executable, "-m", "cli.main", *args], env=self.env, check=False,
                              timeout=timeout)

    def json(self, *args: str):
        out = self.cli(*args, "-o", "json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def nodes(self) -> dict:
        out = self.cli("nodes", "-o", "json")
        return {n["name"]: n for n in json.loads(out.stdout)} if out.returncode == 0 else {}

    def wait_for(self, predicate, what: str, timeout: float = 180.0) -> None:
        eventually(predicate, what, timeout, interval=0.2, describe=lambda: "\n".join(
            f"--- {name}:\n{path.read_text()[-3000:]}" for name, path in self.logs.items() if path.exists()))

    def sbatch_run(self, tmp_path: Path, run_args: str, train_args: str, *sbatch_args: str) -> tuple[int, dict]:
        """Submit an sbatch script that `exec`s `phalanx run RUN_ARGS -- python TRAIN TRAIN_ARGS`; wait for its
        Phalanx job to run and train. The Slurm job id and the Phalanx job."""
        script = (f"#!/bin/sh\nexport PHALANX_CONTROLLER={self.address} PHALANX_INSECURE=1\n"
                  f"exec {sys.executable} -m cli.main run {run_args} --env GLOO_SOCKET_IFNAME=eth0 "
                  f"--checkpoint-dir {tmp_path / 'ckpt'} -- {sys.executable} {TRAIN} {train_args}\n")
        slurm_job = self.sc.sbatch(script, *sbatch_args, "-o", str(tmp_path / "slurm-%j.out"), cwd=tmp_path)
        self.logs["the batch script"] = tmp_path / f"slurm-{slurm_job}.out"
        self.wait_for(lambda: self.ours(slurm_job).get("state") == "RUNNING"
                      or self.sc.job_state(slurm_job) in TERMINAL, "phalanx run's job running")
        job = self.ours(slurm_job)
        assert job.get("state") == "RUNNING", self.logs["the batch script"].read_text()
        self.wait_for(lambda: "step 20 loss" in self.cli("logs", job["id"]).stdout, "training under way")
        return slurm_job, job

    def ours(self, slurm_job: int) -> dict:
        """The Phalanx job `phalanx run` submitted for Slurm job `slurm_job` ({} until it has)."""
        return next((j for j in self.json("jobs") if j["name"] == f"slurm-{slurm_job}"), {})

    def close(self) -> None:
        remove_cgroups(self.cgroup_parent)


def started_fleet(tmp_path: Path, controller: str = CONTROLLER):
    if available():
        pytest.skip(available())
    with SlurmCluster(nodes=3, conf_extra="KillWait=30") as sc:  # Slurm's default: SIGTERM, 30 s, SIGKILL
        f = Fleet(sc, tmp_path / "fleet", controller)  # not "phalanx": the batch script runs python -m phalanx...
        try:
            yield f
        finally:
            f.close()


@pytest.fixture
def fleet(tmp_path):
    yield from started_fleet(tmp_path)


@pytest.fixture
def watching_fleet(tmp_path):
    """A fleet whose controller checks the Slurm jobs every second and gives up on an ended one after 2 s."""
    yield from started_fleet(tmp_path, CONTROLLER.replace("[jobs]\n", "[jobs]\nslurm_watch_s = 1.0\n"
                                                                      "slurm_orphan_s = 2.0\n"))


# slow tier (CI's test-slow stage): 80 s under make test's contention, its longest item; make test keeps a
# drain in Slurm and a resume (the health check's test) and an sbatch job checkpointed before its eviction
# (torchrun's)
@pytest.mark.slow
def test_an_sbatch_job_run_by_phalanx_is_checkpointed_drained_in_slurm_and_resumed_on_its_spare(
        fleet, tmp_path, reference):
    sc = fleet.sc
    out = tmp_path / "checksum.txt"
    slurm_job, job = fleet.sbatch_run(tmp_path, "--spares 1", " ".join(until_resumed(out)) + " --step-time 0.05 "
                                      "--every 20", "-N", "3")
    assert sorted(job["nodes"] + job["spares"]) == sc.node_names and len(job["spares"]) == 1

    victim = job["nodes"][1]
    assert fleet.cli("inject", victim, "--gpu", "0", "remap-pending").returncode == 0
    assert sc.wait_job(slurm_job, timeout=300) == "COMPLETED", (tmp_path / f"slurm-{slurm_job}.out").read_text()

    j = fleet.json("job", job["id"])
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in fleet.json("events", "--job", job["id"]))
    assert (j["state"], j["generation"], j["restarts"]) == ("SUCCEEDED", 2, 1), story
    assert victim in j["evicted"] and sorted(j["nodes"]) == sorted(set(sc.node_names) - {victim}), story
    checksum, uninterrupted = trained_as(out, reference)
    assert checksum == uninterrupted  # the model of an uninterrupted run
    kinds = [e["kind"] for e in fleet.json("events", "--job", job["id"])]
    assert kinds.index("job.checkpointed") < kinds.index("job.evicting") < kinds.index("job.restarting"), story
    info = sc.node_info(victim)
    assert "DRAIN" in info["State"] and info["Reason"].startswith("phalanx:"), f"{info}\n{story}"
    assert "job.slurm_drain" in kinds, story
    said = (tmp_path / f"slurm-{slurm_job}.out").read_text()
    assert f"{job['id']} runs Slurm job {slurm_job} on 2 of {sc.nodelist}, 1 kept as spares" in said, said
    assert f"{job['id']}: SUCCEEDED" in said, said


def test_scancel_reaches_the_ranks_as_a_checkpoint_first(fleet, tmp_path):
    sc = fleet.sc
    slurm_job, job = fleet.sbatch_run(tmp_path, "--grace 20", f"--steps 100000 --step-time 0.05 --every 100000 "
                                      f"--out {tmp_path / 'x'}", "-N", "2")
    job_id = job["id"]
    sc.scancel(str(slurm_job))  # SIGTERM to the batch script, as the time limit and preemption send it too
    fleet.wait_for(lambda: fleet.ours(slurm_job).get("state") == "CANCELLED", "the job cancelled")
    kinds = [e["kind"] for e in fleet.json("events", "--job", job_id)]
    assert kinds.index("job.checkpointed") < kinds.index("job.cancelling"), kinds
    said = (tmp_path / f"slurm-{slurm_job}.out").read_text()
    assert "Slurm sent SIGTERM: asking every rank" in said and "every rank committed step" in said, said


def test_a_job_whose_phalanx_run_was_killed_is_cancelled_once_its_slurm_job_has_ended(watching_fleet, tmp_path):
    fleet, sc = watching_fleet, watching_fleet.sc
    slurm_job, job = fleet.sbatch_run(tmp_path, "", f"--steps 100000 --step-time 0.05 --every 100000 "
                                      f"--out {tmp_path / 'x'}", "-N", "2")
    found = subprocess.run(["pgrep", "-f", f"cli.main run .*{tmp_path / 'ckpt'}"], capture_output=True,
                           text=True, check=False)
    pids = [int(pid) for pid in found.stdout.split()]
    assert len(pids) == 1, found
    os.kill(pids[0], 9)  # no checkpoint, no cancel: the batch script ends and Slurm frees the allocation
    assert sc.wait_job(slurm_job) in TERMINAL
    fleet.wait_for(lambda: fleet.ours(slurm_job).get("state") == "CANCELLED", "the orphaned job cancelled")
    j = fleet.json("job", job["id"])
    assert j["reason"].startswith(f"cancelled: its Slurm job {slurm_job} ended (") and "phalanx run" in j["reason"], j
    assert j["ranks"] and all(r["state"] != "RUNNING" for r in j["ranks"]), j["ranks"]
    ranks = ["pgrep", "-f", f"{TRAIN} .*--out {tmp_path / 'x'}"]  # nor a warm standby of the job: it is over
    fleet.wait_for(lambda: subprocess.run(ranks, capture_output=True, check=False).returncode == 1,
                   "no rank process left", timeout=30)


def test_the_health_check_drains_a_failing_node_and_resumes_only_what_it_drained(fleet):
    sc = fleet.sc

    def check(node: str) -> str:
        done = fleet.cli("slurm-healthcheck", "--agent-config", str(fleet.agent_config(node)), where=node)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip()

    fleet.wait_for(lambda: check("n2") == "n2: HEALTHY", "the controller's first verdict on n2, pushed to its agent")
    assert fleet.cli("inject", "n2", "--gpu", "1", "remap-pending").returncode == 0
    fleet.wait_for(lambda: "FAILING" in check("n2"), "the agent's verdict on n2 FAILING")
    said = check("n2")
    assert (said.startswith("n2: FAILING (") and said.endswith("drained in Slurm")) or "already drained" in said, said
    info = sc.node_info("n2")
    assert "DRAIN" in info["State"] and info["Reason"].startswith("phalanx-health: FAILING"), info
    assert "already drained in Slurm" in check("n2")  # drained once, not again

    # an operator's drain is theirs: the check leaves it, healthy or not
    sc.scontrol("update", "NodeName=n3", "State=DRAIN", "Reason=maintenance")
    fleet.wait_for(lambda: check("n3") != "n3: UNKNOWN", "a verdict on n3")
    said = check("n3")  # Slurm adds who and when to a reason: "maintenance [root@2026-12-01T15:20:03]"
    assert said.startswith("n3: HEALTHY; drained in Slurm by someone else (maintenance") and "left so" in said, said
    assert "DRAIN" in sc.node_info("n3")["State"]

    assert fleet.cli("inject", "n2", "--gpu", "1", "clear").returncode == 0
    fleet.wait_for(lambda: "resumed in Slurm" in check("n2") or "DRAIN" not in sc.node_info("n2")["State"],
                   "n2 healthy again and resumed")
    assert "DRAIN" not in sc.node_info("n2")["State"]


def test_phalanx_run_outside_slurm_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "cli.main", "run", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "runs inside a Slurm allocation" in done.stderr and "phalanx submit" in done.stderr


def test_when_the_allocation_has_no_spare_left_the_job_ends_saying_so_and_requeues_if_asked(fleet, tmp_path):
    sc = fleet.sc
    slurm_job, job = fleet.sbatch_run(tmp_path, "--requeue", f"--steps 100000 --step-time 0.05 --every 100000 "
                                      f"--out {tmp_path / 'x'}", "-N", "2", "--requeue")
    victim = job["nodes"][0]
    assert fleet.cli("inject", victim, "--gpu", "0", "remap-pending").returncode == 0
    fleet.wait_for(lambda: fleet.json("job", job["id"])["state"] == "FAILED", "the job ended")
    j = fleet.json("job", job["id"])
    assert j["reason"].startswith(f"no healthy node left to replace {victim} in Slurm job {slurm_job}'s allocation")
    kinds = [e["kind"] for e in fleet.json("events", "--job", job["id"])]
    assert kinds.index("job.checkpointed") < kinds.index("job.failed"), kinds  # its work saved before it ended
    # and its node drained in Slurm before it ended: `phalanx run` exits then, and Slurm may requeue at once
    assert kinds.index("job.slurm_drain") < kinds.index("job.failed"), kinds
    # requeued: Slurm runs the script again, on a new allocation that leaves the drained node out
    fleet.wait_for(lambda: int(sc.job_info(slurm_job).get("Restarts", "0")) >= 1, "the Slurm job requeued")
    assert "DRAIN" in sc.node_info(victim)["State"]


def test_the_allocation_comes_from_slurms_environment():
    from phalanx import slurm
    a = slurm.Allocation({"SLURM_JOB_NODELIST": "gpu[001-003],spare7", "SLURM_JOB_ID": "4242"})
    assert (a.nodes, a.job_id) == (["gpu001", "gpu002", "gpu003", "spare7"], "4242")
    with pytest.raises(slurm.SlurmError, match="is not a hostlist"):
        slurm.Allocation({"SLURM_JOB_NODELIST": "gpu[3-1]", "SLURM_JOB_ID": "1"})
    assert slurm.parse_record("NodeName=n2 State=IDLE+DRAIN Reason=phalanx: evicted from job-1 [root@2026] "
                              "Partitions=main")["Reason"] == "phalanx: evicted from job-1 [root@2026]"


def test_a_job_bound_to_an_allocation_is_checked(cluster):
    import grpc

    from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc
    cluster.start_controller()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        for spec, says in ((common_pb2.JobSpec(command=["true"], nodes=2, spares=1, within=["a", "b"]),
                            "within names 2 nodes; the job needs 2 and 1 spares"),
                           (common_pb2.JobSpec(command=["true"], nodes=1, within=["a b"]), "is not a node name"),
                           (common_pb2.JobSpec(command=["true"], nodes=1, within=["a"], slurm_job_id="1;rm"),
                            "is not a Slurm job id")):
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitJob(control_pb2.SubmitJobRequest(spec=spec), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details()


FAKE_SCONTROL = """#!/bin/sh
# scontrol -o show job ID, as the test's state file for ID says: a JobState and a Restarts count
case "$(cat "$0.$4")" in
  gone) echo "slurm_load_jobs error: Invalid job id specified"; exit 1 ;;
  down) echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"; exit 1 ;;
  *) set -- $(cat "$0.$4") "$4"; echo "JobId=$3 JobName=x UserId=root(0) JobState=$1 Reason=None Restarts=$2" ;;
esac
"""


def test_the_controller_cancels_a_job_only_once_slurm_says_its_allocation_has_been_gone_long_enough(tmp_path):
    """controller.jobs.slurm_watch against a stand-in scontrol: Slurm unreachable cancels nothing; an ended Slurm
    job cancels its Phalanx job only after jobs.slurm_orphan_s; so does a Slurm job requeued and running again
    (a new allocation, a new `phalanx run`); a job not in Slurm is never asked about."""
    import asyncio
    from types import SimpleNamespace

    from controller.config import JobsConfig
    from controller.jobs.slurm_watch import SlurmWatch
    from phalanx.clock import FakeClock
    from phalanx.v1 import common_pb2

    scontrol = tmp_path / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    cancelled: list[tuple[str, str]] = []

    async def cancel(job_id: str, why: str) -> None:
        cancelled.append((job_id, why))

    def job(job_id: str, slurm_job: str = "") -> common_pb2.Job:
        j = common_pb2.Job(id=job_id, state=common_pb2.JOB_STATE_RUNNING)
        j.spec.slurm_job_id = slurm_job
        return j

    def slurm_says(slurm_job: str, text: str) -> None:
        Path(f"{scontrol}.{slurm_job}").write_text(text)

    clock = FakeClock()
    jobs = [job("job-7", "4242"), job("job-8"), job("job-9", "4343")]
    fake = SimpleNamespace(entries={j.id: SimpleNamespace(job=j) for j in jobs}, clock=clock, cancel=cancel)
    watch = SlurmWatch(fake, JobsConfig(scontrol=str(scontrol), slurm_orphan_s=60.0))

    async def story() -> None:
        slurm_says("4343", "RUNNING 0")
        for said in ("RUNNING 0", "down", "down"):
            slurm_says("4242", said)
            await watch.tick()
            clock.advance(100.0)
        assert cancelled == []  # a Slurm that cannot be asked says nothing about the job
        slurm_says("4242", "CANCELLED 0")
        slurm_says("4343", "RUNNING 1")  # requeued (its batch host lost) and started again
        await watch.tick()
        clock.advance(59.0)
        await watch.tick()
        assert cancelled == []  # not yet: `phalanx run` may be ending the job itself
        slurm_says("4242", "gone")
        clock.advance(1.0)
        await watch.tick()

    asyncio.run(story())
    assert sorted(j for j, _ in cancelled) == ["job-7", "job-9"], cancelled
    why = dict(cancelled)
    assert why["job-7"].startswith("its Slurm job 4242 ended (no longer known to Slurm) 60s ago or more"), why
    assert why["job-9"].startswith("its Slurm job 4343 ended (requeued: RUNNING again, restart 1)"), why


def test_torchrun_elastic_in_an_sbatch_job_checkpoints_is_drained_and_resumes_on_the_spare_node(fleet, tmp_path,
                                                                                                 reference):
    """torchrun --rdzv-backend=phalanx on each of three Slurm nodes (srun) for a job of two: the third waits as
    the spare. A GPU fault on a member: its trainlib workers checkpoint one agreed step, the health check drains
    the node in Slurm, the round restarts with the spare and ends with the model of an uninterrupted run."""
    from tests.test_torchrun import torchrun
    sc = fleet.sc
    out = tmp_path / "out"
    out.mkdir()
    train = (f"{TRAIN} --steps 100000 --steps-after-resume 40 --step-time 0.02 --no-snapshots "
             f"--out {out / 'checksum'} --out-steps {out / 'steps'} --print-every 1")
    task = (f'PHALANX_NODE=$SLURMD_NODENAME exec {" ".join(torchrun())} --nnodes=2 --nproc-per-node=1 '
            f'--rdzv-backend=phalanx --rdzv-endpoint={fleet.address} --rdzv-id=slurm-$SLURM_JOB_ID '
            '--local-addr=$(hostname -I | cut -d" " -f1) --max-restarts=3 --monitor-interval=0.5 '
            f'--rdzv-conf=join_timeout=120 {train}')
    script = (f"#!/bin/sh\nexport PHALANX_INSECURE=1 GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 "
              f"PHALANX_CHECKPOINT_DIR={tmp_path / 'ckpt'}\nsrun --ntasks-per-node=1 sh -c '{task}'\n")
    slurm_job = sc.sbatch(script, "-N", "3", "-o", str(tmp_path / "slurm-%j.out"), cwd=tmp_path)
    said = tmp_path / f"slurm-{slurm_job}.out"
    fleet.logs["the batch script"] = said
    run_id = f"torchrun-slurm-{slurm_job}"

    def run() -> dict:
        return next((j for j in fleet.json("jobs") if j["id"] == run_id), {})

    fleet.wait_for(lambda: len(run().get("spares", [])) == 1 and said.exists() and "step 5 loss" in said.read_text(),
                   "a round of two training, the third node waiting as the spare")
    first = run()
    victim, spare = first["nodes"][1], first["spares"][0]
    assert fleet.cli("inject", victim, "--gpu", "0", "remap-pending").returncode == 0

    def check() -> str:  # what Slurm's HealthCheckProgram would run on the node
        done = fleet.cli("slurm-healthcheck", "--agent-config", str(fleet.agent_config(victim)), where=victim)
        return done.stdout.strip()

    fleet.wait_for(lambda: "FAILING" in check(), f"the health check on {victim} finding it FAILING")
    assert "DRAIN" in sc.node_info(victim)["State"] and sc.node_info(victim)["Reason"].startswith("phalanx-health:")
    fleet.wait_for(lambda: (out / "steps").exists(), "the training to end on the new round", timeout=300)
    sc.wait_job(slurm_job, timeout=180)
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in fleet.json("events", "--job", run_id))
    asked = next(line for line in story.splitlines() if line.startswith("rendezvous.checkpoint:"))
    at_step = int(asked.split("after step ")[1].split()[0])
    assert f"without node {victim} (it is FAILING" in asked, story
    assert f"every worker (2) committed the checkpoint of step {at_step}" in story, story
    formed = [line for line in story.splitlines() if line.startswith("rendezvous.formed:")]
    assert len(formed) == 2 and spare in formed[1] and victim not in formed[1], story
    steps = int((out / "steps").read_text())
    assert steps == at_step + 1 + 40, story  # resumed after the agreed step: none computed twice
    assert (out / "checksum").read_text().strip() == reference(steps)
