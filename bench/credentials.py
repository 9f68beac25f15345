"""Enrolment and revocation against real daemons on mutual TLS (issue 14).

Per trial: a bootstrap token; a node enrols with it (`phalanx certs enrol`'s code, in process: fetching the CA
over the token port, checking its hash, a key, a request, the signature) and its agent starts with the files;
once the agent's session is open, its certificate is revoked and the time until the controller shows the node
disconnected is measured (polled every 5 ms). The goal: revocation cuts a live agent within a second.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.common import log, temp_root
from cli import enrol
from phalanx import pki
from phalanx.ports import free_port
from phalanx.v1 import control_pb2
from tests.cluster import Cluster

GOAL_S = 1.0


def run(trials: int = 5) -> dict:
    with temp_root(prefix="phalanx-bench-creds-") as tmp:
        root = Path(tmp)
        ca = root / "pki"
        pki.init_ca(ca, cluster="bench")
        cluster = Cluster(root / "cluster", pki=ca)
        cluster.root.mkdir()
        token_address = f"127.0.0.1:{free_port()}"
        cluster.start_controller(f'[security]\nca_file = "{ca / "ca.crt"}"\ncert_file = "{ca / "controller.crt"}"\n'
                                 f'key_file = "{ca / "controller.key"}"\nca_key_file = "{ca / "ca.key"}"\n'
                                 f'token_listen = "{token_address}"\n')
        enrols, cuts = [], []
        try:
            reply = cluster.control.CreateEnrolToken(control_pb2.CreateEnrolTokenRequest(ttl_s=3600), timeout=10)
            for trial in range(trials):
                name, node_dir = f"bench-enrol-{trial}", root / f"node-{trial}"
                t0 = time.perf_counter()
                enrol.enrol(token_address, reply.token, reply.ca_hash, name, str(node_dir))
                enrols.append(time.perf_counter() - t0)
                cluster.start_agent(name, gpus=1, extra=f'[security]\nca_file = "{node_dir / "ca.crt"}"\n'
                                                        f'cert_file = "{node_dir / "node.crt"}"\n'
                                                        f'key_file = "{node_dir / "node.key"}"\n')
                cluster.wait_for(lambda name=name: _connected(cluster, name), f"{name} connected")
                t0 = time.perf_counter()
                cluster.control.RevokeCertificate(control_pb2.RevokeCertificateRequest(name=name, reason="bench"),
                                                  timeout=10)
                while _connected(cluster, name):
                    time.sleep(0.005)
                cuts.append(time.perf_counter() - t0)
                log(f"credentials: trial {trial + 1}: enrol {enrols[-1] * 1000:.0f} ms, revocation to cut "
                    f"{cuts[-1] * 1000:.0f} ms")
                cluster.kill(name)
        finally:
            cluster.close()
    return {"trials": trials, "goal_s": GOAL_S,
            "enrol_median_s": statistics.median(enrols), "enrol_max_s": max(enrols),
            "revoke_cut_median_s": statistics.median(cuts), "revoke_cut_max_s": max(cuts)}


def _connected(cluster: Cluster, name: str) -> bool:
    try:
        return cluster.node(name).connected
    except Exception:  # not registered yet
        return False
