"""What rendering as the server renders costs preparation: CPU per row of ``RowEncoder.encode`` on the realistic mix
(real ShareGPT turn pairs, the real Qwen3.5/3.6 tokenizer, as ``bench_scale.py`` builds them) with a share of
tool-call rows (OpenAI-style ``arguments`` as JSON strings, a tool response, a final answer with reasoning).

Modes, each in a fresh process on the same rows (``--src`` runs one with another checkout's code, the "before"):
``chatml`` (the tokenizer's ChatML template, no arguments), ``chatml-kwargs`` (the same with
``chat_template_kwargs``), ``qwen36-kwargs`` (Qwen3.6's public template given as ``--chat-template`` with
``{"enable_thinking": false, "preserve_thinking": true}``). Preparation's cost is linear in rows beyond ~14 CPU-s
of fixed cost (docs/PERFORMANCE.md), so the ratio per row is the ratio at 914k rows.

    pip install -e '.[bench]'
    git archive HEAD~N src | tar -x -C /tmp/before          # the code to compare against
    python scripts/bench_chat.py --rows 10000 --tool-share 0.1 --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

TEMPLATES = Path(__file__).parents[1] / "tests" / "data" / "chat_templates"
KWARGS = {"enable_thinking": False, "preserve_thinking": True}
MODES = {
    "chatml": (None, None),
    "chatml-kwargs": (None, KWARGS),
    "qwen36-kwargs": ("qwen3_6.jinja", KWARGS),
}


def tool_row(conv_id: str, turns: list[dict]) -> dict:
    """A ShareGPT piece as an agentic row: the user's question, a tool call with string arguments, the tool's
    answer (the reply's text), then the reply with reasoning."""
    question, reply = turns[0]["value"], turns[1]["value"]
    call = {"city": question[:40], "days": len(reply) % 7}
    return {
        "id": f"{conv_id}-tool",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Look something up",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "messages": [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps(call)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": reply[:200]},
            {"role": "assistant", "reasoning_content": "The tool answered.", "content": reply},
        ],
    }


def make_rows(rows: int, tool_share: float) -> list[dict]:
    from bench_scale import conversation_pieces

    out = []
    every = round(1 / tool_share) if tool_share else 0
    for n, (conv_id, k, turns) in enumerate(itertools.islice(conversation_pieces(), rows)):
        if every and n % every == 0 and len(turns) >= 2:
            out.append(tool_row(f"{conv_id}-{k}", turns))
        else:
            out.append({"id": f"{conv_id}-{k}", "conversations": turns})
    return out


def child(args) -> None:
    from hsextract.prepare import chat
    from hsextract.prepare.tiktoken_bpe import spec_of
    from hsextract.prepare.tokenize import load_tokenizer

    rows = json.loads(Path(args.rows_file).read_text())
    tokenizer = load_tokenizer(args.model)
    spec = spec_of(tokenizer)
    template, kwargs = MODES[args.mode]
    options = {}
    if template or kwargs:
        text = (TEMPLATES / template).read_text() if template else None
        options["chat"] = chat.ChatOptions.of(text, kwargs)
    start = time.process_time()
    encoder = chat.RowEncoder(tokenizer, 4096, "truncate", tiktoken=spec, **options)
    setup = time.process_time() - start
    kept = 0
    start = time.process_time()
    for i, row in enumerate(rows):
        kept += encoder.encode(i, row)[2] in ("kept", "truncated")
    cpu = time.process_time() - start
    print(json.dumps({"mode": args.mode, "rows": len(rows), "kept": kept, "cpu_s": cpu, "setup_s": setup}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--tool-share", type=float, default=0.1, help="share of rows made agentic (tool calls)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--before", help="another checkout's src/: runs the chatml mode with it first")
    ap.add_argument("--work", default="/tmp/hsextract-bench-chat")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from bench_scale import build_model_dir

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    build_model_dir(model)
    rows_file = work / f"rows-{args.rows}-{args.tool_share}.json"
    if not rows_file.exists():
        rows_file.write_text(json.dumps(make_rows(args.rows, args.tool_share)))
    runs = [("before", "chatml", args.before)] if args.before else []
    runs += [("now", mode, None) for mode in args.modes.split(",")]
    base = None
    print(f"{args.rows:,} rows, {args.tool_share:.0%} with tool calls; CPU ms a row of RowEncoder.encode")
    for label, mode, src in runs:
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        out = (
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    "--mode",
                    mode,
                    "--model",
                    str(model),
                    "--rows-file",
                    str(rows_file),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        r = json.loads(out)
        per_row = r["cpu_s"] / r["rows"] * 1e3
        base = base or per_row
        print(
            f"{label:<7}{mode:<15}{per_row:7.3f} ms a row ({per_row / base:.3f}x), {r['kept']:,} kept, "
            f"encoder set up in {r['setup_s']:.2f} CPU s"
        )


if __name__ == "__main__":
    main()
