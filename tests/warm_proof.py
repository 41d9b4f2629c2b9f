"""Run under KBUILD_INTERPRET=1 with KBUILD_RECORD=FILE: patch a tiny bf16 model of one family,
take a training step and an inference forward, and write its config (JSON) beside the
record, so a test can hold `kbuild warmup --model` to what `kbuild.nn.patch` launched.

    python tests/warm_proof.py FAMILY CONFIG_OUT
"""

from __future__ import annotations

import json
import sys

import torch
import transformers

import kbuild.nn
from tests.test_patch_cpu import _ids, hf_model


def main(family: str, config_out: str) -> None:
    model = hf_model(transformers, family).to(torch.bfloat16)
    report = kbuild.nn.patch(model)
    assert report.swaps, report
    ids = _ids()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # training: forward, backward, the loss
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # inference: the forwards that store nothing for a backward
    with open(config_out, "w") as f:
        json.dump(model.config.to_dict(), f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
