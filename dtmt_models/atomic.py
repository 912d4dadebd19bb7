"""Atomic file writes, the one way the package writes a result file (checkpoints, corpora, translations,
reports, logs' companions, figures).

The content goes to a temporary file in the target's directory, is flushed and fsynced, then renamed over the
target: a reader sees the old file or the new one, never a half-written one, and a crash or a kill leaves the
old file intact. A target that is a device or a pipe (/dev/null, /dev/stdout, a FIFO) is written in place; a
command's output through a symbolic link replaces the link's target (`through_link`); a file replaced keeps its
permissions. If writing fails (a full disk, a read-only directory, an exception in the caller's code), the
temporary file is removed and the previous file is untouched; an OS error comes back as `WriteError`, whose
message is one line naming the file and the system's reason.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from typing import IO, Iterator, List, Optional, Pattern, Sequence


class WriteError(OSError):
    """A result file could not be written; the message names it and says why, in one line. The file's
    previous content, if any, is intact and no temporary file is left."""


# The temporaries this package's writers name, matched whole (nothing else is removed as one: the loose pattern
# before took a user's `.backup.tmp-20240101` folder or `.notes.tmp1234.bak`): an atomic write's ".NAME.tmpPID", with
# NAME's own extension after it for writers that pick the format from the name (".curve.png.tmp12.png"); prepare's
# stage ".prepare.tmp-PID"; a binarized copy's build or set-aside folder ".bin-SETTINGS.tmp-PID". PID is a process
# id Linux can give (at most PID_MAX_LIMIT, 2^22).
_ATOMIC_TMP = re.compile(r"\.(?P<name>.+)\.tmp(?P<pid>[1-9][0-9]{0,6})(?P<ext>\.[A-Za-z0-9]+)?")
_FOLDER_TMP = re.compile(r"\.(?:prepare|bin-.+)\.tmp-(?P<pid>[1-9][0-9]{0,6})")
_PID_MAX_LIMIT = 1 << 22


def temporary_pid(name: str) -> Optional[int]:
    """The process id in `name` where it is the name of one of this package's temporaries (see above), else None."""
    m = _FOLDER_TMP.fullmatch(name)
    if m is None:
        m = _ATOMIC_TMP.fullmatch(name)
        if m is None or (m["ext"] is not None and m["ext"].lower() != os.path.splitext(m["name"])[1].lower()):
            return None
    pid = int(m["pid"])
    return pid if pid <= _PID_MAX_LIMIT else None


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def remove_stale_temporaries(directory: str, keep: Optional[Pattern[str]] = None,
                             folders_only: bool = False, files: Optional[Pattern[str]] = None) -> List[str]:
    """Removes the temporaries that an interrupted writer left in `directory` (an atomic write's file, a binarized
    corpus' build folder: named after their process) whose process is gone; those of a running process stay, and
    those whose name `keep` matches whole. A command calls it on the folders it writes before it writes them (`dtmt
    prepare` killed midway left tens of MB that a later successful run kept). `folders_only`: only prepare's stage
    and binarized build folders, for a folder the caller writes no file into with an atomic write (a user's
    `.backup.tmp99999` there had been removed). `files`: an atomic write's temporary only of a file whose name it
    matches whole (the files the caller writes there: a user's `.thesis.tmp4000000` in a run's folder had been
    removed). An atomic write's temporary is a file: a folder of such a name is never removed (one was, whole).
    Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = temporary_pid(name) if not folders_only or _FOLDER_TMP.fullmatch(name) else None
        if pid is None or process_alive(pid) or (keep is not None and keep.fullmatch(name)):
            continue
        path = os.path.join(directory, name)
        atomic = _FOLDER_TMP.fullmatch(name) is None
        if atomic and (os.path.isdir(path) and not os.path.islink(path)
                       or files is not None and not files.fullmatch(_ATOMIC_TMP.fullmatch(name)["name"])):
            continue
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def _tmp_name(path: str, suffix: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.tmp{os.getpid()}{suffix}")


def is_stream(path: str) -> bool:
    """Whether `path` is written in place as a stream, not atomically: a device or a pipe (-o /dev/null, a FIFO;
    /dev/stdout even where it leads to a file), where there is nothing to rename (a rename would replace
    /dev/stdout's link itself). A file in a folder under /dev (/dev/shm's tmpfs) is a file: written atomically, as
    anywhere (checkpoints there were rewritten in place)."""
    return os.path.exists(path) and (not os.path.isfile(path) and not os.path.isdir(path)
                                     or os.path.abspath(path).startswith(("/dev/", "/proc/")) and os.path.islink(path))


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "", through_link: bool = False) -> Iterator[str]:
    """Yields a temporary path to write `path`'s new content to (by any means, e.g. `fig.savefig(tmp)`); on a
    normal exit it is renamed over `path`. `suffix` ends the temporary name (for writers that pick a format
    from it). `through_link`: a `path` that is a symbolic link has its target replaced, as a shell's `>` does (a
    command's output the user names); else the link itself is (a run's or a corpus' file linked to a shared copy
    leaves the copy alone)."""
    path = os.fspath(path)
    if is_stream(path):   # (written in place, nothing to rename)
        try:
            yield path
        except WriteError:
            raise
        except OSError as exc:
            raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from None
        return
    if through_link and os.path.islink(path):
        path = os.path.realpath(path)
    tmp = _tmp_name(path, suffix)
    try:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        yield tmp
        _put_in_place(tmp, path)
    except WriteError:   # from a nested atomic write: already says which file and why
        raise
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc.strerror or exc} (nothing written; any earlier version of "
                         f"the file is intact)") from None
    finally:
        _remove_left(tmp)


def _put_in_place(tmp: str, path: str) -> None:
    """The written temporary `tmp` renamed over `path`, with the permissions of the file it replaces (a private 600
    file became 644), where there is one and the file system takes modes."""
    with contextlib.suppress(OSError):
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    os.replace(tmp, path)


def _remove_left(tmp: str) -> None:
    """A temporary that was not put in place (a failure, or a caller that wrote none) removed, quietly."""
    with contextlib.suppress(OSError):
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_paths(paths: Sequence[str], suffixes: Optional[Sequence[str]] = None,
                 through_link: bool = False) -> Iterator[List[str]]:
    """atomic_path for files written as one set (a command's results): yields their temporary paths; on a normal
    exit each one written is renamed over its path, after all were written (a failure while writing any leaves
    every earlier version in place, not a new file beside an old one). A temporary left unwritten leaves its path
    as it was. `suffixes` end the temporary names; `through_link` as atomic_path's."""
    targets = [os.path.realpath(p) if through_link and os.path.islink(p) else os.fspath(p) for p in paths]
    temps = [_tmp_name(path, suffix) for path, suffix in zip(targets, suffixes or [""] * len(targets))]
    what = ", ".join(os.path.basename(p) for p in targets)   # (which of them failed, the caller's writing does not
    try:                                                      # say: all are named)
        for path in targets:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        yield temps
        for tmp, path in zip(temps, targets):
            what = path
            if os.path.exists(tmp):
                _put_in_place(tmp, path)
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(f"cannot write {what}: {exc.strerror or exc}") from None
    finally:
        for tmp in temps:
            _remove_left(tmp)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", through_link: bool = False) -> Iterator[IO]:
    """`with atomic_write(path) as f: f.write(...)`: text mode writes UTF-8 with "\\n" line ends; mode "wb"
    gives a binary file. The file is fsynced before it replaces `path` (`through_link`: atomic_path's)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path, through_link=through_link) as tmp:
        with open(tmp, mode, **({} if mode == "wb" else {"encoding": "utf-8", "newline": "\n"})) as f:
            yield f
            f.flush()
            if os.path.isfile(tmp):   # (a device or a pipe written in place has nothing to sync)
                os.fsync(f.fileno())
