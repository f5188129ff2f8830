"""The two conversions: a Hugging Face folder into a params-only jaxpt checkpoint with its ``model.gin`` and
tokenizer (:func:`hf_to_jaxpt`), and a run's checkpoint into a folder ``transformers`` loads
(:func:`jaxpt_to_hf`); either side local or ``gs://`` (:mod:`jaxpt.hf`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from jaxpt import checkpoint as ckpt_lib, config as config_lib, mesh as mesh_lib
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.hf.configs import hf_config_from_model, model_config_from_hf, source_model_type
from jaxpt.hf.families import FAMILY_BOUNDARY, ConvertError
from jaxpt.hf.params import hf_tensors_from_params, load_hf_params
from jaxpt.hf.safetensors import SafetensorsFolder, write_safetensors
from jaxpt.infer.restore import restore
from jaxpt.run.record import RUN_FILE
from jaxpt.util import fs



#: Step of the converted checkpoint; a continued run's global steps count on from it.
CONVERTED_STEP = 0


def _converted_config(cfg, tokenizer_path: str, document_boundary: str = "eos"):
    """A TrainConfig with the converted model (and tokenizer path and the base's document-boundary policy), via gin
    as every run's config is built."""
    bindings = [f"ModelConfig.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]
    if tokenizer_path:
        bindings.append(f"DataConfig.tokenizer_path = {tokenizer_path!r}")
    bindings.append(f"DataConfig.document_boundary = {document_boundary!r}")
    if config_lib.TrainConfig.seq_len > cfg.max_seq_len:  # a short-context base: rows no longer than it attends
        bindings.append(f"TrainConfig.seq_len = {cfg.max_seq_len}")
    return config_lib.parse([], bindings)


def _base_tokenizer(local_dir: str, output: str, model_type: str):
    """The base model's tokenizer copied into ``output`` (or None when the folder has none) and its
    document-boundary policy (:mod:`jaxpt.hf`).

    Raises:
      ConvertError: a tokenizer file that cannot be loaded (for a ``tokenizer.json``: no EOS named, naming the file
        and what to add), or a copy that does not load with the same sha256.
    """
    names = [n for n in ("tokenizer.model", "tokenizer.json") if os.path.isfile(os.path.join(local_dir, n))]
    family = FAMILY_BOUNDARY.get(model_type, "eos")
    if not names:
        return None, family
    try:
        source = Tokenizer.load(os.path.join(local_dir, names[0]))
    except ValueError as e:
        raise ConvertError(f"--model {local_dir}: {e}") from None
    config = os.path.join(local_dir, "tokenizer_config.json")
    said = source.kind == "huggingface"
    if not said and os.path.isfile(config):
        try:
            said = isinstance(json.loads(fs.read_text(config)).get("add_bos_token"), bool)
        except (ValueError, AttributeError):
            said = False
    adds_bos = (source.adds_bos if said else family == "bos_eos") and source.bos_id >= 0
    copied = Tokenizer.load(source.write(output))
    if copied.sha256 != source.sha256:
        raise ConvertError(f"--model {local_dir}: the tokenizer copied into {output} loads as another tokenizer "
                           f"(sha256 {copied.sha256[:12]}, the source's {source.sha256[:12]})")
    return copied, "bos_eos" if adds_bos else "eos"


def write_params_checkpoint(output: str, train_cfg, params, mesh, tokenizer, source: Mapping[str, Any]) -> None:
    """Save ``params`` (an ``nnx.State`` of ``train_cfg.model``) as the params-only jaxpt checkpoint of step
    :data:`CONVERTED_STEP` under ``output/checkpoints`` (its meta: the operative config, the model, the tokenizer's
    path and sha256 or None, ``params_only: True`` and ``source``), and ``output/model.gin``: the model's settings
    and the tokenizer path, to pass as ``--config`` to a continued run."""
    import orbax.checkpoint as ocp


    cfg = train_cfg.model
    text = config_lib.operative_config_str(train_cfg)
    meta = {
        "config_gin": text, "model": dataclasses.asdict(cfg), "mesh": mesh_lib.mesh_shape(mesh),
        "model_layout": {"scan_layers": cfg.scan_layers},
        "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256} if tokenizer else None,
        "params_only": True, "source": dict(source),
        "libraries": ckpt_lib.library_versions(), "config_fields": config_lib.config_fields(),
    }
    state = {"step": np.asarray(CONVERTED_STEP, np.int32), "params": params}
    manager = ocp.CheckpointManager(fs.join(output, "checkpoints"), item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(create=True,
                                                                         enable_async_checkpointing=False))
    manager.save(CONVERTED_STEP, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()
    manager.close()
    model_lines = [ln for ln in text.splitlines() if ln.startswith("ModelConfig.")]
    gin_text = (f"# Converted from {source.get('path')} by jaxpt.tools.convert.\n"
                f"# Continue pretraining from it: --gin \"TrainConfig.init_from = '{output}'\"\n"
                + "\n".join(model_lines) + "\n")
    if tokenizer:
        gin_text += f"DataConfig.tokenizer_path = {str(tokenizer.path)!r}\n"
    if train_cfg.seq_len != config_lib.TrainConfig.seq_len:
        gin_text += (f"# Rows no longer than the model's context (the default, {config_lib.TrainConfig.seq_len}, "
                     "is longer)\n" f"TrainConfig.seq_len = {train_cfg.seq_len}\n")
    policy = train_cfg.data.document_boundary
    gin_text += (f"# The base model's document boundaries ({_POLICY_WORDS[policy]}); jaxpt.data.boundary.\n"
                 f"DataConfig.document_boundary = {policy!r}\n")
    fs.write_text_atomic(fs.join(output, "model.gin"), gin_text)


_POLICY_WORDS = {"eos": "EOS after each document", "bos": "BOS before each document",
                 "bos_eos": "BOS before and EOS after each document", "none": "no special token around documents"}


def hf_to_jaxpt(model_dir: str | os.PathLike, output: str | os.PathLike, *, mesh=None, max_seq_len: int = 0,
                scan_layers: bool = False) -> str:
    """Convert the HF folder ``model_dir`` into ``output`` (:mod:`jaxpt.hf`). Returns ``output`` (absolute).

    Args:
      mesh: where the params are placed while converting (a ``jax.sharding.Mesh`` or sizes such as
        ``"fsdp=8"``); default ``fsdp`` over every device (each device holds 1/N of each tensor).
      max_seq_len, scan_layers: as :func:`jaxpt.hf.configs.model_config_from_hf`.

    ``model_dir`` and ``output`` may be local or ``gs://`` (:mod:`jaxpt.hf`: a remote ``model_dir`` is read from
    a per-host local copy, :func:`jaxpt.util.fs.local_tree`).

    Raises:
      ConvertError: an untranslatable config (:func:`~jaxpt.hf.configs.model_config_from_hf`), a missing or
        misshapen tensor, or an ``output`` that already holds checkpoints.
      FileNotFoundError: no ``config.json`` in ``model_dir``.
    """
    import jax


    model_dir, output = fs.absolute(os.fspath(model_dir)), fs.absolute(os.fspath(output))
    if not fs.isfile(fs.join(model_dir, "config.json")):
        raise FileNotFoundError(f"--model {model_dir}: no config.json")
    try:
        hf = json.loads(fs.read_text(fs.join(model_dir, "config.json")))
    except ValueError as e:
        raise ConvertError(f"--model {model_dir}: config.json is not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConvertError(f"--model {model_dir}: config.json is not a JSON object")
    local_dir = fs.local_tree(model_dir)  # safetensors are memory-mapped: a local file (:mod:`jaxpt.hf`)
    tensors = SafetensorsFolder(local_dir)
    cfg = model_config_from_hf(hf, max_seq_len=max_seq_len, scan_layers=scan_layers, tensors=tensors)
    ckpts = fs.join(output, "checkpoints")
    if fs.isdir(ckpts) and fs.listdir(ckpts):
        raise ConvertError(f"--output {output}: already holds checkpoints/")
    fs.makedirs(output)
    tokenizer, policy = _base_tokenizer(local_dir, output, hf["model_type"])
    train_cfg = _converted_config(cfg, str(tokenizer.path) if tokenizer else "", policy)
    if not isinstance(mesh, jax.sharding.Mesh):
        mesh = mesh_lib.mesh_from_config(mesh or {"fsdp": jax.device_count()})
    params = load_hf_params(tensors, cfg, mesh, train_cfg.logical_axis_rules)
    write_params_checkpoint(output, train_cfg, params, mesh, tokenizer,
                            source={"format": "huggingface", "path": model_dir, "model_type": hf["model_type"]})
    return output


def _tokenizer_files(tokenizer, output: str, max_len: int, document_boundary: str = "eos") -> None:
    """The run's tokenizer as ``AutoTokenizer`` loads it, giving jaxpt's ids (``add_special_tokens=False``), with
    BOS added to every text (``add_special_tokens=True``) iff the run's ``document_boundary`` puts BOS at a
    document's start (``add_bos_token``; EOS is never added: a prompt does not end a document).

    SentencePiece: the model and a ``tokenizer_config.json`` that loads it as a ``LlamaTokenizer`` with jaxpt's
    special tokens and the model's own dummy-prefix setting (``add_prefix_space``; transformers adds one by
    default); transformers converts it without the model's normalizer, as jaxpt encodes it
    (:mod:`jaxpt.data.tokenizer`). Known difference: jaxpt escapes a literal U+2581 in the text to its three byte
    pieces (lossless), which transformers' converted tokenizer reads as a space; ids jaxpt produced decode the same
    in both. Hugging Face ``tokenizer.json``: the file, its post-processor set to the policy's BOS, and a
    ``tokenizer_config.json`` naming the special tokens (:meth:`jaxpt.data.hf_tokenizer.HFTokenizer.write`)."""
    add_bos = "bos" in document_boundary and tokenizer.bos_id >= 0
    if tokenizer.kind == "huggingface":
        tokenizer.write(output, add_bos_token=add_bos, model_max_length=max_len)
        return
    from sentencepiece import sentencepiece_model_pb2
    proto = fs.read_bytes(os.fspath(tokenizer.path))  # the path may be gs:// (an epath.Path)
    dummy_prefix = sentencepiece_model_pb2.ModelProto.FromString(proto).normalizer_spec.add_dummy_prefix
    with open(os.path.join(output, "tokenizer.model"), "wb") as f:
        f.write(proto)
    piece = lambda i: tokenizer.id_to_piece(i) if i >= 0 else None  # noqa: E731
    special = {"bos_token": piece(tokenizer.bos_id), "eos_token": piece(tokenizer.eos_id),
               "unk_token": piece(tokenizer.unk_id), "pad_token": piece(tokenizer.pad_id)}
    special = {k: v for k, v in special.items() if v is not None}
    with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "add_eos_token": False,
                   "legacy": False, "add_prefix_space": bool(dummy_prefix), "clean_up_tokenization_spaces": False,
                   "model_max_length": max_len, **special}, f, indent=1)
    with open(os.path.join(output, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=1)


def jaxpt_to_hf(workdir: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
                max_shard_bytes: int = 5 << 30) -> str:
    """Write the checkpoint ``<workdir>/checkpoints/<step>`` (newest committed by default) as an HF folder of the
    model's family (:func:`~jaxpt.hf.configs.export_family`; its recorded source read from the checkpoint's meta and
    the run's ``run.json``) in float32 (:mod:`jaxpt.hf`). Returns ``output`` (absolute).

    Tensors are gathered to the host one at a time and written in files of at most ``max_shard_bytes``
    (several files get ``model.safetensors.index.json``).

    ``workdir`` and ``output`` may be local or ``gs://``: a remote ``output`` is written into a local temporary
    directory, then each file is uploaded through :mod:`jaxpt.util.fs` (and the temporary directory removed).

    Raises:
      CheckpointError: as :func:`jaxpt.restore`. ConvertError: as :func:`jaxpt.hf.configs.export_family`.
    """

    output = fs.absolute(os.fspath(output))
    r = restore(workdir, step)
    cfg = r.config.model
    hf = hf_config_from_model(cfg, r.tokenizer, source_model_type(r.meta, _run_stages(os.fspath(workdir))))
    if not fs.is_remote(output):
        os.makedirs(output, exist_ok=True)
        _write_hf_folder(r, cfg, hf, output, max_shard_bytes)
        return output
    import tempfile
    with tempfile.TemporaryDirectory(prefix="jaxpt-export-") as tmp:
        _write_hf_folder(r, cfg, hf, tmp, max_shard_bytes)
        fs.copytree(tmp, output)
    return output


def _run_stages(workdir: str) -> list:
    """The ``stages`` of ``workdir``'s ``run.json`` (:mod:`jaxpt.run.lineage`), or [] (none, or unreadable)."""
    try:
        stages = json.loads(fs.read_text(fs.join(workdir, RUN_FILE))).get("stages")
    except (OSError, ValueError, AttributeError):
        return []
    return [s for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []


def _write_hf_folder(r, cfg, hf: Mapping[str, Any], output: str, max_shard_bytes: int) -> None:
    """The HF folder of the restored run ``r`` written into the local directory ``output``."""
    tensors = hf_tensors_from_params(r.params, cfg)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    if len(shards) == 1:
        write_safetensors(os.path.join(output, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(output, fname), shard)
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    with open(os.path.join(output, "generation_config.json"), "w") as f:
        json.dump({k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}, f, indent=1)
    if r.tokenizer.path is not None:
        _tokenizer_files(r.tokenizer, output, cfg.max_seq_len, r.config.data.document_boundary)
