"""``hsextract status RUN_DIR --serve``: a page that watches a run (``/``), its numbers for Prometheus (``/metrics``)
and as JSON (``/api/status``, ``/api/history``), from the standard library's ``ThreadingHTTPServer``.

Every answer is rendered from the run directory on request, so the server keeps no state and can be started and
stopped at any time on a live, crashed or finished run. No authentication: it listens on loopback unless ``--host``.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.status.document import ACTIVE_STATES, history, status_document
from hsextract.status.page import render_page


def _failed(row: dict) -> int:
    return int(row["state"] in ("crashed", "failed"))


def _stalled(row: dict) -> int:
    return int(row["state"] == "stalled")


def _damaged(row: dict) -> int:
    return int(bool(row["damaged"]))


SHARD_METRICS = (
    # One row a metric: (kind, name, help, the status row's field or a function of the row). A None value leaves
    # the shard out of that metric.
    ("counter", "hsextract_tokens_done", "Tokens durable in the output.", "tokens_done"),
    ("gauge", "hsextract_planned_tokens", "Tokens planned for the shard.", "tokens_total"),
    ("counter", "hsextract_batches_done", "Batches durable in the output.", "batches_done"),
    ("gauge", "hsextract_planned_batches", "Batches planned for the shard.", "batches_total"),
    ("gauge", "hsextract_tokens_per_second", "Tokens made durable per second this session.", "tokens_per_s"),
    ("gauge", "hsextract_eta_seconds", "Time left at the worker's rate.", "eta_s"),
    ("gauge", "hsextract_staged_bytes", "Batch files in staging, not yet uploaded.", "staged_bytes"),
    ("gauge", "hsextract_upload_queue_files", "Staged files waiting for the uploader.", "uploads_waiting"),
    ("gauge", "hsextract_upload_lag_seconds", "Age of the oldest file waiting for upload.", "upload_lag_s"),
    ("gauge", "hsextract_last_progress_age_seconds", "Since the shard's tokens advanced.", "progress_age_s"),
    ("gauge", "hsextract_shard_failed", "1 if the shard crashed or failed.", _failed),
    ("gauge", "hsextract_shard_stalled", "1 if the worker lives but makes no progress.", _stalled),
    ("gauge", "hsextract_progress_file_damaged", "1 if the progress file cannot be read.", _damaged),
)


class RunCollector:
    """Reads the run directory on every scrape; one series per shard, labelled ``run`` and ``shard``."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run = self.run_dir.resolve().name

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            InfoMetricFamily,
            StateSetMetricFamily,
        )

        up = GaugeMetricFamily("hsextract_status_up", "1 if the run directory could be read", labels=["run"])
        try:
            doc = status_document(self.run_dir)
        except Exception:  # the scrape must still answer, saying the run cannot be read
            up.add_metric([self.run], 0)
            yield up
            return
        up.add_metric([self.run], 1)
        yield up
        plan = doc["plan"]
        info = InfoMetricFamily("hsextract_run", "what the run extracts", labels=["run"])
        info.add_metric(
            [self.run],
            {
                "model": str(plan["model"]),
                "layer_ids": ",".join(str(L["id"]) for L in plan["layers"]),
                "plan_hash": plan["plan_hash"],
                "output": str(plan["output"]),
            },
        )
        yield info
        complete = GaugeMetricFamily(
            "hsextract_run_complete", "1 once the manifest is written", labels=["run"]
        )
        complete.add_metric([self.run], 1 if doc["complete"] else 0)
        yield complete

        labels = ["run", "shard"]
        for kind, name, help_text, field in SHARD_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, help_text, labels=labels
            )
            for r in doc["shards"]:
                v = field(r) if callable(field) else r[field]
                if v is not None:
                    family.add_metric([self.run, str(r["shard"])], v)
            yield family
        states = StateSetMetricFamily("hsextract_shard_state", "the shard's state", labels=labels)
        all_states = ("not started", *ACTIVE_STATES, "done", "stopped", "crashed", "failed", "damaged")
        for r in doc["shards"]:
            states.add_metric([self.run, str(r["shard"])], {s: r["state"] == s for s in all_states})
        yield states
        gpu_labels = ["run", "shard", "gpu"]
        util = GaugeMetricFamily(
            "hsextract_gpu_utilization_ratio", "GPU busy fraction (NVML)", labels=gpu_labels
        )
        mem = GaugeMetricFamily(
            "hsextract_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=gpu_labels
        )
        for r in doc["shards"]:
            if r.get("gpu"):
                key = [self.run, str(r["shard"]), str(r["gpu"]["index"])]
                util.add_metric(key, r["gpu"]["utilization_pct"] / 100.0)
                mem.add_metric(key, r["gpu"]["memory_used_bytes"])
        yield util
        yield mem


def metrics_text(run_dir: Path) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run_dir))
    return generate_latest(registry)


# -- server ---------------------------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    server: StatusServer

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        run_dir = self.server.run_dir
        try:
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", render_page(run_dir).encode())
            elif path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST

                self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, metrics_text(run_dir))
            elif path == "/api/status":
                self._json(status_document(run_dir))
            elif path == "/api/history":
                self._json({str(k): v for k, v in history(run_dir).items()})
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found: try /, /metrics, /api/status\n")
        except HsextractError as e:
            self._send(
                HTTPStatus.SERVICE_UNAVAILABLE, "application/json", json.dumps({"error": str(e)}).encode()
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away mid-answer
        except Exception as e:  # a bug must cost one answer, not the server
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain", f"{e!r}\n".encode())

    def _json(self, value) -> None:
        self._send(HTTPStatus.OK, "application/json", json.dumps(value, indent=1).encode())

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass  # a scrape every few seconds would bury everything else on the console


class StatusServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, run_dir: Path, host: str, port: int):
        self.run_dir = Path(run_dir)
        if ":" in host:  # an IPv6 address such as ::1 or ::
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise HsextractError(
                f"cannot listen on {host}:{port} ({e.strerror}); choose another --port (0 picks a free one)"
            ) from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8000, echo=print) -> None:
    """Serve the page, ``/metrics`` and ``/api/status`` until interrupted."""
    status_document(
        run_dir, with_gpus=False
    )  # a run dir that cannot be read fails here, not on the first visit
    server = StatusServer(run_dir, host, port)
    echo(f"serving the status of {run_dir} at {server.url} (metrics: {server.url}metrics); Ctrl-C stops")
    if not ipaddress.ip_address(server.server_address[0]).is_loopback:
        echo(
            f"warning: listening on {host}, beyond this machine: the page has no authentication, and anyone who "
            "can reach the port sees the run's paths, hosts and logs' names; use 127.0.0.1 and an SSH tunnel"
        )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        echo("stopped")
    finally:
        server.server_close()
