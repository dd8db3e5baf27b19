"""The session kinds' pure parts: what a master tells, and Connect's conf-only answers."""

import pytest

from sink.errors import ConfigError
from sink.session import cores_of_master, executors_of_master, is_connect
from sink.session.connect import ConnectSession
from tests.conf_session import ConfSession


@pytest.mark.parametrize("master, cores", [
    ("local", 1), ("local[3]", 3), ("local[*]", 8), ("local[2, 4]", 2), ("local-cluster[2,1,1024]", 2),
    ("local-cluster[3,2,1024]", 6), ("yarn", None), ("spark://host:7077", None), ("", None)])
def test_cores_of_master_are_what_default_parallelism_gives_under_it(master, cores):
    assert cores_of_master(master, cpu_count=8) == cores


@pytest.mark.parametrize("master, executors", [
    ("local", 1), ("local[4]", 1), ("local-cluster[3,1,1024]", 3), ("k8s://https://api:6443", None)])
def test_executors_of_master(master, executors):
    assert executors_of_master(master) == executors


def test_connect_reads_the_parallelism_from_the_conf_then_from_a_local_master():
    configured = ConfSession(**{"spark.master": "yarn", "spark.default.parallelism": "12"})
    assert ConnectSession(configured).default_parallelism() == 12
    assert ConnectSession(ConfSession(**{"spark.master": "local[3]"})).default_parallelism() == 3


def test_connect_under_a_cluster_master_that_tells_no_parallelism_names_num_shards():
    with pytest.raises(ConfigError, match=r"num_shards is not set and, under Spark Connect, the session tells "
                       r"neither spark.default.parallelism nor the cores of its master 'yarn': set num_shards"):
        ConnectSession(ConfSession(**{"spark.master": "yarn"})).default_parallelism()


def test_connect_counts_executors_from_the_master_or_the_instances_conf():
    assert ConnectSession(ConfSession(**{"spark.master": "local-cluster[2,1,1024]"})).executor_count() == 2
    yarn = ConfSession(**{"spark.master": "yarn", "spark.executor.instances": "5"})
    assert ConnectSession(yarn).executor_count() == 5


def test_a_session_is_connect_by_its_class_not_by_the_environment():
    assert not is_connect(ConfSession())
