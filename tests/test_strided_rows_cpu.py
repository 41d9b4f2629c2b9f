"""Strided RMSNorm inputs read in place (QK-norm over a fused qkv's heads).

`grouped_rows` decides which strided views the kernels read without a copy and with which
(x_group, x_stride); the kernels then address row r at (r // x_group) * x_stride +
(r % x_group) * N. Here that formula, applied to the view's storage, must give back exactly the
view's rows, for every layout it accepts; the layouts it refuses must be ones the formula
cannot express. Catches a group or stride derived from the wrong dimension (rows read from
the wrong head or token), a merge of token dimensions that do not merge, and a dense tensor
taken for a strided one.
"""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.op.tensors import grouped_rows, readable_rows, rows_to_read
from kbuild.registry import MAX_GROUPED_ROWS, group_magic

from .reference import rmsnorm_grads

B, T, H, D = 3, 5, 4, 8


def _qkv(pad: int = 0) -> torch.Tensor:
    width = 3 * H * D + pad
    return torch.arange(B * T * width, dtype=torch.float64).view(B, T, width)


def _heads(qkv: torch.Tensor) -> torch.Tensor:
    return qkv[..., : 3 * H * D].view(B, T, 3, H, D)


VIEWS = {
    "q of qkv": lambda: _heads(_qkv())[:, :, 0],
    "k of qkv, padded tokens": lambda: _heads(_qkv(pad=3))[:, :, 1],
    "q by split": lambda: _qkv().split(H * D, dim=-1)[0].view(B, T, H, D),
    "rows of a wider matrix": lambda: torch.arange(60.0).view(6, 10)[:, :4],
    "one token's heads": lambda: _heads(_qkv())[1, 2, 0],
    "broadcast row": lambda: torch.arange(8.0).expand(4, 8),
    "broadcast batch": lambda: torch.arange(24.0).view(1, 3, 8).expand(2, 3, 8),
    "size-1 dimensions": lambda: _heads(_qkv())[:1, :, 2, :1],
    "contiguous": lambda: torch.arange(24.0).view(2, 3, 4),
}
REFUSED = {
    "q transposed to (B, H, T, D)": lambda: _heads(_qkv())[:, :, 0].transpose(1, 2),
    "a slice of tokens": lambda: _heads(_qkv())[:, 1:4, 0],
    "columns": lambda: torch.arange(60.0).view(6, 10).t(),
    "every other head": lambda: _heads(_qkv())[:, :, 0, ::2],
}


def _rows_by_formula(x: torch.Tensor, group: int, stride: int) -> torch.Tensor:
    N = x.shape[-1]
    M = x.numel() // N
    flat = x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)
    r = torch.arange(M)
    starts = x.storage_offset() + (r // group) * stride + (r % group) * N
    return flat[starts[:, None] + torch.arange(N)]


@pytest.mark.parametrize("name", VIEWS)
def test_formula_reads_the_views_rows(name):
    x = VIEWS[name]()
    layout = grouped_rows(x)
    assert layout is not None, name
    torch.testing.assert_close(_rows_by_formula(x, *layout), x.reshape(-1, x.shape[-1]))
    assert readable_rows(x) is x  # never copied
    if layout[0] == x.numel() // x.shape[-1]:
        assert rows_to_read(x)[1] is None  # dense rows: the plain kernels
    else:
        assert rows_to_read(x)[1] == (*layout, group_magic(layout[0]))


def test_qkv_layout_is_heads_by_tokens():
    assert grouped_rows(_heads(_qkv())[:, :, 0]) == (H, 3 * H * D)
    assert grouped_rows(_heads(_qkv(pad=3))[:, :, 2]) == (H, 3 * H * D + 3)


@pytest.mark.parametrize("name", REFUSED)
def test_rows_off_one_stride_are_copied(name):
    x = REFUSED[name]()
    assert grouped_rows(x) is None
    copy = readable_rows(x)
    assert copy is not x and copy.is_contiguous() and torch.equal(copy, x)


@pytest.mark.parametrize(
    "group", [1, 2, 3, 7, 8, 12, 40, 96, 641, 4095, 65537, 1_000_003, 2**30 + 1, 2**31 - 1, 2**31]
)
def test_group_magic_divides_every_row(group):
    """The kernels' r // x_group is (r * m) >> p (GroupedRows): exact for every row below 2^31.
    Checked at the ends of the range, around multiples of the group and at random rows,
    with the kernel's 64-bit arithmetic (a product past 2^63 would wrap). Catches a
    multiplier rounded down (off by one just below a multiple) and a shift one short."""
    magic = group_magic(group)
    m, p = magic & 0xFFFFFFFF, magic >> 32
    g = torch.Generator().manual_seed(group)
    multiples = torch.arange(0, MAX_GROUPED_ROWS, max(group, MAX_GROUPED_ROWS // 4096))
    multiples = multiples - multiples % group
    rows = torch.cat(
        [
            torch.arange(0, 4096),
            torch.arange(MAX_GROUPED_ROWS - 4096, MAX_GROUPED_ROWS),
            (multiples[:, None] + torch.tensor([-1, 0, 1])).flatten(),
            torch.randint(0, MAX_GROUPED_ROWS, (1 << 16,), generator=g),
        ]
    ).clamp(0, MAX_GROUPED_ROWS - 1)
    assert m < 2**32 and (MAX_GROUPED_ROWS - 1) * m < 2**63
    assert torch.equal((rows * m) >> p, rows // group)


def test_group_magic_refuses_groups_out_of_range():
    with pytest.raises(ValueError, match="x_group must be in"):
        group_magic(0)
    with pytest.raises(ValueError, match="x_group must be in"):
        group_magic(2**31 + 1)


def test_cpu_gradient_through_a_qkv_view():
    """kbuild.rmsnorm on a (B, T, H, D) view: forward and d(qkv) against fp64, the other
    heads' gradient zero."""
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, requires_grad=True)
    w = (1 + 0.1 * torch.randn(D)).requires_grad_()
    q = _heads(qkv)[:, :, 0]
    y = kbuild.rmsnorm(q, w, 1e-6)
    dy = torch.randn_like(y)
    dqkv, dw = torch.autograd.grad(y, [qkv, w], dy)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(q.detach().contiguous(), w.detach(), dy, 1e-6)
    torch.testing.assert_close(y, ref_y.float())
    torch.testing.assert_close(_heads(dqkv)[:, :, 0], ref_dx.float())
    assert not _heads(dqkv)[:, :, 1:].any()
    torch.testing.assert_close(dw, ref_dw.float())


def test_more_rows_than_the_magic_covers_are_not_strided():
    """Past 2^31 rows the kernels' division by multiplication is not exact: such views are
    refused (copied), dense ones of the same count are not affected."""
    x = torch.zeros(1, 8).expand(MAX_GROUPED_ROWS + 1, 8)  # a broadcast row: no memory
    assert grouped_rows(x) is None
    assert grouped_rows(torch.zeros(1, 8).expand(MAX_GROUPED_ROWS, 8)) == (1, 0)
