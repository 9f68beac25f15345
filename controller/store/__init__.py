"""The controller's persistence: one interface, an in-memory fake and SQLite.

The interface is shaped for a later etcd implementation (highly available controller):
- every node record carries a `revision`; `commit` is a compare-and-set transaction over any
  number of records plus event appends (an etcd Txn with mod_revision compares);
- revisions come from one store-wide counter, like etcd's;
- events get increasing sequence numbers and are read back by `after_seq`, the shape of a watch.
"""

from controller.store.base import Committed, CredentialRecord, EventRecord, JobRecord, NodeRecord, Store
from controller.store.memory import MemoryStore
from controller.store.sqlite import SqliteStore

__all__ = ["Committed", "CredentialRecord", "EventRecord", "JobRecord", "MemoryStore", "NodeRecord", "SqliteStore",
           "Store"]
