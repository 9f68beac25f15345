"""Who may do what on the control API, and run as whom: the access file (`security.access_file`), in one place.

    [identities.alice]          # an identity: a client certificate's name (CN) or a token's name
    role = "admin"              # admin, user or viewer
    accounts = ["alice"]        # local accounts its jobs may run as; the first is the default (`submit --as`)

    [identities.ci-bot]
    role = "user"
    accounts = ["ci"]

    [identities.grafana]
    role = "viewer"

    [identities.ops]
    role = "admin"
    accounts = ["root"]
    allow_root = true           # root only where said so

Roles: `viewer` reads (nodes, health, topology, jobs, events, stats); `user` also submits jobs and cancels,
checkpoints and reads the logs of its own; `admin` may do anything (drain, undrain, inject, certificates, any
job). An identity not in the file gets nothing. Without an access file every authenticated client is an admin
and ranks run as the agent's user (a trial cluster; the controller says so when it starts).

Every ControlService method is in METHODS (a test checks the table against the .proto).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from controller.errors import PermissionDenied
from phalanx import config
from phalanx.errors import ConfigError
from phalanx.names import NAME

VIEWER, USER, ADMIN = "viewer", "user", "admin"
OWN = "own"  # a user for their own jobs, an admin for any
ROLES = (VIEWER, USER, ADMIN)
_RANK = {VIEWER: 0, USER: 1, OWN: 1, ADMIN: 2}

# ControlService method -> what it takes
METHODS: dict[str, str] = {
    "ListNodes": VIEWER, "GetNode": VIEWER, "ListEvents": VIEWER, "WatchEvents": VIEWER, "GetStats": VIEWER,
    "GetHealth": VIEWER, "GetTopology": VIEWER, "ListJobs": VIEWER, "GetJob": VIEWER, "ListControllers": VIEWER,
    "SubmitJob": USER,
    "CancelJob": OWN, "CheckpointJob": OWN, "ReadLogs": OWN,
    "DrainNode": ADMIN, "UndrainNode": ADMIN, "InjectFault": ADMIN, "CreateEnrolToken": ADMIN,
    "RevokeCertificate": ADMIN,
}
# RendezvousService method -> what it takes: a torchrun run is a job, its rounds a user's (or an admin's); the
# identity that first joins a run owns it, and only it or an admin may join, report to or close it (the service
# checks the owner: `require_owner`). Node certificates take no part once an access file is in force.
RENDEZVOUS_METHODS: dict[str, str] = {
    "Join": USER, "AwaitRound": USER, "NumNodesWaiting": USER, "SetClosed": USER, "Leave": USER,
    "ReportWorker": USER, "GetRun": VIEWER,
}


@dataclass(frozen=True)
class Identity:
    name: str
    role: str
    accounts: tuple[str, ...] = ()
    allow_root: bool = False


@dataclass(frozen=True)
class Policy:
    identities: dict[str, Identity]
    source: str

    def identity(self, name: str) -> Identity:
        found = self.identities.get(name)
        if found is None:
            raise PermissionDenied(f"identity {name!r} has no entry in the access file {self.source}: an administrator "
                                   f"adds [identities.{name}] with a role (admin, user or viewer)")
        return found

    def admit(self, name: str, method: str, table: dict[str, str] = METHODS) -> Identity:
        """The caller's identity if its role may call `method` (of the service whose rules `table` holds); raises
        PermissionDenied naming the rule."""
        who = self.identity(name)
        need = table.get(method, ADMIN)
        if _RANK[who.role] < _RANK[need]:
            what = {VIEWER: "viewers and above", USER: "users and admins", OWN: "a job's owner or an admin",
                    ADMIN: "admins"}[need]
            raise PermissionDenied(f"{name!r} is a {who.role}; {method} is for {what}")
        return who

    def launchable(self, user: str, run_as: str) -> str:
        """'' if a job of `user` may run as `run_as` now; else why not. Checked at every launch, not only at
        submit: the stored record is not trusted (anything that could write the store could have set it), and
        the access file may have changed since."""
        try:
            who = self.identity(user)
            if _RANK[who.role] < _RANK[USER]:
                raise PermissionDenied(f"{user!r} is a {who.role} and runs no jobs")
            if not run_as:
                raise PermissionDenied("the job names no account to run as (every job does under an access file)")
            if self.account(who, run_as) != run_as:
                raise PermissionDenied(f"{user!r} may not run jobs as {run_as!r}")
        except PermissionDenied as e:
            return f"not launched: {e}"
        return ""

    def account(self, who: Identity, asked: str) -> str:
        """The account a job of `who` runs as (`asked`, or its default). Raises PermissionDenied."""
        if not who.accounts:
            raise PermissionDenied(f"{who.name!r} may not run jobs: no accounts in the access file {self.source}")
        account = asked or who.accounts[0]
        if account not in who.accounts:
            raise PermissionDenied(f"{who.name!r} may run jobs as {', '.join(who.accounts)}, not {account!r}")
        if account == "root" and not who.allow_root:
            raise PermissionDenied(f"{who.name!r} may not run jobs as root (allow_root = true in the access file)")
        return account


def load(path: str) -> Policy | None:
    """The policy in the access file at `path`; None for "" (no file: every client an admin). Raises ConfigError
    naming the file, the identity and the rule."""
    if not path:
        return None
    data = config.read_toml(path)
    unknown = sorted(set(data) - {"identities"})
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: identities)")
    tables = data.get("identities", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: identities must be tables ([identities.NAME])")
    identities = {}
    for name, t in tables.items():
        where = f"{path}: identities.{name}"
        if not NAME.fullmatch(name) or not isinstance(t, dict):
            raise ConfigError(f"{where}: an identity is [identities.NAME], NAME a certificate's or a token's name")
        extra = sorted(set(t) - {"role", "accounts", "allow_root"})
        if extra:
            raise ConfigError(f"{where}: unknown key {extra[0]!r} (known: role, accounts, allow_root)")
        role = t.get("role")
        if role not in ROLES:
            raise ConfigError(f"{where}.role ({role!r}) must be one of: {', '.join(ROLES)}")
        accounts = t.get("accounts", [])
        if not isinstance(accounts, list) or not all(isinstance(a, str) and a for a in accounts):
            raise ConfigError(f"{where}.accounts must be a list of local account names")
        allow_root = t.get("allow_root", False)
        if not isinstance(allow_root, bool):
            raise ConfigError(f"{where}.allow_root must be true or false")
        if "root" in accounts and not allow_root:
            raise ConfigError(f"{where}: accounts name root; say allow_root = true if that is meant")
        if accounts and role == VIEWER:
            raise ConfigError(f"{where}: a viewer runs no jobs; accounts are for users and admins")
        identities[name] = Identity(name, role, tuple(accounts), allow_root)
    return Policy(identities, str(Path(path)))


# -- who is acting: the events a person causes say so (audit) ------------------------------------------

_actor: contextvars.ContextVar[str] = contextvars.ContextVar("phalanx_actor", default="")
_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("phalanx_identity", default=None)
AUDITED = frozenset({"node.drain", "node.undrain", "node.inject", "job.submitted", "job.cancelling",
                     "job.checkpoint"})


@contextmanager
def acting(name: str):
    """Events of AUDITED kinds made inside carry `by = name`."""
    token = _actor.set(name)
    try:
        yield
    finally:
        _actor.reset(token)


def by(kind: str) -> dict[str, str]:
    """The `by` field for an event of `kind` made now: {"by": NAME} inside `acting`, for a kind a person causes."""
    actor = _actor.get()
    return {"by": actor} if actor and kind in AUDITED else {}


def set_caller(identity: Identity | None) -> None:
    _caller.set(identity)


def caller() -> Identity | None:
    """The calling identity of this RPC, when an access file is in force."""
    return _caller.get()


def require_owner(job_user: str, job_id: str) -> None:
    """Raise PermissionDenied unless the caller may act on a job of `job_user` (its own, or an admin)."""
    who = caller()
    if who is None or who.role == ADMIN or who.name == job_user:
        return
    raise PermissionDenied(f"{job_id} belongs to {job_user!r}; {who.name!r} is a {who.role} and may act only on its "
                           "own jobs (admins on any)")
