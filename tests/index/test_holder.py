"""Who holds a replica, and checkpoint requests: the holder's side and the reader's, without RocksDB."""

import os
import threading
from pathlib import Path

from sink.index import holder


class FakeReplica:
    def __init__(self, path: Path):
        self.path = path
        self.in_use = threading.Lock()
        self.checkpoints = 0

    def replaced(self) -> bool:
        return False

    def checkpoint(self) -> None:
        self.checkpoints += 1


def test_the_holder_is_this_process_until_forgotten(tmp_path):
    holder.record(tmp_path, since=1_700_000_000.0)
    held = holder.read(tmp_path)
    assert (held.pid, held.since, held.alive()) == (os.getpid(), 1_700_000_000.0, True)
    holder.forget(tmp_path)
    assert holder.read(tmp_path) is None


def test_a_request_is_answered_only_between_uses(tmp_path):
    replica = FakeReplica(tmp_path)
    (tmp_path / holder.CHECKPOINT_REQUEST).touch()
    with replica.in_use:  # a batch is using it: the round leaves it for the next
        holder.answer([replica])
    assert replica.checkpoints == 0 and (tmp_path / holder.CHECKPOINT_REQUEST).exists()
    holder.answer([replica])
    assert replica.checkpoints == 1 and not (tmp_path / holder.CHECKPOINT_REQUEST).exists()
    holder.answer([replica])  # no request: nothing done
    assert replica.checkpoints == 1


def test_an_unanswered_request_times_out_and_is_taken_back(tmp_path):
    assert holder.request_checkpoint(tmp_path, timeout_s=0.05) is False
    assert not (tmp_path / holder.CHECKPOINT_REQUEST).exists()
