"""The base error of everything Phalanx raises on purpose."""


class PhalanxError(Exception):
    """Base class; each package derives its own."""


class ConfigError(PhalanxError):
    """A configuration file or value is wrong. The message is one line a person can act on."""


class BadRequest(PhalanxError):
    """A request that cannot be decoded or is over the size limit (phalanx.request_guard): INVALID_ARGUMENT."""
