"""The Python API: every trainer of the command line, built from Python objects.

::

    import padless

    trainer = padless.SFT(
        model="tiny-qwen2",  # a name or folder, or a loaded PreTrainedModel (with tokenizer=...)
        train_data=[{"prompt": "2 + 3 =", "completion": " 5"}],  # or a datasets.Dataset / IterableDataset
        train={"max_steps": 10, "output_dir": "runs/api"},  # any config section, as in the YAML
    )
    metrics = trainer.train()

One class per command (:data:`TRAINERS` is the table both read), one mechanism for all of them: the
arguments become the command's config (the same pydantic model as the YAML file; ``config=`` takes a YAML
path, a dict or a config object, keyword sections are merged over it), and ``train()`` runs exactly what
``padless <command>`` runs on that config. Python objects go where the YAML has text:

- a model (``PreTrainedModel``, PEFT model) at any model key (``model.name``, ``dpo.ref_model``,
  ``reward.model``, ...) is written once to a folder in padless's cache named by a hash of its files (with
  ``tokenizer=`` for ``model.name``; else the tokenizer its ``name_or_path`` names, else the trained
  model's) and loaded from there like any folder: the
  same checks, the same load-time proof, the same refusals, and the saved config names a folder that
  loads again;
- data (``datasets.Dataset`` / ``DatasetDict`` / ``IterableDataset``, a list of dicts) and callables
  (reward functions, tools, an environment class) are registered under a ``python:<name>`` the config
  carries (:mod:`padless.data.given`) and read through the same code as files and ``module:function``
  specs.

Every failure raises :class:`padless.errors.PadlessError` with the one line the command line prints and
its category (``input``: exit code 2, ``fault``: 1); the original exception is its ``__cause__``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from padless.config.loading import ConfigModel, from_dict, load_config
from padless.data import given
from padless.errors import InputError, PadlessError, describe

SCHEMA = "padless.config.schema:"
# command -> (its config class, the function that trains it, what it does); the CLI reads this table too
TRAINERS = {
    "sft": (SCHEMA + "SFTConfig", "padless.trainers.sft:run_sft", "supervised fine-tuning"),
    "dpo": (SCHEMA + "DPOConfig", "padless.trainers.dpo:run_dpo", "direct preference optimisation"),
    "rm": (SCHEMA + "RMConfig", "padless.trainers.rm:run_rm", "reward model (Bradley-Terry)"),
    "kto": (SCHEMA + "KTOConfig", "padless.trainers.kto:run_kto", "KTO on completions labelled good or bad"),
    "orpo": (SCHEMA + "ORPOConfig", "padless.trainers.orpo:run_orpo", "odds-ratio preference optimisation"),
    "grpo": (SCHEMA + "GRPOConfig", "padless.trainers.grpo:run_grpo", "GRPO with verifiable rewards"),
    "ppo": (SCHEMA + "PPOConfig", "padless.trainers.ppo:run_ppo", "PPO with a value model"),
    "distill": (SCHEMA + "DistillConfig", "padless.trainers.distill:run_distill", "distil a frozen teacher"),
}

# keyword arguments that stand for a config key (the names TRL users know)
SHORTCUTS = {
    "model": "model.name",
    "train_data": "data.train",
    "eval_data": "data.eval",
    "reward_functions": "reward.functions",
    "environment": "rollout.environment",
    "tools": "rollout.tools",
}


def load_target(target: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def offline_run() -> Iterator[None]:
    """What every command and API run does around its work: nothing is downloaded (peft would ask the hub
    about LoRA bases), and a run that stopped gives back its folder's lock and log file."""
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        from padless.run.rundir import end_all_runs

        end_all_runs()
        if offline is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


@contextlib.contextmanager
def failure_logged(command: str) -> Iterator[None]:
    """A run that fails writes the line it ends with into its ``log.txt`` while it still holds it (the
    command line prints the same line; an API caller gets it as the exception's message)."""
    try:
        yield
    except BaseException as e:
        from padless.run.interrupts import interruption
        from padless.run.logs import log_failure

        log_failure(f"padless {command}: error: {describe(interruption(e))}")
        raise


@contextlib.contextmanager
def raised_as_padless() -> Iterator[None]:
    """Any failure leaves as :class:`PadlessError` with the command line's message and category;
    Ctrl-C stays a ``KeyboardInterrupt`` (after the run checkpointed what it had trained)."""
    try:
        yield
    except (PadlessError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise PadlessError.of(e) from e


def _is_model(value: Any) -> bool:
    import torch

    return isinstance(value, torch.nn.Module) and callable(getattr(value, "save_pretrained", None))


def _plain(value: Any) -> bool:
    """What a YAML file could hold."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, Mapping) and all(isinstance(k, str) and _plain(v) for k, v in value.items())


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _config_data(config: Any, cls: type[ConfigModel]) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return load_config(cls, config).model_dump(exclude_unset=True)
    if isinstance(config, ConfigModel):
        if not isinstance(config, cls):
            raise InputError(
                f"config is a {type(config).__name__}, and this trainer reads a {cls.__name__}; fix: build a "
                f"{cls.__name__} (padless.config.schema), or pass a dict or a YAML path"
            )
        return config.model_dump(exclude_unset=True)
    if isinstance(config, Mapping):
        return dict(config)
    raise InputError(
        f"config is a {type(config).__name__}; fix: pass a YAML path, a dict of sections or a {cls.__name__}"
    )


def model_folder(model: Any, tokenizer: Any, key: str, fallback: Callable[[], Any] | None = None) -> Path:
    """``model`` (a loaded model, or a folder name when only ``tokenizer`` is an object) with ``tokenizer``
    (else the one its ``name_or_path`` names, else ``fallback()``) as a folder in padless's cache named by a
    hash of its files: written once, loaded like any folder."""
    import xxhash

    from padless.data import sources
    from padless.data.cache import default_root

    root = default_root() / "models"
    tmp = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        if isinstance(model, str):  # a folder name with a tokenizer object: the folder's files, linked
            if sources.embedded(model):
                raise InputError(
                    f"{key} {model!r} is an embedded model, which comes with its own tokenizer; fix: pass "
                    "the tokenizer with a model folder or a loaded model, or leave tokenizer out"
                )
            for file in sources.local_folder(model).iterdir():
                (tmp / file.name).symlink_to(file.resolve(), target_is_directory=file.is_dir())
        else:
            model.save_pretrained(tmp)
        if tokenizer is None and not isinstance(model, str):
            tokenizer = _own_tokenizer(model, key) or (fallback() if fallback else None)
            if tokenizer is None:
                raise InputError(
                    f"{key}: the {type(model).__name__} given names no folder its tokenizer could come from "
                    "(name_or_path is empty); fix: pass tokenizer= (the tokenizer or processor it was "
                    "trained with)"
                )
        if tokenizer is not None:
            for file in tmp.iterdir():  # the tokenizer given replaces any the folder had
                if file.is_symlink() and (file.name.startswith("tokenizer") or file.suffix == ".jinja"):
                    file.unlink()
            tokenizer.save_pretrained(tmp)
        digest = xxhash.xxh3_128()
        for file in sorted(tmp.rglob("*")):
            if file.is_file():
                digest.update(str(file.relative_to(tmp)).encode() + b"\0")
                with file.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
        folder = root / digest.hexdigest()
        if folder.exists():
            return folder
        os.replace(tmp, folder)
        return folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _own_tokenizer(model: Any, key: str) -> Any:
    """The tokenizer of the name or folder a loaded model came from."""
    from padless.data import sources

    name = getattr(model, "name_or_path", "") or ""
    try:
        return sources.load_tokenizer(name) if name else None
    except (InputError, OSError, ValueError):
        raise InputError(
            f"{key}: the model given came from {name!r}, whose tokenizer padless cannot load; fix: pass "
            "tokenizer= (the tokenizer or processor the model was trained with)"
        ) from None


class Trainer:
    """A padless trainer built from Python objects; ``train()`` runs it and returns its final metrics.

    ``config``: a YAML path, a dict of sections or a config object of the trainer's class; every other
    keyword argument that names a config section (``train={...}``, ``data={...}``) is merged over it, and
    ``model``, ``train_data``, ``eval_data``, ``reward_functions``, ``environment`` and ``tools`` set their
    keys (:data:`SHORTCUTS`). ``tokenizer``: the tokenizer or processor of ``model``. ``config`` is the
    checked config (models handed in stand there as ``python:<key>`` until ``train()`` writes them).
    """

    command: ClassVar[str]

    def __init__(self, config: Any = None, *, tokenizer: Any = None, **arguments: Any) -> None:
        self.objects: dict[str, Any] = {}  # python:<name> -> object, served while the run runs
        self.models: dict[str, tuple[Any, Any]] = {}  # config key -> (model, tokenizer), written at train()
        with raised_as_padless():
            cls = load_target(TRAINERS[self.command][0])
            if isinstance(config, cls) and tokenizer is None and not arguments:
                self.config = config.model_copy(deep=True)
                return
            sections: dict[str, Any] = {}
            for name, value in arguments.items():
                if name in SHORTCUTS:
                    section, _, key = SHORTCUTS[name].partition(".")
                    if isinstance(arguments.get(section), Mapping) and key in arguments[section]:
                        raise InputError(
                            f"{name}= and {section}={{{key!r}: ...}} both set {SHORTCUTS[name]}; fix: give "
                            "one"
                        )
                    value = {section: {key: value}}
                else:
                    value = {name: value}
                sections = _merge(sections, value)
            data = _merge(_config_data(config, cls), sections)
            if tokenizer is not None:
                default = cls.model_fields["model"].get_default(call_default_factory=True).name
                self.models["model.name"] = (data.get("model", {}).get("name", default), tokenizer)
                data = _merge(data, {"model": {"name": given.PREFIX + "model.name"}})
            self.config = from_dict(cls, self._hand_in(data, cls, ""))

    def _hand_in(self, data: dict[str, Any], cls: type, prefix: str) -> dict[str, Any]:
        """``data`` with every Python object replaced by the text that stands for it (see the module)."""
        from padless.config.loading import _is_model as is_section
        from padless.config.loading import _takes_text as takes_text

        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None or isinstance(value, str) or value is None:  # unknown keys: refused as in YAML
                continue
            key = prefix + name
            if is_section(field.annotation) and isinstance(value, Mapping):
                out[name] = self._hand_in(dict(value), field.annotation, key + ".")
            elif isinstance(value, os.PathLike):
                out[name] = os.fspath(value)
            elif _is_model(value):
                self.models[key] = (value, None)
                out[name] = given.PREFIX + key
            elif takes_text(field.annotation) and not isinstance(value, (bool, int, float)):
                out[name] = given.register(_rows(value), key, self.objects)  # data, a callable, a class
            elif isinstance(value, (list, tuple)):  # reward functions, tools: names and callables
                out[name] = [v if _plain(v) else given.register(v, key, self.objects) for v in value]
        return out

    def train(self) -> dict[str, float]:
        """Run the trainer as ``padless <command>`` runs it; its final metrics (each one's last value).

        Models handed in are written to their folders first, and the config that runs (and is saved in the
        run folder) names those folders."""
        with raised_as_padless(), offline_run(), failure_logged(self.command), given.serving(self.objects):
            config = self.config.model_copy(deep=True)
            for key in sorted(self.models, key=lambda k: k != "model.name"):  # the trained model first
                model, tokenizer = self.models[key]
                *sections, name = key.split(".")
                section = config
                for part in sections:
                    section = getattr(section, part)
                setattr(section, name, str(model_folder(model, tokenizer, key, lambda: trained(config))))
            return run(self.command, config)


def trained(config: ConfigModel) -> Any:
    """The trained model's tokenizer: other model objects handed in without one of their own share it."""
    from padless.data.sources import load_tokenizer

    return load_tokenizer(config.model.name, config.model.trust_remote_code)


def _rows(value: Any) -> Any:
    """An ``IterableDataset`` read once into a ``Dataset`` (padless plans batches by every row's length);
    anything else as it is."""
    import datasets

    if isinstance(value, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(value), features=value.features)
    return value


def run(command: str, config: ConfigModel) -> dict[str, float]:
    """Train ``config`` with the trainer of ``command``: what the CLI and :meth:`Trainer.train` both call."""
    return load_target(TRAINERS[command][1])(config)


def _trainer(command: str) -> type[Trainer]:
    title = TRAINERS[command][2]
    doc = f"{title[0].upper()}{title[1:]} (``padless {command}``): see :class:`Trainer`."
    return type(command.upper(), (Trainer,), {"command": command, "__doc__": doc, "__module__": __name__})


CLASSES = {command: _trainer(command) for command in TRAINERS}
SFT, DPO, RM = CLASSES["sft"], CLASSES["dpo"], CLASSES["rm"]
KTO, ORPO = CLASSES["kto"], CLASSES["orpo"]
GRPO, PPO, DISTILL = CLASSES["grpo"], CLASSES["ppo"], CLASSES["distill"]


def trainer(command: str, config: Any = None, **arguments: Any) -> Trainer:
    """The trainer of any command by name (``trainer("sft", ...)``)."""
    if command not in TRAINERS:
        raise PadlessError.of(InputError(f"no trainer {command!r}; fix: use one of {', '.join(TRAINERS)}"))
    return CLASSES[command](config, **arguments)
