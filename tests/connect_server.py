"""A Spark Connect server started as docs/spark-connect.md says: spark-submit's server class
with Delta's package, extension and catalog (`python -m sink.lakehouse.engines.spark_delta
--submit-args`), its workers on this interpreter. The suite's Connect pass runs on one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.ops.test_metrics import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ConnectServer:
    process: subprocess.Popen
    port: int
    log: Path  # the server's stdout and stderr: its foreachBatch workers' log lines too

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, log: Path, *, conf: dict[str, str], master: str = "local[2]",
              timeout_s: float = 180) -> ConnectServer:
        import pyspark

        from sink.lakehouse.engines import spark_delta

        port = free_port()
        env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "PYSPARK_PYTHON": sys.executable}
        settings = {**conf, "spark.connect.grpc.binding.port": str(port), "spark.pyspark.python": sys.executable}
        command = [str(Path(sys.executable).parent / "spark-submit"), "--master", master, "--class",
                   "org.apache.spark.sql.connect.service.SparkConnectServer", *spark_delta.submit_args(),
                   *(arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}"))]
        with open(log, "w") as out:  # the workers import `tests`: they start in the repository
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        server = cls(process, port, log)
        try:
            wait_for_port(port, process, timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    """Until something listens on 127.0.0.1:`port` (a bounded wait on the server's own start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listened on port {port} within {timeout_s} s")
