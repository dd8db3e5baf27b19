import shutil
import subprocess
import sys
import textwrap

import pytest

from sink.index import worker_replicas
from sink.index.entry import Entry
from sink.index.registry import close_kept_open, kept_open
from sink.index.replica import ShardReplica
from sink.index.rocks import RELEASE_FILE
from sink.index.spec import replica_path

SPEC = '{"key": ["id"]}'


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    kept_time = Clock()
    monkeypatch.setattr(worker_replicas, "_clock", kept_time)
    return kept_time


@pytest.fixture
def root(tmp_path, monkeypatch, clock):
    # The rounds run here, in the test (`_round`): the background thread's timing is not tested.
    monkeypatch.setattr(worker_replicas, "_start_keeper", lambda: None)
    yield tmp_path
    # Nothing of a test stays kept open, and no later test's round sees it.
    with worker_replicas._KEPT_LOCK:
        worker_replicas._KEPT.clear()
    close_kept_open(under=tmp_path)


def _round(clock: Clock, after_s: float = worker_replicas.CHECKPOINT_IDLE_S):
    """A round of the background thread `after_s` seconds on (by default, once the replicas
    used so far have been idle long enough for their checkpoint)."""
    clock.now += after_s
    worker_replicas.keep_up()


def _view(path):
    view = ShardReplica.open_read_only(path)
    try:
        return view.clean, view.lookup("dt=1", [b"a", b"b"])
    finally:
        view.close()


def test_spark_marks_its_reused_workers():
    assert worker_replicas.reused_worker({"SPARK_REUSE_WORKER": "1"})
    assert not worker_replicas.reused_worker({})
    assert not worker_replicas.reused_worker({"SPARK_REUSE_WORKER": ""})


def test_a_use_keeps_the_replica_open_and_its_checkpoint_makes_it_clean(root, clock):
    path = replica_path(root, "t", 0, 1)
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    kept = kept_open(path)
    assert kept is replica
    assert _view(path)[0] is False  # not checkpointed yet: a worker killed now leaves it dirty
    _round(clock)
    assert kept_open(path) is replica  # still open for the next task
    assert _view(path) == (True, [Entry(1), None])


def test_a_replica_is_checkpointed_once_idle_not_after_each_use(root, clock):
    """A checkpoint after every use cost the next tasks their CPU (flushes, compactions)."""
    path = replica_path(root, "t", 0, 1)
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    _round(clock, after_s=worker_replicas.CHECKPOINT_IDLE_S - 1)
    assert _view(path)[0] is False
    _round(clock, after_s=1)
    assert _view(path) == (True, [Entry(1), None])


def test_a_replica_never_idle_is_checkpointed_once_dirty_for_checkpoint_every_s(root, clock):
    path = replica_path(root, "t", 0, 1)
    uses_apart = worker_replicas.CHECKPOINT_IDLE_S / 2
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    for n in range(int(worker_replicas.CHECKPOINT_EVERY_S / uses_apart) - 1):
        _round(clock, after_s=uses_apart)
        assert _view(path)[0] is False, f"checkpointed after {n + 1} uses"
        with worker_replicas.use(path, SPEC) as replica:
            replica.put_entries("dt=1", {b"b": Entry(n)})
    _round(clock, after_s=uses_apart)  # CHECKPOINT_EVERY_S after the first use
    assert _view(path) == (True, [Entry(1), Entry(n)])


def test_the_next_use_marks_it_dirty_again_until_its_checkpoint(root, clock):
    path = replica_path(root, "t", 0, 1)
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    _round(clock)
    with worker_replicas.use(path, SPEC) as again:
        assert again is replica
        assert _view(path)[0] is False
        again.put_entries("dt=1", {b"b": Entry(2)})
    _round(clock)
    assert _view(path) == (True, [Entry(1), Entry(2)])


def test_a_failed_use_is_not_checkpointed(root, clock):
    path = replica_path(root, "t", 0, 1)
    with pytest.raises(RuntimeError):
        with worker_replicas.use(path, SPEC) as replica:
            replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
            raise RuntimeError("task failed")
    _round(clock)
    assert _view(path)[0] is False


def test_a_release_request_closes_it_clean(root, clock):
    path = replica_path(root, "t", 0, 1)
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    (path / RELEASE_FILE).touch()
    _round(clock)
    assert kept_open(path) is None
    with ShardReplica.open(path, SPEC) as reopened:  # the lock is free; the release request answered
        assert reopened.repaired is None and reopened.lookup("dt=1", [b"a"]) == [Entry(1)]
    assert not (path / RELEASE_FILE).exists()


def test_a_replica_lost_under_the_worker_is_let_go_never_used_again(root, clock):
    """The directory removed (a lost disk, a reset), then made again by another open: the
    worker's handle is of the old database, and a write through it would land among the new
    one's files."""
    path = replica_path(root, "t", 0, 1)
    with worker_replicas.use(path, SPEC) as replica:
        replica.load_partition("dt=1", [b"a"], [Entry(1)], reason="on_demand")
    shutil.rmtree(path)
    with worker_replicas.use(path, SPEC) as fresh:
        assert fresh is not replica and fresh.partitions() == {}
    lost = replica_path(root, "t", 1, 2)
    with worker_replicas.use(lost, SPEC):
        pass
    shutil.rmtree(lost)
    _round(clock)
    assert kept_open(lost) is None and not lost.exists()  # let go without a write


def test_past_max_kept_the_least_recently_used_is_closed(root, clock, monkeypatch):
    monkeypatch.setattr(worker_replicas, "MAX_KEPT", 2)
    paths = [replica_path(root, "t", s, 3) for s in range(3)]
    for p in [paths[0], paths[1], paths[2], paths[0]]:
        with worker_replicas.use(p, SPEC):
            pass
    _round(clock)
    assert [kept_open(p) is not None for p in paths] == [True, False, True]
    view = ShardReplica.open_read_only(paths[1])
    assert view.clean
    view.close()


def test_another_process_gets_a_replica_a_worker_keeps_open(root):
    """A worker keeps the replica open (its keeper thread running); another process's open
    waits for the lock, asks for it, and gets it once the worker let go, clean."""
    path = replica_path(root, "t", 0, 1)
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from sink.index import worker_replicas
        from sink.index.entry import Entry
        with worker_replicas.use({str(path)!r}, {SPEC!r}) as replica:
            replica.load_partition("dt=1", [b"a"], [Entry(7)], reason="on_demand")
        print("kept", flush=True)
        sys.stdin.read()  # stays alive, keeping it, until the test ends
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "kept"
        with ShardReplica.open(path, SPEC, lock_timeout_s=30) as replica:
            assert replica.repaired is None
            assert replica.lookup("dt=1", [b"a"]) == [Entry(7)]
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)


def test_a_worker_killed_before_its_checkpoint_leaves_a_replica_that_is_rebuilt_not_trusted(root):
    """Spark SIGKILLs a worker after its second task, before that task's checkpoint: what the
    task wrote was never flushed (the WAL is off), so the replica, clean on disk as of the
    first task, must not be read as it is."""
    path = replica_path(root, "t", 0, 1)
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from sink.index import worker_replicas
        from sink.index.entry import Entry
        worker_replicas._start_keeper = lambda: None  # checkpoints only where this says
        with worker_replicas.use({str(path)!r}, {SPEC!r}) as replica:
            replica.load_partition("dt=1", [b"a"], [Entry(7)], reason="on_demand")
        worker_replicas.keep_up()  # the first task's checkpoint: clean on disk
        with worker_replicas.use({str(path)!r}, {SPEC!r}) as replica:
            replica.load_partition("dt=2", [b"b"], [Entry(8)], reason="on_demand")
        print("kept", flush=True)  # the second task's checkpoint never runs
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "kept"
    finally:
        worker.kill()
        worker.wait(timeout=30)
    with ShardReplica.open(path, SPEC, lock_timeout_s=30) as replica:
        assert replica.partitions() == {}  # wiped as dirty: a reload, never a half-written replica
