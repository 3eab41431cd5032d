"""What ``hsextract regenerate`` costs, by mode:

- ``client``: the client's own cost. The real job (``regenerate.runner.regenerate``: rows read from JSONL, requests,
  replies, chunks written) in this process against a loopback endpoint in a process of its own that answers at
  once (tests/support/chat_servers.py): requests/s of one process; then against one that answers after
  ``--delay`` seconds, the requests in flight it sustains (the endpoint counts them; Little's law from the rate
  says the same).

      python scripts/bench_regenerate.py client --rows 40000 --concurrency 256 --inflight 2048 --delay 1.0

- ``server``: against the real ``transformers serve`` on the CPU over a tiny random model, generated tokens/s of the
  job at ``--concurrency`` against the same requests sent one at a time by a plain loop (urllib).
  ``--continuous-batching`` serves a tiny Qwen3 (full attention; transformers' continuous batching does not take
  qwen3_5's linear attention) with it on; without, the demo's tiny qwen3_5.

      python scripts/bench_regenerate.py server --rows 48 --max-tokens 32 --concurrency 16 [--continuous-batching]

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import benchlib  # noqa: F401 -- puts src/ and tests/ on the path

from hsextract.regenerate.config import RegenerateConfig
from hsextract.regenerate.runner import Totals, regenerate

ROOT = Path(__file__).resolve().parents[1]


def _prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"prompt {i}: say"}]})
                + "\n"
            )
    return path


def _job(url: str, model: str, data: Path, out: Path, concurrency: int, **options) -> dict:
    """The real job in this process; its totals."""
    cfg = RegenerateConfig(
        endpoint=url, served_model=model, data=str(data), output=str(out), concurrency=concurrency, **options
    )
    totals = Totals()
    started = time.perf_counter()
    code = regenerate(cfg, show_progress=False, echo=lambda line: None, totals=totals)
    wall = time.perf_counter() - started
    return {
        "code": code,
        "requests": totals.requests,
        "tokens": totals.tokens,
        "seconds": round(totals.seconds, 3),
        "wall_s": round(wall, 2),
    }


def _endpoint(port: int, delay: float) -> subprocess.Popen:
    script = ROOT / "tests" / "support" / "chat_servers.py"
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}:{ROOT / 'src'}")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port), str(delay)], stdout=subprocess.PIPE, text=True, env=env
    )
    proc.stdout.readline()  # "listening on ..."
    return proc


def _endpoint_counts(proc: subprocess.Popen) -> dict:
    proc.terminate()
    last = [line for line in proc.communicate(timeout=30)[0].splitlines() if line.startswith("requests")]
    words = last[-1].split() if last else ["requests", "0", "most_in_flight", "0"]
    return {"endpoint_requests": int(words[1]), "most_in_flight": int(words[3])}


def client(args) -> None:
    from support.chat_servers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        data = _prompts(Path(tmp) / "prompts.jsonl", args.rows)
        for label, delay, concurrency in (
            ("instant", 0.0, args.concurrency),
            ("held", args.delay, args.inflight),
        ):
            port = free_port()
            proc = _endpoint(port, delay)
            try:
                result = _job(
                    f"http://127.0.0.1:{port}/v1",
                    "instant",
                    data,
                    Path(tmp) / label,
                    concurrency,
                    chunk_rows=10000,
                    max_retries=0,
                )
            finally:
                counts = _endpoint_counts(proc)
            rate = result["requests"] / result["seconds"]
            print(
                json.dumps(
                    {
                        "mode": "client",
                        "endpoint": label,
                        "delay_s": delay,
                        "concurrency": concurrency,
                        **result,
                        **counts,
                        "requests_per_s": round(rate, 1),
                        "littles_law_in_flight": round(rate * delay, 1),
                    }
                ),
                flush=True,
            )


def _served(root: Path, continuous_batching: bool):
    from support.chat_servers import start_transformers_serve

    from hsextract.demo import build_model, build_tokenizer

    model_dir = root / "model"
    if continuous_batching:  # a full-attention model: continuous batching has no cache for linear attention
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tokenizer = build_tokenizer(model_dir)
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.pad_token_id,
            max_position_embeddings=4096,
        )
        Qwen3ForCausalLM(config).save_pretrained(str(model_dir))
        repo = "hsextract/tiny-qwen3"
    else:
        build_model(model_dir)
        repo = "hsextract/tiny-qwen3_5"
    return start_transformers_serve(
        model_dir, root, repo, extra=["--continuous-batching"] * continuous_batching
    )


def server(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        served = _served(root, args.continuous_batching)
        try:
            data = _prompts(root / "prompts.jsonl", args.rows)
            sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
            _loop(served.url, served.model, 2, sampling)  # the model loaded, its first forward done
            t0 = time.perf_counter()
            loop_tokens = _loop(served.url, served.model, args.rows, sampling)
            loop_s = time.perf_counter() - t0
            job = _job(served.url, served.model, data, root / "out", args.concurrency, **sampling)
        finally:
            served.stop()
    print(
        json.dumps(
            {
                "mode": "server",
                "model": served.model,
                "continuous_batching": args.continuous_batching,
                "rows": args.rows,
                "max_tokens": args.max_tokens,
                "concurrency": args.concurrency,
                "loop_tokens": loop_tokens,
                "loop_s": round(loop_s, 2),
                "loop_tok_s": round(loop_tokens / loop_s, 1),
                "job_tokens": job["tokens"],
                "job_s": job["seconds"],
                "job_tok_s": round(job["tokens"] / job["seconds"], 1),
                "speedup": round((job["tokens"] / job["seconds"]) / (loop_tokens / loop_s), 2),
            }
        ),
        flush=True,
    )


def _loop(url: str, model: str, n: int, sampling: dict) -> int:
    """The same requests, one at a time, by the plainest client there is."""
    tokens = 0
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"prompt {i}: say"}], **sampling}
        request = urllib.request.Request(
            url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            tokens += json.loads(response.read())["usage"]["completion_tokens"]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    c = modes.add_parser("client", help="requests/s and requests in flight of one process, loopback endpoint")
    c.add_argument("--rows", type=int, default=40000)
    c.add_argument("--concurrency", type=int, default=256)
    c.add_argument(
        "--inflight", type=int, default=2048, help="concurrency against the endpoint that holds replies"
    )
    c.add_argument("--delay", type=float, default=1.0, help="seconds that endpoint holds each reply")
    s = modes.add_parser("server", help="tokens/s against transformers serve vs a sequential loop")
    s.add_argument("--rows", type=int, default=48)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--concurrency", type=int, default=16)
    s.add_argument("--continuous-batching", action="store_true")
    args = parser.parse_args()
    {"client": client, "server": server}[args.mode](args)


if __name__ == "__main__":
    main()
