"""python -m seqpar bench (seqpar.bench.layer_bench), in-process at tp 1 with tiny shapes: how a run is
stopped (Ctrl-C, SIGTERM), who writes --json, what the timed forwards run, the Table 2 figure it compares
with and the program name its --help gives."""
import json
import os
import signal

import pytest

from seqpar.bench import layer_bench

TINY = ["--tp", "1", "--seq-len", "8", "--hidden", "16", "--heads", "2", "--batch", "1", "--iters", "2",
        "--warmup", "0", "--dtype", "fp32"]


class _FellThrough(Exception):
    """The test's own SIGTERM handler ran: the bench had none (the signal would have killed the run)."""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_keeping_the_json_without_a_traceback(signum, tmp_path, monkeypatch, capsys):
    """Ctrl-C at --tp 1 printed a traceback, and SIGTERM killed the process outright (at --tp 2 leaving
    the ranks running): both now stop the run with one line and exit 128 + signal, the JSON keeping the
    experiments measured with "complete": false."""
    real = layer_bench.layer_config

    def signalled_at_full_recompute(args, sequence_parallel, recompute, dtype):
        if recompute == "full":      # the third experiment: two are in the JSON
            os.kill(os.getpid(), signum)
        return real(args, sequence_parallel, recompute, dtype)

    def fell_through(*_):
        raise _FellThrough()

    monkeypatch.setattr(layer_bench, "layer_config", signalled_at_full_recompute)
    previous = signal.signal(signal.SIGTERM, fell_through)
    try:
        path = tmp_path / "rows.json"
        try:
            layer_bench.main(TINY + ["--json", str(path)])
        except SystemExit as exc:
            code = exc.code
        except KeyboardInterrupt:    # (it would end pytest's session: caught here)
            pytest.fail("Ctrl-C left as KeyboardInterrupt: a traceback")
        assert signal.getsignal(signal.SIGTERM) is fell_through      # the bench's handler is gone again
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signum
    assert capsys.readouterr().err.strip() == f"python -m seqpar bench: stopped by {signum.name}"
    written = json.loads(path.read_text())
    assert written["complete"] is False
    assert [r["experiment"] for r in written["rows"]] == ["no recompute", "sequence parallel"]


class _ListQueue(list):
    def put(self, item):
        self.append(item)


class _Exited(Exception):
    pass


def test_spawned_ranks_send_their_rows_and_leave_the_json_to_the_parent(tmp_path, monkeypatch):
    """Spawned rank 0 wrote --json itself: killed with SIGTERM, the parent left it running, and it later
    rewrote the file with "complete": true. It now sends its rows after each experiment (the parent
    writes them), and a rank whose parent is gone stops."""
    import multiprocessing

    path = tmp_path / "rows.json"
    args = layer_bench.parse_args(TINY + ["--json", str(path)])
    queue = _ListQueue()
    layer_bench._spawned(0, 1, args, None, queue)
    assert not path.exists()
    assert [status for status, _ in queue] == ["rows"] * 5 + ["ok"]
    assert [len(rows) for _, rows in queue[:5]] == [1, 2, 3, 4, 5] and queue[4][1] == queue[5][1]

    class Gone:
        def is_alive(self):
            return False

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(multiprocessing, "parent_process", lambda: Gone())
    monkeypatch.setattr(os, "_exit", exit_)
    orphan = _ListQueue()
    with pytest.raises(_Exited):
        layer_bench._spawned(0, 1, args, None, orphan)
    assert orphan == [] and not path.exists()


def test_timed_forwards_skip_the_rank_agreement_check(monkeypatch):
    """Every timed forward ran TransformerLayer.check_rank_inputs (at t > 1 a hash, an all-gather and a
    host read), which a model step does not pay: it now runs once per experiment, untimed."""
    from seqpar.nn.layer import TransformerLayer

    timing, calls = [False], []
    real_run, real_forward = layer_bench._Timer.run, TransformerLayer._forward

    def run(self, fn):
        timing[0] = True
        try:
            return real_run(self, fn)
        finally:
            timing[0] = False

    def forward(self, x):
        calls.append((timing[0], self.check_rank_inputs))
        return real_forward(self, x)

    monkeypatch.setattr(layer_bench._Timer, "run", run)
    monkeypatch.setattr(TransformerLayer, "_forward", forward)
    layer_bench.main(TINY)
    assert not any(checked for timed, checked in calls if timed), calls
    assert sum(checked for _, checked in calls) == len(layer_bench.EXPERIMENTS)


def test_table2_without_masks_counts_no_dropout_outputs_at_dropout_0():
    """--dropout 0 --arch gpt: the mask-free figure still counted the attention dropout's output (the
    layer keeps none), so the measured bytes came out below it."""
    from seqpar.memory import layer_activation_bytes

    rows = layer_bench.main(TINY + ["--dropout", "0"])
    s, b, h, a = 8, 1, 16, 2
    for r in rows:
        t2 = layer_activation_bytes(s, b, h, a, tp=1, sequence_parallel=r["sequence_parallel"],
                                    recompute=r["recompute"], bytes_per_element=4, bytes_per_mask=0,
                                    hidden_dropout=0.0, attention_dropout=0.0)
        assert r["table2_bytes_no_masks"] == t2 == r["table2_bytes"], r      # no masks to count either
        assert t2 <= r["activation_bytes"] <= 1.1 * t2, r                    # (+ the norms' statistics)


@pytest.mark.parametrize("argv0, prog", [("/venv/bin/seqpar-bench", "seqpar-bench"),
                                         ("/src/seqpar/__main__.py", "python -m seqpar bench")])
def test_help_names_the_program_it_was_run_as(argv0, prog, monkeypatch, capsys):
    """``seqpar-bench --help`` said "usage: python -m seqpar bench"."""
    monkeypatch.setattr("sys.argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as done:
        layer_bench.parse_args(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog} [-h]")
