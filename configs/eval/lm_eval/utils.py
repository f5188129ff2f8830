"""Data loaders for the local lm-eval tasks in this folder (``custom_dataset: !function utils.<name>``).

The data files under ``data/`` were exported from jaxpt's probe tasks of ``configs/eval/card_v1.yaml`` on the
bundled sample (held-out split only, decontaminated against the training split), by
``python -m jaxpt.tools.evaluate export-probes``; reading them here keeps lm-eval off the network.
"""

import json
import os

import datasets

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _rows(name):
    with open(os.path.join(_DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cloze_reference(**unused):
    return {"validation": datasets.Dataset.from_list(_rows("cloze_reference.jsonl"))}


def code_next_line_greedy(**unused):
    return {"validation": datasets.Dataset.from_list(_rows("code_next_line_greedy.jsonl"))}


def heldout_rolling(**unused):
    rows = [{"id": r["id"], "text": r["text"]} for r in _rows("heldout_rolling.jsonl")]
    return {"validation": datasets.Dataset.from_list(rows)}
