"""The drafter's cross-entropy (common.tools.drafter.cross_entropy) against the fp32 log-softmax
it replaces: the plain path and block_loss everywhere; the Triton kernels (on a GPU, or on CPU
tensors under Triton's interpreter: TRITON_INTERPRET=1 in the environment before the kernels
are defined) against the plain path: fp32 and bf16 logits, V off the block sizes, argmax ties
across blocks, gradients rounded once, no rows, strided inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import fused
from common.tools.drafter.cross_entropy import FORWARD_BLOCK, token_cross_entropy
from common.tools.drafter.objective import IGNORE, block_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = pytest.mark.skipif(
    not fused.HAS_TRITON or (DEVICE == "cpu" and not fused._INTERPRETED),
    reason="triton is not installed" if not fused.HAS_TRITON else
    "no GPU: needs TRITON_INTERPRET=1 set before the kernels are imported")


def _inputs(R: int, V: int, T: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V], ids [R, T] with a repeated token in row 1 when T > 1, weights [R, T].
    Row 0 is confident in its first token (softmax there about 1e-3 below 1): with that token's
    weight alone its gradient, softmax - 1 times it, is all cancellation."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(R, V, generator=g)
    ids = torch.randint(0, V, (R, T), generator=g)
    weights = torch.rand(R, T, generator=g)
    if R > 1 and T > 1:
        ids[1, -1] = ids[1, 0]
    if R:
        logits[0, ids[0, 0]] = logits[0].logsumexp(0) + 7
    return logits.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE)


def _log_softmax_ce(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference: weighted -log_softmax(logits.float()) at the ids."""
    return -(weights * F.log_softmax(logits.float(), -1).gather(1, ids)).sum(-1)


def _grad(fn, logits: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fn's outputs and the gradient of sum(ce * c) (c fixed, not all ones) w.r.t. logits."""
    x = logits.detach().requires_grad_()
    out = fn(x, *args)
    ce, top = out if isinstance(out, tuple) else (out, None)
    c = torch.linspace(0.5, 2.0, ce.shape[0], device=ce.device)
    (ce * c).sum().backward()
    return ce.detach(), top, x.grad


def _plain(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with fused.disabled():
        return token_cross_entropy(logits, ids, weights)


def _assert_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) within one rounding step of want: both are an fp32 value rounded once."""
    want = want.float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
    bad = (got.float() - want).abs() > ulp
    assert not bad.any(), f"{int(bad.sum())} entries off by more than one rounding, first at {bad.nonzero()[0].tolist()}"


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        _assert_one_rounding(got, want)
    else:
        # A confident label's softmax - 1 carries the logsumexp's rounding (about 1e-6 at these
        # sizes), however it is computed: an absolute tolerance for it.
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 5])
def test_plain_path_matches_log_softmax(T):
    logits, ids, weights = (t.cpu() for t in _inputs(9, 700, T, torch.float32))
    if T == 1:
        weights = torch.ones_like(weights)
    ce, top, grad = _grad(_plain, logits, ids, weights)
    want, _, want_grad = _grad(_log_softmax_ce, logits, ids, weights)
    torch.testing.assert_close(ce, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.equal(top, logits.argmax(-1))


def _reference_block_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, gamma: float,
                          soft: tuple[torch.Tensor, torch.Tensor], soft_weight: float, scored: torch.Tensor
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The oracle for block_loss, written out on its own (not shared with it, so that a slip in
    either shows): an fp32 log-softmax over the logits, then its weighted picks."""
    S, A, B, H = hidden.shape
    lab = labels[:, :, 1:]
    valid = lab != IGNORE
    k = torch.arange(1, B, device=hidden.device, dtype=torch.float32)
    weight = torch.exp(-(k - 1) / gamma).expand(S, A, B - 1)[valid]
    logits = F.linear(hidden[:, :, 1:][valid], lm_head)
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = -logp.gather(1, lab[valid][:, None])[:, 0]
    if soft is not None and soft_weight:
        ids, probs = (x[:, :, 1:][valid] for x in soft)
        ce = (1 - soft_weight) * ce - soft_weight * (probs * logp.gather(1, ids)).sum(-1)
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
    correct = torch.zeros_like(valid)
    correct[valid] = logits.argmax(-1) == lab[valid]
    used = valid[:, :, 0] if scored is None else valid[:, :, 0] & scored
    accepted = correct.long().cumprod(-1).sum(-1)[used].float()
    return loss, {"acc1": correct[:, :, 0][used].float().mean(), "accepted": accepted.mean(),
                  "blocks": used.sum().float()}


@pytest.mark.parametrize("soft_weight", [0.0, 0.3])
@pytest.mark.parametrize("path", ["plain", pytest.param("kernels", marks=KERNELS_RUN)])
def test_block_loss_matches_the_log_softmax_formula(path, soft_weight):
    S, A, B, H, V, K = 2, 3, 5, 16, 3000, 4
    g = torch.Generator().manual_seed(1)
    hidden, lm_head = torch.randn(S, A, B, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (S, A, B), generator=g)
    labels[:, :, 0] = IGNORE
    labels[1, 2, 3:] = IGNORE
    labels[0, 1, 1] = IGNORE  # a block whose first position is unlabelled: not counted
    soft_ids = torch.randint(0, V, (S, A, B, K), generator=g)
    soft_ids[..., 0] = labels.clamp(min=0)  # the target's top token is often the hard label
    soft_probs = torch.rand(S, A, B, K, generator=g).softmax(-1)
    # Give the drafter's LM head a few right answers, so that the accuracy metrics count some.
    lm_head[labels[0, 0, 1:]] += 4 * hidden[0, 0, 1:]
    scored = torch.tensor([[True, True, False], [True, True, True]])
    device = DEVICE if path == "kernels" else "cpu"
    inputs = [t.to(device) for t in (hidden, labels, lm_head, soft_ids, soft_probs, scored)]

    def run(fn):
        h, w = inputs[0].clone().requires_grad_(), inputs[2].clone().requires_grad_()
        loss, metrics = fn(h, inputs[1], w, 2.0, (inputs[3], inputs[4]), soft_weight, inputs[5])
        loss.backward()
        return loss.detach(), metrics, h.grad, w.grad

    if path == "plain":
        with fused.disabled():
            loss, metrics, h_grad, w_grad = run(block_loss)
    else:
        loss, metrics, h_grad, w_grad = run(block_loss)
    want, want_metrics, want_h, want_w = run(_reference_block_loss)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["loss"], want)
    assert {k: metrics[k].item() for k in want_metrics} == {k: v.item() for k, v in want_metrics.items()}
    assert 0 < want_metrics["acc1"].item() < 1 and want_metrics["blocks"].item() == 4
    torch.testing.assert_close(h_grad, want_h)
    torch.testing.assert_close(w_grad, want_w)


def test_checks_catch_wrong_results():
    """The negative control: the comparisons above fail on results that are slightly wrong."""
    logits, ids, weights = (t.cpu() for t in _inputs(6, 900, 1, torch.float32))
    weights = torch.ones_like(weights)
    ce = _grad(_plain, logits, ids, weights)[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ce * (1 + 1e-4 * (torch.arange(6) == 2)), ce)
    # The bf16 gradient with the label terms added to the rounded softmax term (two roundings):
    # row 0's label is confident, so softmax - 1 there is lost to the first rounding.
    x = logits.bfloat16()
    want = _grad(_log_softmax_ce, x, ids, weights)[2]
    c = torch.linspace(0.5, 2.0, 6)
    twice = (F.softmax(x.float(), -1) * (c * weights.sum(-1))[:, None]).bfloat16()
    twice.scatter_add_(1, ids, -(c[:, None] * weights).bfloat16())
    with pytest.raises(AssertionError, match="off by more than one rounding"):
        _assert_one_rounding(twice, want)
    _assert_one_rounding(want, want)


# (R, V, T): V off both block sizes, below them, on them; hard labels only and soft ones.
SHAPES = [(5, FORWARD_BLOCK + 903, 1), (17, 3001, 4), (3, 2 * FORWARD_BLOCK, 17), (4, 37, 3), (2, FORWARD_BLOCK + 1, 2)]


@KERNELS_RUN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V,T", SHAPES)
def test_kernels_match_plain_path(R, V, T, dtype):
    logits, ids, weights = _inputs(R, V, T, dtype, seed=R + V + T)
    ce, top, grad = _grad(token_cross_entropy, logits, ids, weights)
    want, want_top, want_grad = _grad(_plain, logits, ids, weights)
    assert ce.dtype == torch.float32 and top.dtype == torch.int64 and grad.dtype == dtype
    torch.testing.assert_close(ce, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(top, want_top)
    _assert_grad_close(grad, want_grad)
    # And against the fp32 log-softmax's gradient (rounded once, for bf16): label columns included.
    _assert_grad_close(grad, _grad(_log_softmax_ce, logits, ids, weights)[2])


@KERNELS_RUN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_take_the_first_index(dtype):
    V = 2 * FORWARD_BLOCK + 100
    logits = torch.zeros(6, V)
    logits[0, [5, FORWARD_BLOCK + 7]] = 2.0  # across blocks: the earlier block's
    logits[1, [FORWARD_BLOCK + 7, 2 * FORWARD_BLOCK + 3]] = 2.0
    logits[2, [FORWARD_BLOCK + 9, FORWARD_BLOCK + 8]] = 2.0  # within a block
    logits[3, [9, FORWARD_BLOCK + 8]] = torch.tensor([1.0, 2.0])  # a larger value in a later block
    logits[4, V - 1] = 1.0  # in the last, partial block
    # Row 5: all equal: index 0.
    logits = logits.to(DEVICE, dtype)
    _, top = token_cross_entropy(logits, torch.zeros(6, 1, dtype=torch.long, device=DEVICE),
                                 torch.ones(6, 1, device=DEVICE))
    assert top.tolist() == [5, FORWARD_BLOCK + 7, FORWARD_BLOCK + 8, FORWARD_BLOCK + 8, V - 1, 0]
    assert torch.equal(top, logits.argmax(-1))


@KERNELS_RUN
def test_no_rows():
    logits = torch.zeros(0, 50, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    ce, top = token_cross_entropy(logits, torch.zeros(0, 2, dtype=torch.long, device=DEVICE),
                                  torch.zeros(0, 2, device=DEVICE))
    assert ce.shape == top.shape == (0,) and ce.dtype == torch.float32
    ce.sum().backward()
    assert logits.grad.shape == (0, 50) and logits.grad.dtype == torch.bfloat16


@KERNELS_RUN
def test_strided_inputs():
    logits, ids, weights = _inputs(7, 1500, 3, torch.bfloat16, seed=3)
    wide = torch.cat([logits, logits[:, :11]], 1)[:, :1500]  # rows not contiguous
    spaced_ids = torch.stack([ids, ids], -1)[..., 0]  # every other element
    weights_t = weights.t().contiguous().t()  # column-major
    assert not (wide.is_contiguous() or spaced_ids.is_contiguous() or weights_t.is_contiguous())
    ce, top, grad = _grad(token_cross_entropy, wide, spaced_ids, weights_t)
    want, want_top, want_grad = _grad(token_cross_entropy, logits, ids, weights)
    assert torch.equal(ce, want) and torch.equal(top, want_top) and torch.equal(grad, want_grad)


@KERNELS_RUN
# Under the interpreter (numpy) the masked-off lanes still compute -inf - -inf, then are dropped.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_minus_infinity_logits():
    """-inf logits (a masked vocabulary) count as probability 0, also where a row's whole first
    block is -inf: there the running maximum starts at -inf and exp(-inf - -inf) is NaN."""
    logits, ids, weights = _inputs(3, FORWARD_BLOCK + 500, 2, torch.float32, seed=5)
    logits[1, :FORWARD_BLOCK] = float("-inf")
    logits[2, ::3] = float("-inf")
    ids[1:] = FORWARD_BLOCK + 1 + 3 * torch.arange(2, device=ids.device)  # labels on finite logits
    ce, top, grad = _grad(token_cross_entropy, logits, ids, weights)
    want, want_top, want_grad = _grad(_plain, logits, ids, weights)
    assert torch.isfinite(ce).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(ce, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(top, want_top)
    _assert_grad_close(grad, want_grad)
