"""CPU tests that a patched Hugging Face model is a drop-in for stock wherever a user's tools
touch it: the forward's signature (Trainer reads it), a real `transformers.Trainer` run with
its default arguments, the outputs of evaluation and of `return_dict=False`, the loss options
passed through the forward, patching twice with the loss on, and the swap check refusing a
kbuild op that returns NaN or inf."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch
from torch import nn

from kbuild.nn.patching import patch

from .reference import assert_close_rel
from .test_patch_cpu import VOCAB, LlamaMLP, Tiny, _gen, _ids, _x, hf_model

activations = importlib.import_module("kbuild.kernels.activations.op")


@pytest.fixture
def hf():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_forward_signature_is_stock(hf, kind):
    """Catches a patched forward that shows `(*args, **kwargs)`: Trainer's
    remove_unused_columns keeps only the columns named in the signature, and would drop
    input_ids and attention_mask."""
    stock = hf_model(hf, kind)
    model = copy.deepcopy(stock)
    report = patch(model)
    assert "loss" in {s.kind for s in report.swaps}
    assert "forward" in vars(model)
    assert inspect.signature(model.forward) == inspect.signature(stock.forward)
    assert "input_ids" in inspect.signature(model.forward).parameters


class _Rows(torch.utils.data.Dataset):
    """A tiny causal LM data set as users hand Trainer one: dicts of token ids (one sequence,
    so four steps lower the loss), an attention mask padded by 0-2 tokens, labels with -100
    where padded, and a column the model does not take."""

    def __init__(self, n=8, seq=12):
        ids = torch.randint(1, VOCAB, (seq,), generator=_gen(11))  # one sequence: learnable
        self.rows = []
        for i in range(n):
            mask = torch.ones(seq, dtype=torch.long)
            mask[: i % 3] = 0
            labels = ids.masked_fill(mask == 0, -100)
            self.rows.append(dict(input_ids=ids, attention_mask=mask, labels=labels, text="x"))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(hf, model, tmp_path, name):
    """Four steps of a real Trainer with its default arguments (remove_unused_columns among
    them); returns (logged losses, the keyword names each forward call received)."""
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True
    )
    args = hf.TrainingArguments(output_dir=str(tmp_path / name), max_steps=4, logging_steps=1,
                                per_device_train_batch_size=2, learning_rate=1e-2,
                                report_to="none", save_strategy="no", use_cpu=True)  # fmt: skip
    trainer = hf.Trainer(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, seen


def test_trainer_trains_patched_model(hf, tmp_path):
    """Catches Trainer dropping the patched model's inputs (its remove_unused_columns reads the
    forward's signature: input_ids and attention_mask must reach the model, the unused `text`
    column must not), and a patched model that trains to other losses than stock under the same
    Trainer, data order and seed; its parameters move and its loss falls."""
    pytest.importorskip("accelerate")
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock)
    start = [p.detach().clone() for p in model.parameters()]
    patch(model)
    ours, seen = _train(hf, model, tmp_path, "patched")
    ref, _ = _train(hf, stock, tmp_path, "stock")
    assert seen and all({"input_ids", "attention_mask", "labels"} <= set(k) for k in seen), seen
    assert not any("text" in k for k in seen)
    assert len(ours) == 4 and all(torch.isfinite(torch.tensor(ours)))
    for a, b in zip(ours, ref, strict=True):
        assert abs(a - b) < 1e-3 * abs(b), (ours, ref)
    assert ours[-1] < ours[0]
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True))


def test_eval_mode_and_tuple_layout_are_stock(hf):
    """Catches `logits=None` in eval mode with grad enabled (only training takes the fused
    loss), and a `return_dict=False` tuple that drops the logits' slot (positional unpacking
    `loss, logits, ...` would shift): in training the tuple is stock's with None for the
    logits; in eval mode it is stock's, logits included."""
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids()
    model.eval(), stock.eval()
    ours, ref = model(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    assert ours.logits is not None
    assert_close_rel(ours.logits, ref.logits, 1e-5, "logits")
    assert_close_rel(ours.loss, ref.loss, 1e-5, "loss")
    ours, ref = (m(input_ids=ids, labels=ids, return_dict=False) for m in (model, stock))
    assert len(ours) == len(ref) and ours[1] is not None
    model.train(), stock.train()
    ours, ref = (m(input_ids=ids, labels=ids, return_dict=False) for m in (model, stock))
    assert len(ours) == len(ref), (len(ours), len(ref))
    assert ours[1] is None and ref[1].shape == (2, 12, VOCAB)
    assert_close_rel(ours[0], ref[0], 1e-5, "loss")
    for a, b in zip(ours[2:], ref[2:], strict=True):
        assert type(a) is type(b)


def test_ignore_index_through_patched_forward(hf):
    """Catches a patched forward that drops `ignore_index=` (a hard-coded -100 gives another
    loss: the labels here use 5 as their padding, and -100 nowhere)."""
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids()
    labels = ids.clone()
    labels[:, :4] = 5
    ours = model(input_ids=ids, labels=labels, ignore_index=5).loss
    ref = stock(input_ids=ids, labels=labels, ignore_index=5).loss
    plain = stock(input_ids=ids, labels=labels).loss
    assert abs(ref.item() - plain.item()) > 1e-3  # the option changes stock's loss
    assert abs(ours.item() - ref.item()) < 1e-5 * ref.item()


def test_twice_with_loss_then_unpatch(hf):
    """Catches a second patch with the loss on wrapping the fused forward again (it must patch
    nothing and say why), and unpatch leaving the loss forward or any module behind: the model
    computes stock's loss and logits after."""
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock)
    first = patch(model)
    assert "loss" in {s.kind for s in first.swaps}
    second = patch(model)
    assert second.swaps == []
    loss_kept = [k for k in second.kept if k.kind == "loss"]
    assert [k.path for k in loss_kept] == [""] and "already patched by kbuild" in loss_kept[
        0
    ].reason
    first.unpatch()
    assert [type(m) for m in model.modules()] == [type(m) for m in stock.modules()]
    assert not any("forward" in vars(m) for m in model.modules())
    ids = _ids()
    ours = model(input_ids=ids, labels=ids)
    ref = stock(input_ids=ids, labels=ids)
    assert ours.logits is not None
    assert_close_rel(ours.logits, ref.logits, 0, "logits")
    assert ours.loss.item() == ref.loss.item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_swap_check_refuses_non_finite(monkeypatch, bad):
    """Catches a swap check that lets a non-finite output pass (NaN compares false both ways,
    so `err > tol` misses it): a kbuild swiglu that writes one NaN or inf is refused, the MLP
    kept stock with the reason, and the model still computes stock's output."""
    real = activations.swiglu

    def broken(gate, up=None):
        out = real(gate, up)
        out.view(-1)[3] = bad
        return out

    monkeypatch.setattr(activations, "swiglu", broken)
    torch.manual_seed(0)
    model = nn.Sequential(LlamaMLP())
    stock = copy.deepcopy(model)
    report = patch(model, norms=False, rope=False, loss=False)
    assert report.swaps == []
    (kept,) = report.kept
    assert kept.kind == "mlp" and "differs from stock" in kept.reason
    assert "forward" not in vars(model[0])
    x = _x()
    assert_close_rel(model(x), stock(x), 0)


def test_nothing_to_patch_says_why():
    """Catches a report of "0 patched" with no word of why: a model with nothing kbuild
    swaps gets a line saying so."""
    text = str(patch(nn.Linear(4, 4)))
    assert "0 patched" in text and "nothing kbuild patches" in text
    assert str(patch(Tiny())).splitlines()[0].startswith("kbuild.nn.patch(Tiny): ")
