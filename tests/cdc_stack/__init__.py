"""The real components of the Kafka tests, started by the tests themselves: a single-node Kafka
broker in KRaft mode (`kafka.Kafka` from `org.apache.kafka:kafka_2.13`), PostgreSQL from
Debian's packages with logical decoding, and Debezium's PostgreSQL connector in a Kafka Connect
standalone worker. `make cdc-stack` resolves the Java classpaths (broker/pom.xml,
connect/pom.xml) into CLASSPATHS and installs PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.connect_server import wait_for_port
from tests.ops.test_metrics import free_port

SLOT = "sink_tests"  # Debezium's replication slot
ROOT = Path(__file__).resolve().parent.parent.parent
CLASSPATHS = ROOT / ".venv" / "cdc-stack"


class StackNotInstalledError(RuntimeError):
    """A component the Kafka tests start is not installed: `make cdc-stack` installs them."""


def classpath(name: str) -> str:
    path = CLASSPATHS / f"{name}.classpath"
    if not path.exists():
        raise StackNotInstalledError(f"{path} is missing: run `make cdc-stack` (it resolves "
                                     f"tests/cdc_stack/{name}/pom.xml)")
    return path.read_text().strip()


def run_tool(command: list[str], cwd: Path | None = None) -> None:
    """A set-up command, its output in the error when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    if done.returncode:
        raise RuntimeError(f"{Path(command[0]).name} ... {command[-1]} exited with {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-2000:]}")


def java(classpath_name: str, main: str, *args: str, heap: str = "512m") -> list[str]:
    return ["java", f"-Xmx{heap}", "-Dlog4j2.level=WARN", "-cp", classpath(classpath_name), main, *args]


@dataclass
class KafkaBroker:
    """One KRaft node, broker and controller in one JVM, its data under `directory`."""

    directory: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, directory: Path) -> KafkaBroker:
        directory.mkdir(parents=True, exist_ok=True)
        broker = cls(directory, free_port())
        controller = free_port()
        (directory / "server.properties").write_text("\n".join([
            "process.roles=broker,controller", "node.id=1", f"controller.quorum.voters=1@127.0.0.1:{controller}",
            f"listeners=PLAINTEXT://127.0.0.1:{broker.port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{broker.port}", "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={directory / 'data'}", "num.partitions=1", "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1", "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1", "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0", "",
        ]))
        run_tool(java("broker", "kafka.tools.StorageTool", "format", "-t", _kafka_uuid(), "-c",
                      str(directory / "server.properties")))
        broker.run()
        return broker

    def run(self) -> None:
        """Start the broker process on its formatted data (again, after `stop`)."""
        log = self.directory / "broker.log"
        with open(log, "a") as out:
            self.process = subprocess.Popen(java("broker", "kafka.Kafka", str(self.directory / "server.properties")),
                                            stdout=out, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self.process, timeout_s=120)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def _kafka_uuid() -> str:
    """A cluster id as Kafka makes them: 16 random bytes, URL-safe base64 without padding, not
    starting with "-" (a command line would read it as an option)."""
    import base64

    while (text := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return text


def postgres_bin() -> Path:
    """Debian's PostgreSQL server programs (not on PATH): the newest installed version's."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not versions:
        raise StackNotInstalledError("PostgreSQL's server is not installed (/usr/lib/postgresql/*/bin/initdb): run "
                                     "`make cdc-stack` (apt-get install postgresql)")
    return versions[-1].parent


@dataclass
class Postgres:
    """A PostgreSQL server with logical decoding (`wal_level = logical`), trusting local
    connections, its cluster under `directory`. As root it runs as Debian's `postgres` user (the
    server refuses root), which must reach `directory`: pytest's are root's alone."""

    directory: Path
    port: int

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @classmethod
    def start(cls, directory: Path) -> Postgres:
        directory.mkdir(parents=True, exist_ok=True)
        server = cls(directory, free_port())
        if os.getuid() == 0:
            shutil.chown(directory, "postgres")
        server._run("initdb", "-D", str(directory / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                    "--no-sync")
        settings = {"wal_level": "logical", "max_wal_senders": 4, "max_replication_slots": 4, "port": server.port,
                    "listen_addresses": "127.0.0.1", "unix_socket_directories": str(directory), "fsync": "off"}
        options = " ".join(f"-c {k}={v}" for k, v in settings.items())
        server._run("pg_ctl", "-D", str(directory / "data"), "-l", str(directory / "server.log"), "-o", options,
                    "-w", "start")
        return server

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", "fast", "-w", "stop")

    def _run(self, program: str, *args: str) -> None:
        command = [str(postgres_bin() / program), *args]
        if os.getuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        run_tool(command, cwd=self.directory)


@dataclass
class Debezium:
    """Debezium's PostgreSQL connector (pgoutput) in a Kafka Connect standalone worker, writing
    change events of `tables` to topics `<prefix>.<schema>.<table>` with the JSON converter
    (its schema wrapper on: `value.converter.schemas.enable`), at Debezium's defaults: one
    connector per prefix of `captures`, each with the options given for it (none by default),
    its own replication slot and publication."""

    directory: Path
    process: subprocess.Popen
    port: int
    slots: list[str]

    @classmethod
    def start(cls, directory: Path, broker: KafkaBroker, postgres: Postgres, *, tables: list[str],
              captures: dict[str, dict[str, str]] | None = None) -> Debezium:
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        (directory / "worker.properties").write_text("\n".join([
            f"bootstrap.servers={broker.bootstrap_servers}",
            "key.converter=org.apache.kafka.connect.json.JsonConverter",
            "value.converter=org.apache.kafka.connect.json.JsonConverter",
            f"offset.storage.file.filename={directory / 'offsets'}", "offset.flush.interval.ms=1000",
            f"listeners=http://127.0.0.1:{port}", "",
        ]))
        captures = captures or {"cdc": {}}
        slots, files = [], []
        for prefix, options in captures.items():
            slot = f"{SLOT}_{prefix}"
            slots.append(slot)
            files.append(directory / f"connector-{prefix}.properties")
            files[-1].write_text("\n".join([
                f"name=pg-{prefix}", "connector.class=io.debezium.connector.postgresql.PostgresConnector",
                "database.hostname=127.0.0.1", f"database.port={postgres.port}", "database.user=postgres",
                "database.password=postgres", "database.dbname=postgres", f"topic.prefix={prefix}",
                "plugin.name=pgoutput", f"table.include.list={','.join(tables)}", f"slot.name={slot}",
                f"publication.name=pub_{prefix}", "publication.autocreate.mode=filtered",
                *(f"{k}={v}" for k, v in options.items()), "",
            ]))
        log = directory / "connect.log"
        with open(log, "a") as out:
            process = subprocess.Popen(
                java("connect", "org.apache.kafka.connect.cli.ConnectStandalone", str(directory / "worker.properties"),
                     *map(str, files)), stdout=out, stderr=subprocess.STDOUT)
        wait_for_port(port, process, timeout_s=180)
        debezium = cls(directory, process, port, slots)
        debezium.wait_streaming(postgres, timeout_s=180)
        return debezium

    def wait_streaming(self, postgres: Postgres, timeout_s: float) -> None:
        """Until every connector streams changes (its snapshot done): its replication slot has an
        active connection. Before, the worker listens but a change could still fall into the
        snapshot."""
        import psycopg

        deadline = time.monotonic() + timeout_s
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                assert self.process.poll() is None, f"the Connect worker exited; log {self.directory / 'connect.log'}"
                active = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY(%s) AND active",
                                      (self.slots,)).fetchone()[0]
                if active == len(self.slots):
                    return
                time.sleep(0.2)
        raise TimeoutError(f"Debezium's slots {self.slots} were not streaming within {timeout_s} s; log "
                           f"{self.directory / 'connect.log'}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)
