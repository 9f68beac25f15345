"""Controller errors. Each maps to its own gRPC status in controller/rpc.py."""

from phalanx.errors import PhalanxError

# gRPC carries a status message in a trailer, percent-encoded (up to 12 bytes a character), and clients refuse
# trailers over 8 KiB: a longer message would reach the caller as RESOURCE_EXHAUSTED instead of itself.
MAX_DETAILS_CHARS = 500


def details(message: str) -> str:
    """A status message short enough to arrive: messages cut what they quote, this is the backstop."""
    return message if len(message) <= MAX_DETAILS_CHARS else message[:MAX_DETAILS_CHARS - 3] + "..."


class ControllerError(PhalanxError):
    """Base of every error the controller raises on purpose."""


class InvalidArgument(ControllerError):
    """The request itself is wrong; retrying it unchanged will fail again."""


class NotFound(ControllerError):
    """The request names something the controller does not know."""


class FailedPrecondition(ControllerError):
    """The request is well-formed but the system is not in a state that allows it."""


class Unavailable(ControllerError):
    """This controller cannot serve the request now (its leadership lapsed); another one may."""


class AlreadyInSession(ControllerError):
    """A parked session for a node already in session with this controller: the open one stays."""


class PermissionDenied(ControllerError):
    """The caller is authenticated but not allowed to do this (e.g. a node acting as another)."""


class IllegalTransition(ControllerError):
    """A state change the transition table does not allow: a bug in a caller, never user input."""

    def __init__(self, what: str, source: object, target: object) -> None:
        super().__init__(f"{what}: illegal transition {source} -> {target}")
        self.source = source
        self.target = target


class StoreError(ControllerError):
    """The store could not do what was asked; recoverable (retry later)."""


class RevisionConflict(StoreError):
    """Compare-and-set failed: someone else changed the record since it was read."""

    def __init__(self, key: str, expected: int, actual: int) -> None:
        super().__init__(f"{key}: expected revision {expected}, store has {actual}")
        self.key = key
        self.expected = expected
        self.actual = actual
