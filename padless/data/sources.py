"""Where a model and its tokenizer come from, checked before ``from_pretrained`` sees them.

A name is an embedded model (``tiny-qwen2``, or ``tiny-qwen2@3`` for init seed 3), a model shipped with
padless (``tiny-llama-arith``), a local folder, or a Hugging Face id already in the local cache. padless
never downloads during a run: every name is resolved to a local folder first and only folders reach
``from_pretrained`` (with ``local_files_only=True``), so nothing touches the network. A folder is checked
for what it claims to hold (``config.json``, safetensors weights whose sizes match their headers,
tokenizer files, custom code) so that a mistake is reported as that mistake, with the path and the fix,
rather than as whatever transformers trips over later. Weights are read from safetensors only: pickle
files are never loaded.

A LoRA adapter folder (``adapter_config.json``) loads its base model by ``base_model_name_or_path``
(an embedded name, a folder, or a cached id; a relative path is also looked up next to the adapter),
applies the adapter with peft and merges it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from padless import tiny
from padless.data.images import ImageInputs
from padless.errors import InputError
from padless.forward import vision
from padless.forward.engine import unwrap

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
PICKLE_WEIGHTS = ("pytorch_model.bin.index.json",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses bigger headers too
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def embedded(name: str) -> tuple[str, int | None] | None:
    """``("tiny-qwen2", None)`` for ``tiny-qwen2``, ``("tiny-qwen2", 3)`` for ``tiny-qwen2@3``, else None."""
    base, sep, seed = str(name).partition("@")
    if base not in tiny.TINY_MODELS:
        return None
    if not sep:
        return base, None
    if not seed.isdigit():
        raise InputError(
            f"model {name!r}: the part after '@' is the init seed of the embedded model and must be a whole "
            f"number; fix: write e.g. {base}@3, or just {base}"
        )
    return base, int(seed)


def embedded_name(base: str, seed: int) -> str:
    """The name that rebuilds this embedded model: adapters record it as their base."""
    return base if seed == 0 else f"{base}@{seed}"


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return shown or "nothing: the folder is empty"


def local_folder(name: str | Path, what: str = "model") -> Path:
    """The folder behind ``name``: a shipped model, the path itself, or the cached snapshot of a hub id."""
    if str(name) in tiny.SHIPPED_MODELS:
        return tiny.SHIPPED_MODELS[str(name)]
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(
                f"{what} {str(name)!r} is a file, not a folder; fix: pass the folder that holds config.json "
                f"(e.g. {path.parent})"
            )
        return path.resolve()
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    names = ", ".join([*tiny.TINY_MODELS, *tiny.SHIPPED_MODELS])
    try:
        return Path(snapshot_download(str(name), local_files_only=True))
    except HFValidationError:  # not a hub id: a path that does not exist
        raise InputError(
            f"{what} {str(name)!r}: no such folder (looked in {path.absolute()}); fix: check the path, or "
            f"use an embedded model ({names})"
        ) from None
    except (LocalEntryNotFoundError, OSError):
        raise InputError(
            f"{what} {str(name)!r} is neither a local folder nor in the Hugging Face cache ({HF_HUB_CACHE}); "
            f"padless never downloads during a run. Fix: download it first (hf download {name}), pass a "
            f"local folder, or use an embedded model ({names})"
        ) from None


def check_safetensors(file: Path) -> dict[str, Any]:
    """The header of a safetensors file (tensor name -> dtype, shape, offsets), after checking that the file
    holds every byte the header promises: a truncated or overwritten file is named here, not mid-load."""
    fix = "restore the file from a copy, or use an earlier checkpoint"
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{file}: corrupt safetensors file ({size} bytes, no header); fix: {fix}")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise InputError(
                f"{file}: corrupt safetensors file (header of {length} bytes in a file of {size}); fix: {fix}"
            )
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise InputError(f"{file}: corrupt safetensors file (bad header: {e}); fix: {fix}") from None
    if 8 + length + end != size:
        raise InputError(
            f"{file}: corrupt safetensors file (truncated: the header promises {8 + length + end} bytes, the "
            f"file has {size}); fix: {fix}"
        )
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(
            f"{file}: not valid JSON ({e}); fix: restore the file or re-save the model"
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{file}: expected a JSON object, got {type(data).__name__}; fix: restore the file")
    return data


def check_weights(folder: Path, name: str) -> None:
    """Safetensors weights that are whole; pickle-only weights are refused, never unpickled."""
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = [
            p.name for p in folder.iterdir() if p.name in PICKLE_WEIGHTS or p.suffix in PICKLE_SUFFIXES
        ]
        if pickled:
            raise InputError(
                f"{name}: holds only pickle weights ({', '.join(sorted(pickled))}), which padless never "
                "loads (unpickling runs code from the file); fix: convert them to safetensors once, in a "
                "session you trust: AutoModel.from_pretrained(folder).save_pretrained(folder)"
            )
        raise InputError(
            f"{name}: no weights (*.safetensors) in {folder} (found: {_listing(folder)}); fix: pass a folder "
            "written by save_pretrained, or a padless checkpoint"
        )
    for file in weights:
        check_safetensors(file)


def _not_a_model(folder: Path, name: str) -> InputError:
    checkpoints = sorted(folder.glob("checkpoint-*"))
    hint = (
        f"it holds run checkpoints: pass one of them, e.g. {checkpoints[-1]}"
        if checkpoints
        else "pass the folder written by save_pretrained (config.json and *.safetensors)"
    )
    found = _listing(folder)
    return InputError(f"{name} is not a model folder: no config.json (found: {found}); fix: {hint}")


def check_model_folder(folder: Path, name: str, trust_remote_code: bool) -> dict[str, Any]:
    """``config.json`` of a model folder, after checking the folder holds a loadable model."""
    config_file = folder / "config.json"
    if not config_file.exists():
        raise _not_a_model(folder, name)
    config = _read_json(config_file)
    if "model_type" not in config:
        raise InputError(
            f"{config_file}: no 'model_type' key, so transformers cannot tell which model this is; fix: "
            "re-save the model with save_pretrained"
        )
    if config.get("auto_map") and not trust_remote_code:
        raise InputError(
            f"{name} ships its own model code (auto_map in {config_file}), which padless does not run unless "
            "asked; fix: read that code, then set model.trust_remote_code: true (--trust-remote-code on the "
            "command line)"
        )
    check_weights(folder, name)
    return config


def check_tokenizer_folder(folder: Path, name: str, trust_remote_code: bool) -> None:
    if (folder / "config.json").exists():
        _read_json(folder / "config.json")  # AutoTokenizer reads it too, and reports it less clearly
    if not any((folder / f).exists() for f in TOKENIZER_FILES) and not list(folder.glob("*.tiktoken")):
        if not (folder / "config.json").exists():
            raise _not_a_model(folder, name)
        raise InputError(
            f"{name} has no tokenizer files ({', '.join(TOKENIZER_FILES)}; found: {_listing(folder)}); fix: "
            "save the base model's tokenizer into it (tokenizer.save_pretrained(folder)), or load the "
            "tokenizer from the base model's folder"
        )
    config_file = folder / "tokenizer_config.json"
    if config_file.exists() and _read_json(config_file).get("auto_map") and not trust_remote_code:
        raise InputError(
            f"{name} ships its own tokenizer code (auto_map in {config_file}), which padless does not run "
            "unless asked; fix: read that code, then set model.trust_remote_code: true"
        )


def load_tokenizer(name: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of an embedded name, a folder or a cached id (an adapter folder without tokenizer
    files: its base model's)."""
    from transformers import AutoTokenizer

    if (found := embedded(str(name))) and found[0] in tiny.VISION_MODELS:
        return load_processor(found[0]).tokenizer  # the text tokenizer plus the vision tokens
    if embedded(str(name)) or str(name) in tiny.SHIPPED_MODELS:
        return tiny.tiny_tokenizer()
    folder = local_folder(name)
    if (folder / ADAPTER_CONFIG).exists() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        return load_tokenizer(adapter_base(folder), trust_remote_code)
    check_tokenizer_folder(folder, str(name), trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InputError(
            f"cannot load the tokenizer in {folder}: {str(e).splitlines()[0]}; fix: re-save it with "
            "tokenizer.save_pretrained, or copy the base model's tokenizer files into it"
        ) from None
    if len(tokenizer) < 2:
        raise InputError(
            f"the tokenizer in {folder} has {len(tokenizer)} token(s); fix: copy the base model's tokenizer "
            "files into it"
        )
    if tokenizer.chat_template is None:
        tokenizer.chat_template = processor_chat_template(folder)
    return tokenizer


def stop_token_ids(name: str | Path) -> tuple[int, ...]:
    """The ids a model stops generating at, as its ``generation_config.json`` lists them (``eos_token_id``:
    some models stop at a role header or a tool-call token besides the tokenizer's eos); an adapter folder
    without one: its base model's. Embedded models stop at the tokenizer's eos alone: none."""
    if embedded(str(name)):
        return ()
    folder = local_folder(name)
    file = folder / "generation_config.json"
    if not file.exists() and (folder / ADAPTER_CONFIG).exists():
        return stop_token_ids(adapter_base(folder))
    if not file.exists():
        return ()
    eos = _read_json(file).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(
            f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}; fix: restore the file"
        )
    return tuple(sorted(set(ids)))


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a folder keeps for its processor (``chat_template.json``, as Hub vision-language
    folders ship it) when the tokenizer files hold none: transformers' processor loader reads it there."""
    file = folder / "chat_template.json"
    template = _read_json(file).get("chat_template") if file.exists() else None
    return template if isinstance(template, str) else None


def adapter_base(folder: Path) -> str:
    """The base model an adapter folder names, resolved to something loadable offline."""
    config = _read_json(folder / ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path")
    if not base:
        raise InputError(
            f"{folder / ADAPTER_CONFIG}: base_model_name_or_path is {base!r}, so the adapter's base model is "
            "unknown; fix: set it to the base model's folder, cached id or embedded name (e.g. tiny-qwen2)"
        )
    if embedded(base) or Path(base).expanduser().exists():
        return base
    beside = folder / base
    if beside.exists():
        return str(beside.resolve())
    try:
        local_folder(base)  # a cached hub id; else the base moved or is gone: say where it is named
    except InputError as e:
        said = re.split(r"[;.] [Ff]ix: ", str(e))[0]
        raise InputError(
            f"the LoRA adapter in {folder} names its base model in {folder / ADAPTER_CONFIG} "
            f"(base_model_name_or_path {base!r}), and it cannot be loaded: {said}; fix: put the base model "
            f"back there, or set base_model_name_or_path in {folder / ADAPTER_CONFIG} to where it is now"
        ) from None
    return base


def load_pretrained(
    name: str | Path,
    task: str,
    *,
    seed: int = 0,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> torch.nn.Module:
    """An embedded model built from its seed, or a checked local / cached folder through ``from_pretrained``.

    Adapters record the result's ``name_or_path`` as their base: the embedded name (with its seed), the
    absolute folder, or the hub id, each loadable offline.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if found := embedded(str(name)):
        base, named_seed = found
        if named_seed is not None and seed not in (0, named_seed):
            raise InputError(
                f"model {name!r} names init seed {named_seed}, but model.seed is {seed}; fix: give one"
            )
        seed = named_seed if named_seed is not None else seed
        model = tiny.build_tiny_model(base, seed=seed, task=task, **kwargs)
        model.name_or_path = embedded_name(base, seed)
        return model
    folder = local_folder(name)
    if (folder / ADAPTER_CONFIG).exists():
        return _load_adapter(folder, task, seed, trust_remote_code, **kwargs)
    config = check_model_folder(folder, str(name), trust_remote_code)
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    if task == "score" and "vision_config" not in config:
        kwargs["num_labels"] = 1
    try:
        if "vision_config" in config:  # AutoModelForCausalLM refuses vision-language configs
            model = vision.load_image_text_model(
                folder, task, local_files_only=True, trust_remote_code=trust_remote_code, **kwargs
            )
        else:
            model = auto.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=trust_remote_code, **kwargs
            )
    except StrictDataclassError as e:  # transformers validates the config against the load's settings
        said = " ".join(str(e).split())[:300]
        key = re.search(r"validate_(\w+)", said)
        what = f"remove or correct {key.group(1)!r}" if key else "correct what the message names"
        raise InputError(
            f"cannot load the model in {folder}: its config.json does not validate ({said}); fix: {what} "
            f"in {folder / 'config.json'}"
        ) from None
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise InputError(
            f"cannot load the model in {folder}: {str(e).splitlines()[0]}; fix: check that the folder was "
            "written by save_pretrained for this architecture and transformers version"
        ) from None
    model.name_or_path = str(name) if not Path(name).expanduser().exists() else str(folder)
    return model


def _load_adapter(
    folder: Path, task: str, seed: int, trust_remote_code: bool, **kwargs: Any
) -> torch.nn.Module:
    """Base model plus the LoRA adapter in ``folder``, merged; every adapter tensor must find its place."""
    from peft import PeftModel, get_peft_model_state_dict

    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists():
        check_weights(folder, str(folder))  # names pickle-only adapters
        raise InputError(f"{folder}: no {ADAPTER_WEIGHTS}; fix: pass the folder written by save_pretrained")
    header = check_safetensors(weights)
    base_name = adapter_base(folder)
    base = load_pretrained(base_name, task, seed=seed, trust_remote_code=trust_remote_code, **kwargs)
    try:
        model = PeftModel.from_pretrained(base, str(folder), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise InputError(
            f"cannot apply the adapter in {folder} to its base {base_name}: "
            f"{str(e).splitlines()[0]}; fix: load it onto the base model it was trained on"
        ) from None
    expected = get_peft_model_state_dict(model)
    missing = sorted(set(expected) - set(header))
    if missing or len(header) != len(expected):
        raise InputError(
            f"{weights} does not fit its base {base_name}: {len(header)} adapter tensors in the file, "
            f"{len(expected)} expected (first missing: {missing[:3]}); fix: load it onto the base model and "
            "LoRA settings it was trained with"
        )
    log.info("loaded LoRA adapter %s onto %s and merged it", folder, base_name)
    merged = model.merge_and_unload()
    merged.name_or_path = str(folder)  # a new adapter trained on this model has base + this adapter as base
    return merged


def require_scoring_model(name: str | Path) -> None:
    """A model used to score (``rm score``, ``reward.model``) must carry a trained scalar head."""
    if embedded(str(name)):
        raise InputError(
            f"{name} is an embedded, randomly initialised model: its scores would mean nothing; fix: train a "
            "reward model with `padless rm` and pass its checkpoint"
        )
    folder = local_folder(name, "reward model")
    if (folder / ADAPTER_CONFIG).exists() or not (folder / "config.json").exists():
        return  # an adapter, or not a model at all: loading says which
    config = _read_json(folder / "config.json")
    architectures = config.get("architectures") or []
    if config.get(vision.SCORE_FLAG):  # a vision-language model with padless's score head
        return
    if architectures and not any("SequenceClassification" in a or "Reward" in a for a in architectures):
        raise InputError(
            f"{name} is a {', '.join(architectures)}, not a reward model: its score head would be randomly "
            "initialised; fix: pass a reward model checkpoint (trained with `padless rm`, or any "
            "AutoModelForSequenceClassification with one label)"
        )


# Where a folder names its processor class, in the order transformers' own loaders read them: padless-saved
# folders write processor_config.json; Hub folders name it in preprocessor_config.json or
# tokenizer_config.json.
PROCESSOR_CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def _processor_class(folder: Path) -> str | None:
    """The processor class a model folder names, in whichever file its layout puts it; where none names
    one, the class transformers' ``AutoProcessor`` maps its ``config.json``'s ``model_type`` to."""
    for name in PROCESSOR_CLASS_FILES:
        if (file := folder / name).exists() and (cls_name := _read_json(file).get("processor_class")):
            return str(cls_name)
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = (
        _read_json(folder / "config.json").get("model_type") if (folder / "config.json").exists() else None
    )
    return PROCESSOR_MAPPING_NAMES.get(model_type)


def image_inputs(name_or_path: str | Path, model: torch.nn.Module) -> ImageInputs | None:
    """The image side of the model ``name_or_path`` (its processor, see
    :class:`padless.data.images.ImageInputs`), or None for a text-only model, which never builds one."""
    config = unwrap(model).config
    return ImageInputs(load_processor(name_or_path), config) if vision.is_vision_config(config) else None


def load_processor(name_or_path: str | Path) -> Any:
    """The model's processor (an embedded name, a folder or a cached id; never downloaded), with PIL image
    processing (no torchvision needed).

    ``AutoProcessor`` is used as is when it loads; when only the video processor is missing (no
    torchvision, or none saved), the same processor class is built without it (padless trains on images).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if (found := embedded(str(name_or_path))) and found[0] in tiny.VISION_MODELS:
        from padless.tiny.vlm import tiny_vlm_processor

        return tiny_vlm_processor()
    path = str(local_folder(name_or_path))
    try:
        return AutoProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    except (ImportError, OSError) as e:  # no torchvision, or a folder saved without a video processor
        if not {"torchvision", "video"} & set(re.findall(r"[a-z]+", str(e).lower())):
            raise
    import transformers

    cls_name = _processor_class(Path(path))
    if cls_name is None or not hasattr(transformers, cls_name):
        raise ValueError(
            f"{path}: AutoProcessor needs torchvision for this model's video processor and no "
            f"processor_class is named in {', '.join(PROCESSOR_CLASS_FILES)}, nor does config.json's "
            "model_type map to one, to build an image-only one; install torchvision or add "
            "processor_config.json with the processor_class"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = processor_chat_template(Path(path))
    return vision.image_only(getattr(transformers, cls_name))(
        image_processor, tokenizer, chat_template=tokenizer.chat_template
    )
