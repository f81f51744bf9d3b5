"""A small Python client for ``terarec serve`` replicas (``/predict`` and KServe v2).

Requests are spread over the replicas (round robin); a request not answered within
``hedge_after_s`` is sent to the next replica as well and the first answer wins; a
connection error or a 5xx answer moves on to the next replica (``retries`` times). A
4xx answer is the request's own fault and is raised at once (ClientError).

    client = Client(["http://10.0.0.1:8080", "http://10.0.0.2:8080"])
    scores, version = client.predict([{"C1": "68fd1e64"}, ...], context={"I1": "3"})
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


class ClientError(RuntimeError):
    """A request refused by a server (4xx; ``status`` and the server's message), or no
    replica answering it (``status`` 0 or the last 5xx)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class _Retry(Exception):
    """An attempt that another replica may still answer (connection error, 5xx)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ClientStats:
    requests: int = 0
    hedges_sent: int = 0
    hedges_won: int = 0
    retries: int = 0


class _Replica:
    """One server: host, port and a pool of kept-alive connections."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"replica URL {url!r}: expected http://HOST:PORT")
        self.url = url
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.timeout_s = timeout_s
        self._free: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: bytes | None) -> tuple[int, Any]:
        with self._lock:
            conn = self._free.pop() if self._free else None
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Retry(f"{self.url}: {type(exc).__name__}: {exc}") from None
        with self._lock:
            self._free.append(conn)
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        if response.status >= 500:
            raise _Retry(f"{self.url}: {response.status} {payload}", response.status)
        return response.status, payload

    def close(self) -> None:
        with self._lock:
            for conn in self._free:
                conn.close()
            self._free.clear()


class Client:
    """Calls any of ``urls`` (replicas of one model named ``model``)."""

    def __init__(self, urls: Sequence[str], *, model: str = "terarec",
                 timeout_s: float = 5.0, hedge_after_s: float | None = 0.05,
                 retries: int = 2) -> None:
        if not urls:
            raise ValueError("Client needs at least one replica URL")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.replicas = [_Replica(u, timeout_s) for u in urls]
        self.model = model
        self.hedge_after_s = hedge_after_s
        self.retries = retries
        self.stats = ClientStats()
        self._next = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(urls)),
                                        thread_name_prefix="terarec-client")

    # -- calls --------------------------------------------------------------------------
    def predict(self, candidates: Sequence[Mapping[str, Any]],
                context: Mapping[str, Any] | None = None) -> tuple[list[float], int]:
        """Scores of raw feature dicts (each merged with ``context``) and the model
        version that scored them."""
        body: dict[str, Any] = {"candidates": list(candidates)}
        if context:
            body["context"] = dict(context)
        out = self.call("POST", "/predict", body)
        return list(out["scores"]), int(out["version"])

    def infer(self, inputs: Sequence[Mapping[str, Any]], request_id: str | None = None
              ) -> dict[str, Any]:
        """A KServe v2 inference request (``inputs`` as the protocol lists them)."""
        body: dict[str, Any] = {"inputs": list(inputs)}
        if request_id is not None:
            body["id"] = request_id
        return self.call("POST", f"/v2/models/{self.model}/infer", body)

    def metadata(self) -> dict[str, Any]:
        return self.call("GET", f"/v2/models/{self.model}")

    def ready(self) -> bool:
        try:
            self.call("GET", "/v2/health/ready")
            return True
        except ClientError:
            return False

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request, spread, hedged and retried as the class says."""
        data = None if body is None else json.dumps(body).encode()
        self.stats.requests += 1
        start = next(self._next)
        order = [self.replicas[(start + i) % len(self.replicas)]
                 for i in range(len(self.replicas))]
        attempts = self.retries + 1
        tried = 0
        pending: dict[Future, int] = {}
        hedges: set[int] = set()  # attempts sent as hedges
        last: _Retry | None = None

        def send() -> bool:
            nonlocal tried
            if tried >= attempts:
                return False
            replica = order[tried % len(order)]
            pending[self._pool.submit(replica.request, method, path, data)] = tried
            tried += 1
            return True

        send()
        hedge_at = (None if self.hedge_after_s is None
                    else time.monotonic() + self.hedge_after_s)
        while pending:
            timeout = None if hedge_at is None else max(0.0, hedge_at - time.monotonic())
            done, _ = wait(list(pending), timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:  # the hedge delay passed: ask the next replica too
                hedge_at = None
                if send():
                    hedges.add(tried - 1)
                    self.stats.hedges_sent += 1
                continue
            for fut in done:
                attempt = pending.pop(fut)
                try:
                    status, payload = fut.result()
                except _Retry as exc:
                    last = exc
                    if send():
                        self.stats.retries += 1
                    continue
                if status >= 400:
                    message = payload.get("error") if isinstance(payload, dict) else payload
                    raise ClientError(f"{method} {path}: {status}: {message}", status)
                if attempt in hedges:
                    self.stats.hedges_won += 1
                return payload
        raise ClientError(f"{method} {path}: no replica answered ({last})",
                          last.status if last else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
