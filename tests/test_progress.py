"""dtmt_models.progress: a tqdm bar on a terminal, plain lines in a log, silence on request."""
import io

import pytest

from dtmt_models.progress import Progress, counted


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_mode_prints_the_lines_at_most_every_so_often(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("dtmt_models.progress.time.monotonic", lambda: clock[0])
    log, out = io.StringIO(), io.StringIO()
    p = Progress("auto", desc="job", every=60.0, stream=log, message_stream=out)   # not a terminal: lines
    assert p.mode == "lines"
    p.show(1, 10, status="ignored here", line="job: 1/10")      # less than `every` since the start: held back
    clock[0] += 61
    p.show(2, 10, line="job: 2/10")
    p.show(3, 10, line="job: 3/10")                             # too soon after the last
    clock[0] += 60
    p.show(4, 10)                                               # no line given: nothing
    p.show(5, 10, line="job: 5/10")
    p.message("done")
    p.close()
    assert log.getvalue() == "job: 2/10\njob: 5/10\n"
    assert out.getvalue() == "done\n"


def test_every_zero_prints_each_line_to_its_own_stream():
    err, lines = io.StringIO(), io.StringIO()
    p = Progress("lines", stream=err, line_stream=lines)
    for i in range(3):
        p.show(i, line=f"step {i}")
    assert lines.getvalue() == "step 0\nstep 1\nstep 2\n" and err.getvalue() == ""


def test_bar_on_a_terminal_shows_position_total_and_status():
    term, out = Terminal(), io.StringIO()
    p = Progress("auto", desc="dtmt translate", unit="sentence", stream=term, message_stream=out)
    assert p.mode == "bar"
    p.show(0, 40)
    p.show(25, 40, status="12.5 sentences/s", line="not printed on a bar")
    p.bar.refresh()
    shown = term.getvalue()
    assert "dtmt translate" in shown and "25/40" in shown and "12.5 sentences/s" in shown
    assert "not printed" not in shown
    p.message("saved")
    p.close()
    assert out.getvalue() == "saved\n" and p.bar is None


def test_none_keeps_the_messages_silent_nothing_and_modes_are_checked():
    for mode, printed in (("none", "z\n"), ("silent", "")):
        term, out = Terminal(), io.StringIO()
        p = Progress(mode, stream=term, message_stream=out)
        p.show(1, 2, status="x", line="y")
        p.message("z")
        p.close()
        assert term.getvalue() == "" and out.getvalue() == printed, mode
    with pytest.raises(ValueError, match="progress mode must be one of"):
        Progress("fancy")


def test_counts_are_written_in_number():
    assert [counted(n, "request") for n in (0, 1, 2, 1234)] == ["0 requests", "1 request", "2 requests",
                                                                 "1,234 requests"]
    assert counted(1, "batch", "batches") == "1 batch" and counted(3, "batch", "batches") == "3 batches"
