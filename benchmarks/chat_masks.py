"""Chat loss masks without ``{% generation %}`` markers: one render per row vs prefix-by-prefix rendering.

Real chat templates (Qwen2.5, Llama 3) have no generation markers, so padless finds each assistant turn by
rendering. Three contenders tokenize the same rows with the embedded tokenizer, in one process, interleaved
(``--repeats`` rounds, each started by another contender; median shown):

* ``prefixes``  padless before issue 13: every row rendered 2k+1 times for k assistant turns (the whole chat,
  then per turn the messages before it with the generation prompt and the messages up to it);
* ``layout``    padless now: the prefixes are rendered once per conversation shape with placeholder
  contents, then every row once (plus one tokenizer call for the short texts around turn boundaries);
* ``markers``   reference: the same template with ``{% generation %}`` markers, one render with
  ``return_assistant_tokens_mask``.

Rows are synthetic chats of k user/assistant exchanges whose contents are drawn from ``tiny:sft``; every
contender runs the same per-row encoder call (validation, rendering, tokenizing, mask) and the three must
return the same ids and masks. Each contender gets a fresh encoder per round, so ``layout`` pays for its
shape analysis inside the timing. Tokenizer threads are off (``TOKENIZERS_PARALLELISM=false``).

    python benchmarks/chat_masks.py                  # k = 1, 4, 16
    python benchmarks/chat_masks.py --turns 1 2 8 --rows 100 --repeats 5
    python benchmarks/chat_masks.py --quick          # smoke run, seconds
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import time
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common


def _chats(k: int, rows: int, seed: int) -> list[Any]:
    """``rows`` chats of k exchanges, contents drawn from the embedded SFT data."""
    from padless.data import Row, load_rows

    users, answers = [], []
    for row in load_rows("tiny:sft"):
        for m in row.data["messages"]:
            (answers if m["role"] == "assistant" else users).append(m["content"])
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        chat = []
        for _ in range(k):
            chat += [
                {"role": "user", "content": rng.choice(users)},
                {"role": "assistant", "content": rng.choice(answers)},
            ]
        out.append(Row({"messages": chat}, "synthetic", i + 1, "row"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16], help="assistant turns per chat")
    p.add_argument("--rows", type=int, default=200, help="rows per turn count")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: k = 1, 4 on 10 rows, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.rows, args.repeats = [1, 4], 10, 1
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    from padless.data.sft import SftEncoder
    from padless.tiny import tiny_tokenizer

    class PrefixEncoder(SftEncoder):
        """Every row rendered prefix by prefix, as before issue 13."""

        def _chat_by_layout(self, row: Any, messages: list[dict[str, Any]], turns: tuple[int, ...]) -> None:
            return None

    marked = tiny_tokenizer()
    plain = tiny_tokenizer()
    plain.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", plain.chat_template)
    renders = [0]
    apply = plain.apply_chat_template

    def counted(*a: Any, **kw: Any) -> Any:
        renders[0] += 1
        return apply(*a, **kw)

    plain.apply_chat_template = counted
    contenders = {
        "prefixes": lambda: PrefixEncoder(plain),
        "layout": lambda: SftEncoder(plain),
        "markers": lambda: SftEncoder(marked),
    }

    env = common.environment(("padless", "transformers", "tokenizers"))
    print(
        f"{env['date']}  {env['cpu']}, 1 thread, transformers {env['versions']['transformers']}, "
        f"tokenizers {env['versions']['tokenizers']}, load {env.get('loadavg_start')}"
    )
    table = []
    for k in args.turns:
        rows = _chats(k, args.rows, seed=k)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        calls: dict[str, int] = {}
        outputs: dict[str, list[Any]] = {}
        names = list(contenders)
        for r in range(args.repeats):
            for name in names[r % 3 :] + names[: r % 3]:  # each contender goes first in turn
                make = contenders[name]
                enc, renders[0] = make(), 0
                start = time.perf_counter()
                got = [enc.messages_row(row) for row in rows]
                times[name].append(time.perf_counter() - start)
                calls[name], outputs[name] = renders[0], got
        assert outputs["prefixes"] == outputs["layout"] == outputs["markers"], "contenders disagree"
        rate = {name: len(rows) / statistics.median(ts) for name, ts in times.items()}
        tokens = sum(len(ids) for ids, _ in outputs["layout"]) / len(rows)
        table.append(
            [
                k,
                len(rows),
                f"{tokens:,.0f}",
                f"{calls['prefixes'] / len(rows):.2f}",
                f"{calls['layout'] / len(rows):.2f}",
                f"{rate['prefixes']:,.0f}",
                f"{rate['layout']:,.0f}",
                f"{rate['markers']:,.0f}",
                f"{rate['layout'] / rate['prefixes']:.2f}x",
                f"{rate['layout'] / rate['markers']:.2f}x",
            ]
        )
        print(f"k={k}: " + ", ".join(f"{n} {r:,.0f} rows/s" for n, r in rate.items()), flush=True)
    print()
    print(
        common.markdown_table(
            [
                "turns k",
                "rows",
                "tokens/row",
                "renders/row prefixes",
                "renders/row layout",
                "rows/s prefixes",
                "rows/s layout",
                "rows/s markers",
                "layout / prefixes",
                "layout / markers",
            ],
            table,
        )
    )


if __name__ == "__main__":
    main()
