"""``train()``: data files + a checkpoint -> a fine-tuned checkpoint folder, written all at once.

The run works in a hidden sibling of the output folder, ``.<name>.unlimisum-train/``: the
trainer's checkpoints go to its ``checkpoints/``, the final model to its ``model/``, which is
renamed to the output folder only when it is complete. A run that fails leaves no output folder;
its sibling stays only when it holds a checkpoint, for ``resume=True`` to continue from.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from unlimisum.config import DEFAULT_RETRIEVAL_K, ModelConfig
from unlimisum.errors import ConfigError
from unlimisum.training.config import TrainConfig
from unlimisum.training.errors import require_training_extras

REPORT_NAME = "unlimisum-train.json"


@dataclass(frozen=True)
class TrainResult:
    """What a run produced: where, how many steps, and its validation figures."""

    output_dir: Path
    report: dict  # the contents of unlimisum-train.json
    modes: tuple = ()  # attention mode of each training batch of this run (long methods), in order

    @property
    def steps(self) -> int:
        """Optimizer steps of the whole run (a resumed run counts those before the resume)."""
        return self.report["steps"]

    @property
    def final_validation(self) -> dict | None:
        """Validation figures of the saved model, when there was a validation set."""
        return self.report["final_validation"]


def work_folder(output_dir: Path) -> Path:
    """The hidden sibling a run of ``output_dir`` works in."""
    return output_dir.parent / f".{output_dir.name}.unlimisum-train"


def _last_checkpoint(folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    checkpoints = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
                   and p.name.removeprefix("checkpoint-").isdigit()]
    return max(checkpoints, key=lambda p: int(p.name.removeprefix("checkpoint-")), default=None)


def _check_folders(output_dir: Path, work: Path, config: TrainConfig) -> Path | None:
    """The checkpoint to resume from (None: a fresh run); ConfigError when the folders say otherwise."""
    if output_dir.exists() and not config.overwrite:
        raise ConfigError(f"output folder '{output_dir}' exists; choose another or pass --overwrite")
    last = _last_checkpoint(work / "checkpoints")
    if config.resume:
        if last is None:
            raise ConfigError(f"nothing to resume: '{work}' holds no checkpoint of an earlier run")
        return last
    if last is not None:
        raise ConfigError(f"'{work}' holds checkpoints of an unfinished run; pass --resume to continue it, "
                          "or delete it")
    if work.exists():
        shutil.rmtree(work)  # an earlier failed run that left no checkpoint
    return None


def _precision(config: TrainConfig, device) -> dict:
    import torch

    precision = config.precision
    if precision == "auto":
        if device.type != "cuda":
            return {}
        precision = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if precision != "float32" and device.type == "cpu":
        raise ConfigError(f"precision {precision} needs a GPU; use float32 (or auto) on the CPU")
    return {"bfloat16": {"bf16": True}, "float16": {"fp16": True}}.get(precision, {})


def train(
    data: str | Path | Sequence[str | Path],
    *,
    model: str,
    output_dir: str | Path,
    config: TrainConfig | None = None,
    tokenizer: str | None = None,
    progress: Callable | None = None,
    callbacks: Sequence = (),
    **options,
) -> TrainResult:
    """Fine-tune ``model`` on ``data`` files with one of the paper's methods; save it to ``output_dir``.

    ``options`` are TrainConfig fields (``method``, ``max_steps``, ``validation``...), applied over
    ``config``. ``progress`` receives ``TrainProgress`` reports; ``callbacks`` are extra
    transformers TrainerCallbacks. Every expected failure is a one-line UnlimisumError:
    TrainingDataError (file and row) for bad data, ConfigError for settings and folders.
    """
    require_training_extras()
    config = replace(config or TrainConfig(), **options)
    paths = [data] if isinstance(data, (str, Path)) else list(data)
    output_dir = Path(output_dir)
    work = work_folder(output_dir)
    resume_from = _check_folders(output_dir, work, config)
    try:
        with tempfile.TemporaryDirectory(prefix="unlimisum-train-") as cache_dir:
            return _run(paths, model, tokenizer, output_dir, work, config, resume_from, cache_dir,
                        progress, callbacks)
    except BaseException:
        if _last_checkpoint(work / "checkpoints") is None:
            shutil.rmtree(work, ignore_errors=True)
        raise


def _run(paths, model_name, tokenizer_name, output_dir, work, config, resume_from, cache_dir, progress, callbacks):
    import torch
    import transformers
    from transformers import DataCollatorForSeq2Seq, PrinterCallback, Seq2SeqTrainingArguments

    from unlimisum.version import __version__
    from unlimisum.models import load_model, resolve_device
    from unlimisum.models.compat import quiet_transformers
    from unlimisum.training.data import read_data, tokenize_rows
    from unlimisum.training.trainer import MethodSetup, ProgressReporter, UnlimiformerTrainer

    quiet_transformers()
    train_rows, validation_rows = read_data(paths, config, cache_dir)  # before any weights are read
    device = resolve_device(config.device)
    precision = _precision(config, device)
    loaded = load_model(ModelConfig(name=model_name, tokenizer=tokenizer_name, device="cpu", dtype="float32"))
    tokenizer = loaded.tokenizer
    tokenizer.padding_side = "right"  # encode_long reads each example from its first position
    window = loaded.max_source_length
    top_k = config.retrieval_k or min(window, DEFAULT_RETRIEVAL_K)
    features = tokenize_rows(train_rows, tokenizer, config, window, loaded.max_target_length)
    if validation_rows is not None:
        tokenize_rows(validation_rows, tokenizer, replace(config, method="retrieval"), window,
                      loaded.max_target_length)  # the same checks for validation rows
    setup = MethodSetup(
        method=config.method, architecture=loaded.architecture, window=window, overlap=config.overlap, top_k=top_k,
        max_input_tokens=config.max_input_tokens, eval_max_new_tokens=config.eval_max_new_tokens,
        eval_num_beams=config.eval_num_beams, seed=config.seed, name=model_name,
    )
    validating = validation_rows is not None
    args = Seq2SeqTrainingArguments(
        output_dir=str(work / "checkpoints"),
        max_steps=config.max_steps if config.max_steps is not None else -1,
        num_train_epochs=config.epochs,
        learning_rate=config.learning_rate,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        seed=config.seed,
        data_seed=config.seed,
        use_cpu=device.type == "cpu",
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        eval_strategy="steps" if validating else "no",
        eval_steps=config.save_steps if validating else None,
        load_best_model_at_end=validating,
        metric_for_best_model=config.metric if validating else None,
        greater_is_better=config.metric != "loss" if validating else None,
        logging_strategy="steps",
        logging_steps=config.logging_steps,
        report_to="none",
        disable_tqdm=True,
        log_level="error",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **precision,
    )
    if config.gradient_checkpointing:  # here rather than in the arguments, whose name changes in transformers 6
        if hasattr(loaded.model, "activation_checkpointing_enable"):  # the new name in late transformers 5
            loaded.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            loaded.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reporters = [ProgressReporter(progress)] if progress is not None else []
    trainer = UnlimiformerTrainer(
        model=loaded.model, args=args, train_dataset=features, eval_dataset=validation_rows, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=[*reporters, *callbacks], setup=setup, validation_rows=validation_rows,
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log to stdout; progress goes to `progress`
    outcome = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    final_validation = None
    if validating:
        scores = trainer.evaluate(metric_key_prefix="final")  # the kept model; "final_" keeps it out of progress
        final_validation = {key.removeprefix("final_"): value for key, value in scores.items()}
    final = work / "model"
    trainer.save_model(str(final))  # weights (safetensors), config, generation config, tokenizer
    (final / "training_args.bin").unlink(missing_ok=True)  # a pickle; the settings are in the report
    state = trainer.state
    history = [{"step": entry["step"], **{k.removeprefix("eval_"): v for k, v in entry.items() if k.startswith("eval_")}}
               for entry in state.log_history if any(k.startswith("eval_") for k in entry)]
    settings = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(config).items()}
    report = {
        "unlimisum": __version__, "transformers": transformers.__version__, "torch": torch.__version__,
        "base_model": model_name, "method": config.method, "settings": settings,
        "window": window, "retrieval_k": top_k,
        "data": {"train_files": [str(p) for p in paths], "validation_files": list(config.validation),
                 "train_rows": len(train_rows), "train_examples": len(features),
                 "validation_rows": len(validation_rows) if validating else 0},
        "steps": state.global_step,
        "resumed_from_step": int(resume_from.name.removeprefix("checkpoint-")) if resume_from is not None else None,
        "train_loss": outcome.training_loss,
        "validation": history,  # every validation during training
        "final_validation": final_validation,
        "best": ({"metric": config.metric, "value": state.best_metric, "step": state.best_global_step}
                 if validating and state.best_metric is not None else None),
    }
    (final / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    _publish(final, output_dir, work)
    return TrainResult(output_dir=output_dir, report=report, modes=tuple(trainer.modes))


def _publish(final: Path, output_dir: Path, work: Path) -> None:
    """Rename the complete model folder to ``output_dir`` (replacing an old one), then drop the work folder."""
    if output_dir.exists():
        old = work / "previous-output"
        output_dir.rename(old)
    final.rename(output_dir)
    shutil.rmtree(work, ignore_errors=True)
