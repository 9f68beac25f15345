"""Checks on what arrives over the wire. Each raises InvalidArgument with a message a person can act on."""

from __future__ import annotations

import re
from collections.abc import Iterable

from google.protobuf.message import Message

from controller.errors import InvalidArgument
from controller.nodes.states import NodeState
from phalanx.names import NAME
from phalanx.rpc import MAX_EVENTS_PAGE, MAX_REQUEST_BYTES
from phalanx.v1 import common_pb2

_JOB_NAME = NAME
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_JOB_NODES = 100_000

_NODE_NAME = NAME
_JOB_ID = _NODE_NAME  # the controller makes them: job-N
MAX_GPUS = 64
MAX_LABELS = 64
MAX_LABEL_CHARS = 253
MAX_REASON_CHARS = 1000


def request_size(request: Message) -> None:
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise InvalidArgument(f"{type(request).__name__} is {size} bytes; the limit is {MAX_REQUEST_BYTES}")


def node_name(value: str, field: str = "node_name") -> str:
    if not value:
        raise InvalidArgument(f"{field} is empty; give the node's name")
    if not _NODE_NAME.fullmatch(value):
        raise InvalidArgument(f"{field} {shown(value)!r} is not a valid node name: 1-63 characters of letters, "
                              "digits, '.', '_' or '-', starting with a letter or digit")
    return value


def job_id(value: str, field: str = "id") -> str:
    if not value:
        raise InvalidArgument(f"{field} is empty; give the job's id (`phalanx jobs` lists them)")
    if not _JOB_ID.fullmatch(value):
        raise InvalidArgument(f"{field} {shown(value)!r} is not a job id: ids look like job-17 (`phalanx jobs` "
                              "lists them)")
    return value


def shown(value: str, limit: int = 80) -> str:
    """`value` cut to `limit` characters for a message: a status message must stay short (controller/rpc.py)."""
    return value if len(value) <= limit else value[:limit - 3] + "..."


def inventory(inv: common_pb2.NodeInventory) -> None:
    if inv.gpu_backend not in common_pb2.GpuBackendKind.values():
        raise InvalidArgument(f"inventory.gpu_backend {inv.gpu_backend} is not a known GpuBackendKind")
    if inv.gpu_backend == common_pb2.GPU_BACKEND_KIND_UNSPECIFIED:
        raise InvalidArgument("inventory.gpu_backend is unspecified; say NONE, SIM or NVML")
    if len(inv.gpus) > MAX_GPUS:
        raise InvalidArgument(f"inventory lists {len(inv.gpus)} GPUs; the limit is {MAX_GPUS}")
    indexes = [g.index for g in inv.gpus]
    if len(set(indexes)) != len(indexes):
        raise InvalidArgument(f"inventory repeats a GPU index: {sorted(indexes)}")
    if len(inv.labels) > MAX_LABELS:
        raise InvalidArgument(f"inventory has {len(inv.labels)} labels; the limit is {MAX_LABELS}")
    for key, value in inv.labels.items():
        if not key or len(key) > MAX_LABEL_CHARS or len(value) > MAX_LABEL_CHARS:
            raise InvalidArgument(f"label {key[:40]!r}: keys must be 1-{MAX_LABEL_CHARS} characters and values "
                                  f"at most {MAX_LABEL_CHARS}")


def reason(text: str) -> str:
    text = text.strip()
    if not text:
        raise InvalidArgument("reason is empty; say why the node is drained (it is kept and shown to everyone)")
    if len(text) > MAX_REASON_CHARS:
        raise InvalidArgument(f"reason is {len(text)} characters; the limit is {MAX_REASON_CHARS}")
    if any(ch in text for ch in "\r\n\x00"):
        raise InvalidArgument("reason must be one line")
    return text


def node_states(values: Iterable[int]) -> set[NodeState]:
    states = set()
    for value in values:
        try:
            states.add(NodeState.from_proto(value))
        except ValueError:
            known = ", ".join(s.value for s in NodeState)
            raise InvalidArgument(f"states: {value} is not a node state (known: {known})") from None
    return states


def page_limit(limit: int, default: int = 1000) -> int:
    if limit == 0:
        return default
    if limit > MAX_EVENTS_PAGE:
        raise InvalidArgument(f"limit {limit} is larger than {MAX_EVENTS_PAGE}")
    return limit


def job_spec(spec: common_pb2.JobSpec) -> None:
    if spec.nodes < 1:
        raise InvalidArgument(f"nodes must be at least 1 (got {spec.nodes})")
    if spec.nodes > MAX_JOB_NODES:
        raise InvalidArgument(f"nodes ({spec.nodes}) is more than {MAX_JOB_NODES}")
    if spec.ranks_per_node > MAX_GPUS:
        raise InvalidArgument(f"ranks_per_node ({spec.ranks_per_node}) is more than {MAX_GPUS}")
    if spec.spares > MAX_JOB_NODES:
        raise InvalidArgument(f"spares ({spec.spares}) is more than {MAX_JOB_NODES}")
    if not spec.command or not spec.command[0]:
        raise InvalidArgument("command is empty; give the program to run, e.g. -- python train.py")
    if spec.name and not _JOB_NAME.fullmatch(spec.name):
        raise InvalidArgument(f"name {spec.name[:80]!r} must be 1-63 letters, digits, '.', '_' or '-'")
    if spec.segment and spec.nodes % spec.segment:
        raise InvalidArgument(f"nodes ({spec.nodes}) must be a multiple of segment ({spec.segment})")
    if spec.replicas > 1 and spec.nodes % spec.replicas:
        raise InvalidArgument(f"nodes ({spec.nodes}) must be a multiple of replicas ({spec.replicas}): each replica "
                              "group gets as many nodes")
    for key in spec.env:
        if not _ENV_KEY.fullmatch(key):
            raise InvalidArgument(f"environment variable name {key[:80]!r} is not valid")
    if not -1000 <= spec.priority <= 1000:
        raise InvalidArgument(f"priority ({spec.priority}) must be between -1000 and 1000")
    if spec.within and len(spec.within) < spec.nodes + spec.spares:
        raise InvalidArgument(f"within names {len(spec.within)} nodes; the job needs {spec.nodes} and {spec.spares} "
                              "spares")
    for name in spec.within:
        if not _NODE_NAME.fullmatch(name):
            raise InvalidArgument(f"within: {name[:80]!r} is not a node name")
    if len(set(spec.within)) != len(spec.within):
        raise InvalidArgument("within names a node twice")
    if spec.slurm_job_id and not spec.within:
        raise InvalidArgument("slurm_job_id needs within (the allocation's nodes): `phalanx run` sets both")
    if len(spec.within) > 2 * MAX_JOB_NODES:
        raise InvalidArgument(f"within names {len(spec.within)} nodes; the limit is {2 * MAX_JOB_NODES}")
    if spec.slurm_job_id and (len(spec.slurm_job_id) > 64 or not spec.slurm_job_id.isascii()
                              or not spec.slurm_job_id.replace("_", "").isalnum()):
        raise InvalidArgument(f"slurm_job_id {spec.slurm_job_id[:80]!r} is not a Slurm job id")
    limits = spec.limits
    if limits.memory_bytes and limits.memory_bytes < MIN_MEMORY:
        raise InvalidArgument(f"limits.memory_bytes ({limits.memory_bytes}) is less than {MIN_MEMORY >> 20} MiB: "
                              "a rank's Python alone needs more")
    if limits.tasks and limits.tasks < MIN_TASKS:
        raise InvalidArgument(f"limits.tasks ({limits.tasks}) is less than {MIN_TASKS}: a rank and its wrapper "
                              "need that many processes and threads")
    if limits.open_files and not MIN_OPEN_FILES <= limits.open_files <= MAX_OPEN_FILES:
        raise InvalidArgument(f"limits.open_files ({limits.open_files}) must be between {MIN_OPEN_FILES} and "
                              f"{MAX_OPEN_FILES}")


MIN_MEMORY = 64 << 20
MIN_TASKS = 8
MIN_OPEN_FILES, MAX_OPEN_FILES = 64, 1 << 20  # 2**20: Linux's default fs.nr_open


MAX_LOG_CHUNK = 1 << 20


def log_chunk(max_bytes: int) -> int:
    if max_bytes > MAX_LOG_CHUNK:
        raise InvalidArgument(f"max_bytes ({max_bytes}) is more than {MAX_LOG_CHUNK}")
    return max_bytes or MAX_LOG_CHUNK
