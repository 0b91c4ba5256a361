"""The few Linux system calls the pod agent needs, through ctypes (standard library only).

The agent runs with `python -E -s -S`, so this module must not import anything outside the standard library.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = [
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "MNT_DETACH",
    "MS_BIND",
    "MS_NODEV",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_RDONLY",
    "MS_REC",
    "MS_REMOUNT",
    "MS_SLAVE",
    "mount",
    "pivot_root",
    "sethostname",
    "setns",
    "umount",
    "unshare",
]

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
        f"mount {source!r} on {target!r} (type {fstype}, flags {flags:#x}, data {data!r})",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target!r}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), f"setns({fd}, {nstype:#x})")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: no system call number known for {platform.machine()}")
    _check(_libc.syscall(number, _b(new_root), _b(put_old)), f"pivot_root({new_root!r}, {put_old!r})")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), f"sethostname({name!r})")
