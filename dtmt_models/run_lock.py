"""One run per directory (issue 71 item 6): `dtmt train` holds an exclusive lock on its --out for as long as it
runs, so that a second run started on the same directory is refused in one line that names the first one's process,
instead of both writing last.pt, best.pt and config.yaml and interleaving train_log.csv. `dtmt prepare` holds its
own on the corpus folder it writes (two prepares moving their corpora into one folder could leave one's text beside
the other's binarized copy).

The lock is flock(2) on OUT/.dtmt-train.lock (OUT/.dtmt-prepare.lock), which holds the holder's process id and is
removed when the holder lets the directory go. The kernel releases the lock when the process ends, however it ends (a
kill, a crash), so a lock file left by a killed run never blocks a later one. A run refused before it wrote
anything, in a directory it made itself, leaves no directory behind.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import Optional

LOCK_NAME = ".dtmt-train.lock"
PREPARE_LOCK_NAME = ".dtmt-prepare.lock"


class RunLocked(ValueError):
    """Another process holds the run directory's lock, or the directory cannot be written."""


class RunLock:
    """The lock of one run directory: `acquire()` (makes the directory if needed), `release(discard)`. `option`
    and `command` name the directory and its holder in the refusal; `name` is the lock file's."""

    def __init__(self, directory: str, option: str = "--out", command: str = "dtmt train", name: str = LOCK_NAME):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, name)
        self.option, self.command = option, command
        self.fd: Optional[int] = None
        self.made: list = []

    def acquire(self) -> "RunLock":
        self.made = []   # the folders this makes, deepest first (removed again on a discarding release)
        folder = self.directory
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            self.made.append(folder)
            folder = os.path.dirname(folder)
        failed: Optional[OSError] = None
        for _ in range(16):
            try:
                os.makedirs(self.directory, exist_ok=True)
                # (not through a link: one planted in a shared folder had its target truncated to the process id)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
                failed = None
            except (FileNotFoundError, FileExistsError) as exc:   # (the folder removed meanwhile by a refused
                failed = exc                                        # run: again; said below if it stays so)
                continue
            except OSError as exc:   # a read-only file system, no permission: before anything of the run is written
                failed = OSError(f"its lock file {self.path} is a symbolic link") if exc.errno == errno.ELOOP else exc
                break
            if not stat.S_ISREG(os.fstat(fd).st_mode):   # (a FIFO or a device of that name: not written)
                os.close(fd)
                failed = OSError(f"its lock file {self.path} is not a regular file")
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunLocked(f"{self.option} {self.directory} is in use by another {self.command} (process "
                                f"{holder}); wait for it to end or give another {self.option}") from None
            try:   # (the file locked is still the one of that name, not one a holder removed as it let go)
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            failed = failed or OSError(f"its lock file {self.path} keeps being replaced")
        if failed is not None:   # (a full disk: the folders made for it went with the refusal, they had stayed)
            self._remove_made()
            raise RunLocked(f"{self.option} {self.directory}: cannot be written ({failed.strerror or failed})")
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:   # (a full disk: the lock let go, its file and the folders made for it removed)
            self.release(discard=True)
            raise RunLocked(f"{self.option} {self.directory}: cannot be written ({exc.strerror or exc})") from None
        return self

    def release(self, discard: bool = False) -> None:
        """Lets the directory go. `discard`: the run wrote nothing; a directory it made is removed if nothing else
        is in it."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):   # (removed while held: one who opened it meanwhile sees it gone, above;
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):   # only its own: not one made after a user
                os.remove(self.path)                                          # removed this one)
        if discard:
            self._remove_made()
        os.close(self.fd)   # (closing the only descriptor of the lock releases it)
        self.fd = None

    def _remove_made(self) -> None:
        """Removes the folders acquire made, if nothing is in them (--out runs/x made runs/ too: it goes if empty)."""
        with contextlib.suppress(OSError):
            if self.made and not os.listdir(self.directory):
                for folder in self.made:
                    os.rmdir(folder)


def holder(directory: str, name: str = LOCK_NAME) -> Optional[str]:
    """The process id a run holding `directory`'s lock wrote in it ("unknown" if none), or None where no run holds
    it (no lock file, or one whose run has ended): for commands that write into a run folder (`dtmt average -o`)."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # (taken: nobody holds it exclusively; let go at close)
        return None
    except BlockingIOError:
        return os.read(fd, 64).decode(errors="replace").strip() or "unknown"
    except OSError:
        return None
    finally:
        os.close(fd)
