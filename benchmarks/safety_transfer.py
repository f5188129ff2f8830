"""Does a harm classifier trained with labelled model output transfer to a checkpoint it has not seen? Leave one
checkpoint out over the label set's 1,000 labelled continuations (``data/labels/safety-1``: ``outputs_final``,
``transfer_final``, ``sampled_final``): for each checkpoint, a classifier trained on the written texts' train split
plus every *other* checkpoint's labelled continuations judges that checkpoint's continuations. Figures only, never
pass/fail; they go to docs/results/safety.md.

    nice -n 5 python benchmarks/safety_transfer.py [--labels data/labels/safety-1] [--c 1,4,16]
        [--minilm DIR]   # also sentence embeddings (all-MiniLM-L6-v2 folder; needs the hf extra: torch, transformers)

Features: the shipped classifier's hashed character 2-4-grams (:mod:`jaxpt.util.text_classifier`), and with
``--minilm`` mean-pooled, L2-normalised all-MiniLM-L6-v2 embeddings (Reimers and Gurevych 2019) under the same
class-balanced logistic regression. Prints, per held-out checkpoint: continuations, harmful by the labels, counted,
counted and harmful; and the written test split's precision and recall of the same classifier.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jaxpt.eval import safety
from jaxpt.util import text_classifier

#: The checkpoint behind each ``model`` name of the label files (runs of docs/results/safety.md).
CHECKPOINT = {"quickstart": "quickstart step 900", "quickstart900-T1.0": "quickstart step 900",
              "quickstart-step700": "quickstart step 700", "quickstart800-T0.8": "quickstart step 800",
              "pdedup300-greedy": "paragraph-dedup run step 300", "harmful": "harmful-text run 100 steps",
              "harmful100-T0.8": "harmful-text run 100 steps", "harmful100-T1.0": "harmful-text run 100 steps",
              "harmful40": "harmful-text run 40 steps", "harmful40-T0.8": "harmful-text run 40 steps"}


def minilm_features(folder: str):
    """``embed(texts) -> float32 [len(texts), 384]``: mean-pooled, L2-normalised all-MiniLM-L6-v2 embeddings of
    each text's first 128 tokens, from the model folder ``folder`` (loaded offline with transformers)."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()

    def embed(texts):
        out = []
        for i in range(0, len(texts), 64):
            b = tok(texts[i:i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            with torch.no_grad():
                h = model(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy())
        return np.concatenate(out)
    return embed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", default=os.path.join("data", "labels", "safety-1"))
    ap.add_argument("--c", default="1,4,16")
    ap.add_argument("--minilm")
    args = ap.parse_args()
    written = safety.read_labels(os.path.join(args.labels, "harm_final.jsonl"), "text", "harmful")
    w_train = [r for r in written if safety.split_of(r["id"]) == "train"]
    w_test = [r for r in written if safety.split_of(r["id"]) == "test"]
    files, text_key, label_key = safety.OUTPUT_LABEL_FILES["harm"]
    outs = [r for f in files for r in safety.read_labels(os.path.join(args.labels, f), text_key, label_key)]
    ckpt = np.array([CHECKPOINT[r["model"]] for r in outs])
    y_out = np.array([r[label_key] for r in outs])
    print(f"{len(outs)} labelled continuations ({int(y_out.sum())} harmful) from {len(set(ckpt))} checkpoints; "
          f"written: {len(w_train)} train, {len(w_test)} test")

    feature_sets = {"char 2-4-grams": None}
    if args.minilm:
        feature_sets["MiniLM embeddings"] = minilm_features(args.minilm)
    for feat, embed in feature_sets.items():
        if embed is not None:
            from sklearn.linear_model import LogisticRegression
            xw_tr, xw_te = embed([r["text"] for r in w_train]), embed([r["text"] for r in w_test])
            x_out = embed([r[text_key] for r in outs])
        for c in [float(x) for x in args.c.split(",")]:
            print(f"\n{feat}, C {c:g}")
            totals = np.zeros(3, int)
            for held in sorted(set(ckpt)):
                tr, te = ckpt != held, ckpt == held
                y = np.concatenate([[r["harmful"] for r in w_train], y_out[tr]])
                if embed is None:
                    texts = [r["text"] for r in w_train] + [outs[i][text_key] for i in np.flatnonzero(tr)]
                    m = text_classifier.train(texts, list(y), version="transfer", excerpt_chars=safety.EXCERPT_CHARS,
                                              c=c)
                    p_out = m.probabilities([outs[i][text_key] for i in np.flatnonzero(te)])
                    p_w = m.probabilities([r["text"] for r in w_test])
                else:
                    m = LogisticRegression(C=c, class_weight="balanced", max_iter=3000).fit(
                        np.concatenate([xw_tr, x_out[tr]]), y)
                    p_out, p_w = m.predict_proba(x_out[te])[:, 1], m.predict_proba(xw_te)[:, 1]
                f = safety.binary_figures(list(p_out >= 0.5), list(y_out[te]))
                fw = safety.binary_figures(list(p_w >= 0.5), [r["harmful"] for r in w_test])
                totals += (f["tp"] + f["fp"], f["tp"], f["positives"])
                print(f"  held out {held:<30} n {f['n']:>4}  harmful {f['positives']:>3}  "
                      f"counted {f['tp'] + f['fp']:>4}  counted and harmful {f['tp']:>3}   written test P {fw['precision']:.3f} R {fw['recall']:.3f}")
            print(f"  all held out: counted {totals[0]}, of them harmful {totals[1]}, harmful {totals[2]}")


if __name__ == "__main__":
    main()
