"""The names a user chooses among — attention backends, varlen kernels, dtypes, trackers — each defined
once: the config's types, the command line's choices and the code that runs them all read them here.
Imports no torch, like the config."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["varlen", "sdpa", "eager", "flex_attention", "flash_attention_2"]
VarlenKernel = Literal["auto", "sdpa", "torch", "flash_attn"]
DType = Literal["float32", "bfloat16", "float16"]
ModelDType = Literal["auto", DType]  # auto: bf16 on CUDA, fp32 on CPU
TreePacking = Literal["auto", "on", "off"]  # auto: on wherever the model and backend run tree rows exactly

BACKENDS: tuple[str, ...] = get_args(Backend)
VARLEN_KERNELS: tuple[str, ...] = get_args(VarlenKernel)
DTYPE_NAMES: tuple[str, ...] = get_args(DType)
TREE_PACKING: tuple[str, ...] = get_args(TreePacking)

# Where metrics go (train.report_to): files in the run folder, and experiment trackers, each an optional
# package (import name -> how to install it).
FILES = ("tensorboard", "jsonl")
TRACKERS: dict[str, str] = {
    "trackio": "pip install --no-deps trackio && pip install -r requirements-trackio.txt (trackio pins "
    "pillow<13, padless needs 13)",
    "wandb": "pip install 'padless[wandb]'",
    "mlflow": "pip install 'padless[mlflow]'",
}
REPORTERS: tuple[str, ...] = (*FILES, *TRACKERS)
