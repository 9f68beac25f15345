"""Paths a tenant can write, handled by a root agent without following them (STYLE.md 14, issue 39).

The agent runs as root; the ranks beside it run as their jobs' accounts and may create links, FIFOs and
directories of their own wherever they may write. The agent therefore never hands such a path to a call that
follows it: it opens a directory it owns, walks down one component at a time with O_NOFOLLOW (a link at any
component is refused, not followed), and acts on what it opened, by descriptor: `fstat` says what the file is
and whose, `unlinkat` removes a name in the directory it checked, a file it creates there is O_EXCL.

`secure_dir` is the start-up half: the tree the agent keeps its files in is made or checked component by
component from `/`, so that no account but root (or the agent's own) can replace any part of it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never hangs the open


class UnsafePath(OSError):
    """A path the agent will not use: a link, another account's, or writable by others. The message says which."""


def trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def secure_dir(path: Path, mode: int = 0o755) -> None:
    """Make `path` (absolute) a directory only root or this process's user can change, creating what is missing
    with `mode`. Every existing component must be a directory (or a link owned by root or this user, as
    /var/run is) owned by root or this user; one writable by others must be sticky (as /tmp or /dev/shm is: then
    only its owner may replace the next component, which is checked next). The directory itself, once made, must
    not be writable by group or others. Raises UnsafePath naming the component and what is wrong with it."""
    if not path.is_absolute():
        raise UnsafePath(f"{path} is not an absolute path")
    trusted = trusted_uids()
    # links on the way are followed only if their owner is trusted (as the kernel's protected_symlinks would)
    walked = Path("/")
    for part in path.parts[1:]:
        walked = walked / part
        try:
            st = os.lstat(walked)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise UnsafePath(f"{walked} is a link owned by uid {st.st_uid}, not by root: the agent does not follow it "
                             "(remove it, or point the setting at a directory only root can change)")
    resolved = Path(os.path.realpath(path))
    current = Path("/")
    _check_component(current, os.lstat(current), last=False)
    for part in resolved.parts[1:]:
        current = current / part
        try:
            os.mkdir(current, mode)
        except FileExistsError:
            pass
        st = os.lstat(current)
        _check_component(current, st, last=current == resolved)


def _check_component(path: Path, st: os.stat_result, last: bool) -> None:
    if stat.S_ISLNK(st.st_mode):  # made a link since it was resolved: someone races the agent
        raise UnsafePath(f"{path} became a link while the agent checked it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if st.st_uid not in trusted_uids():
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by root or the agent's user: another account "
                         "made it (remove it, or choose a directory only root can change)")
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and (last or not st.st_mode & stat.S_ISVTX):
        raise UnsafePath(f"{path} is writable by other accounts (mode {stat.S_IMODE(st.st_mode):04o})"
                         + (": the agent's own directory must not be" if last else " and not sticky"))


def open_dir(path: Path) -> int:
    """A descriptor of the directory `path` itself (a link there is refused). Raises OSError."""
    return os.open(path, DIR_FLAGS)


def walk(base_fd: int, parts: Sequence[str], create: int | None = None) -> int:
    """The descriptor of directory base/parts[0]/parts[1]/..., each component opened with O_NOFOLLOW beneath the
    one before (so no link anywhere in it is followed); components missing are made with mode `create` when given.
    Raises OSError: ELOOP or ENOTDIR for a link or a file in the way, ENOENT for one missing."""
    fd = os.dup(base_fd)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise UnsafePath(f"{part!r} is not a single path component")
            if create is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, create, dir_fd=fd)
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(dir_fd: int, name: str, owner: int | None = None) -> int:
    """A read descriptor of the regular file `name` in `dir_fd` (owned by `owner`, when given). A link, FIFO,
    device or another account's file there is refused with UnsafePath. Raises OSError."""
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{name} is not a regular file")
        if owner is not None and st.st_uid != owner:
            raise UnsafePath(f"{name} is owned by uid {st.st_uid}, not by the job's account (uid {owner})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_in(dir_fd: int, name: str) -> None:
    """Remove the name `name` in `dir_fd` (a link is removed, never what it points to); gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


@contextlib.contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)
