"""Write failures (issue 20, item 5): a full disk while writing a checkpoint, a translation or a corpus leaves
the previous file intact and no temporary file, and is reported in one line naming the file and the reason."""
import errno
import os

import pytest
import torch

from dtmt_models import atomic
from dtmt_models.models import checkpoint


def _fill_disk(monkeypatch):
    """From now on every fsync fails as on a full disk (the data was buffered; the file system cannot keep it)."""
    def fail(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(atomic.os, "fsync", fail)


@pytest.fixture
def full_disk(monkeypatch):
    _fill_disk(monkeypatch)


def _only(directory, names):
    assert sorted(os.listdir(directory)) == sorted(names), os.listdir(directory)


def test_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path, full_disk):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    with pytest.raises(atomic.WriteError) as info:
        with atomic.atomic_write(str(path)) as f:
            f.write("new\n")
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "No space left on device" in message
    assert path.read_text() == "old\n"
    _only(tmp_path, ["out.txt"])


def test_atomic_write_commits_and_cleans_up_after_a_caller_error(tmp_path):
    path = tmp_path / "out.txt"
    with atomic.atomic_write(str(path)) as f:
        f.write("one\n")
    assert path.read_text() == "one\n"
    with pytest.raises(ZeroDivisionError):            # not an OS error: propagates as it is, nothing replaced
        with atomic.atomic_write(str(path)) as f:
            f.write("two\n")
            1 / 0
    assert path.read_text() == "one\n"
    with atomic.atomic_write(str(tmp_path / "sub" / "b.bin"), "wb") as f:   # the directory is made
        f.write(b"\x00\x01")
    assert (tmp_path / "sub" / "b.bin").read_bytes() == b"\x00\x01"
    _only(tmp_path, ["out.txt", "sub"])


def test_a_set_of_files_is_renamed_into_place_only_once_all_are_written(tmp_path):
    """atomic_paths: a failure while writing any file of the set leaves every earlier version and no temporary; on
    success each written file replaces its path (a temporary left unwritten leaves its path as it was)."""
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.png"
    a.write_text("old a")
    b.write_text("old b")
    with pytest.raises(OSError, match="disk full"):
        with atomic.atomic_paths([a, b, c], ["", "", ".png"]) as temps:
            assert temps[2].endswith(".png") and all(os.path.dirname(t) == str(tmp_path) for t in temps)
            open(temps[0], "w").write("new a")
            raise OSError(errno.ENOSPC, "disk full")
    assert (a.read_text(), b.read_text()) == ("old a", "old b") and sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]
    with pytest.raises(atomic.WriteError, match=r"^cannot write a.txt, b.txt, c.png: disk full"):   # (all named: it
        with atomic.atomic_paths([a, b, c]):                                  # said c.png, the last, of any failure)
            raise OSError(errno.ENOSPC, "disk full")
    with atomic.atomic_paths([a, b, c]) as temps:
        open(temps[0], "w").write("new a")
        open(temps[2], "w").write("c")
    assert (a.read_text(), b.read_text(), c.read_text()) == ("new a", "old b", "c")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.png"]


def test_a_link_is_written_through_and_a_file_keeps_its_permissions(tmp_path):
    """A command's output (through_link) as a shell's `>` writes: through a symbolic link (the rename replaced the
    link with a file and left its target as it was), into a file that keeps its mode (a private 600 output became
    644); a dangling link makes its target. A new file takes the umask's mode, as open() gives it. Other writes (a
    run's files, a corpus') replace a link and leave the shared copy it points to alone."""
    import stat

    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_text("old\n")
    target.chmod(0o600)
    link.symlink_to("real.txt")
    with atomic.atomic_write(str(link), through_link=True) as f:
        f.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    shared, linked = tmp_path / "shared.pt", tmp_path / "last.pt"
    shared.write_text("shared\n")
    linked.symlink_to("shared.pt")
    with atomic.atomic_write(str(linked)) as f:
        f.write("own\n")
    assert not linked.is_symlink() and linked.read_text() == "own\n" and shared.read_text() == "shared\n"
    dangling = tmp_path / "dangling"
    dangling.symlink_to("made.txt")
    with atomic.atomic_write(str(dangling), through_link=True) as f:
        f.write("x")
    assert dangling.is_symlink() and (tmp_path / "made.txt").read_text() == "x"
    umask = os.umask(0o022)
    os.umask(umask)
    with atomic.atomic_write(str(tmp_path / "fresh.txt")) as f:
        f.write("y")
    assert stat.S_IMODE((tmp_path / "fresh.txt").stat().st_mode) == 0o666 & ~umask
    _only(tmp_path, ["real.txt", "link.txt", "shared.pt", "last.pt", "dangling", "made.txt", "fresh.txt"])


def test_a_device_or_a_pipe_is_written_in_place(tmp_path):
    """-o /dev/null or a FIFO: there is nothing to rename over, so the content is written to it as a stream (the
    rename would have replaced the pipe with a file, and fsync refuses a device)."""
    import threading

    with atomic.atomic_write("/dev/null") as f:
        f.write("gone\n")
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    with atomic.atomic_write(fifo) as f:
        f.write("through the pipe\n")
    reader.join(timeout=30)
    assert got == ["through the pipe\n"] and os.path.exists(fifo) and not os.path.isfile(fifo)
    _only(tmp_path, ["pipe"])
    # /dev/stdout redirected to a file looks like a file: written in place all the same (a rename would replace the
    # /dev/stdout link itself, or fail for want of permission in /dev)
    import subprocess
    import sys

    out = tmp_path / "redirected.txt"
    code = "from dtmt_models import atomic\nwith atomic.atomic_write('/dev/stdout') as f:\n    f.write('to stdout\\n')\n"
    with open(out, "w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.read_text() == "to stdout\n"


def test_checkpoint_save_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    payload = dict(model_name="dtmt", model_options={}, src_vocab=b"a", tgt_vocab=b"b", model={"w": torch.ones(2)})
    checkpoint.save_checkpoint(str(path), payload)
    before = path.read_bytes()
    _fill_disk(monkeypatch)
    with pytest.raises(atomic.WriteError, match="cannot write .*last.pt: No space left"):
        checkpoint.save_checkpoint(str(path), {**payload, "model": {"w": torch.zeros(2)}})
    assert path.read_bytes() == before
    _only(tmp_path, ["last.pt"])


def test_translate_output_on_a_full_disk(tmp_path, monkeypatch, capsys):
    """The command line turns the failure into its one-line error (exit 1) and keeps the old output."""
    from test_translate_evaluate import SRC, TGT
    from dtmt_models import cli
    from dtmt_models.models.registry import build_model
    from dtmt_models.data.vocabulary import Vocabulary

    sv, tv = Vocabulary.train(SRC, vocab_size=60), Vocabulary.train(TGT, vocab_size=60)
    model = build_model("rnnsearch-atr", len(sv), len(tv), embed_dim=8, hidden_size=8)
    ckpt = str(tmp_path / "m.pt")
    checkpoint.save_checkpoint(ckpt, dict(model_name="rnnsearch-atr", model_options=dict(embed_dim=8, hidden_size=8),
                                          src_vocab=sv.proto, tgt_vocab=tv.proto, model=model.state_dict()))
    _fill_disk(monkeypatch)
    src = tmp_path / "in.es"
    src.write_text("el sol\n")
    out = tmp_path / "out.en"
    out.write_text("previous\n")
    assert cli.main(["translate", "-c", ckpt, "--quiet", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtmt translate: cannot write ") and "out.en" in err, err
    assert out.read_text() == "previous\n"
    _only(tmp_path, ["in.es", "m.pt", "out.en"])


def test_a_file_in_a_folder_under_dev_is_written_atomically():
    """A regular file under /dev (a run in /dev/shm's tmpfs) is replaced by a rename like any other: it was
    rewritten in place, as a device is, so a kill or a full tmpfs during a checkpoint's save truncated it."""
    import tempfile

    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        path = os.path.join(folder, "last.pt")
        with atomic.atomic_write(path) as f:
            f.write("first\n")
        inode = os.stat(path).st_ino
        with atomic.atomic_write(path) as f:
            f.write("second\n")
        assert open(path).read() == "second\n" and os.stat(path).st_ino != inode
