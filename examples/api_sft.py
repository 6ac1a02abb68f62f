"""Supervised fine-tuning from Python (docs/api.md): rows built in memory, a model object, metrics back.

    python examples/api_sft.py

Each ``# %%`` cell runs on its own in Jupyter or VS Code. It trains the embedded tiny Qwen2 to add small
numbers on CPU in about a minute; the loss falls from about 8 to under 1.
"""

# %%
import json
import os
from pathlib import Path

import datasets

import padless
from padless.tiny import build_tiny_model, tiny_tokenizer

OUTPUT_DIR = os.environ.get("PADLESS_EXAMPLE_OUTPUT", "runs/api-sft")
MAX_STEPS = int(os.environ.get("PADLESS_EXAMPLE_STEPS", "40"))

# %% Data: any list of dicts or datasets.Dataset with the rows of docs/guides/sft.md
rows = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}"},
        ]
    }
    for a in range(12)
    for b in range(12)
]
dataset = datasets.Dataset.from_list(rows)

# %% Model: a name or folder, or a loaded model with its tokenizer (here the embedded tiny Qwen2 object)
model, tokenizer = build_tiny_model("tiny-qwen2"), tiny_tokenizer()

# %% Train: the config's sections as keyword arguments, with the YAML's keys
trainer = padless.SFT(
    model=model,
    tokenizer=tokenizer,
    train_data=dataset,
    train={
        "output_dir": OUTPUT_DIR,
        "overwrite_output_dir": True,
        "max_steps": MAX_STEPS,
        "learning_rate": 3e-3,
        "max_tokens_per_batch": 1024,
        "logging_steps": 5,
    },
)
metrics = trainer.train()
print({k: round(v, 4) for k, v in metrics.items()})

# %% What the run wrote: the loss of every logged step, the checkpoint, the config that ran
records = Path(OUTPUT_DIR, "metrics.jsonl").read_text().splitlines()
losses = [json.loads(line).get("train/loss") for line in records]
losses = [loss for loss in losses if loss is not None]
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}; checkpoint {Path(OUTPUT_DIR, f'checkpoint-{MAX_STEPS}')}")
