"""The quantized products of chapter 07b against dequantize-then-matmul, under the Triton interpreter on a CPU (the
harness, conftest.py, chooses it), on every path of the kernels: decode with and without a split K, a partial K tile,
partial row and column tiles, bias or none, each format and activation dtype."""
import pytest
import torch

from nanoserve.kernels import INTERPRET
from nanoserve.quant import dequantize, quantize_int4, quantize_int8
from nanoserve.quant import quantize_fp8

def dequantize_fp8(blocks): return dequantize('fp8', blocks)
from nanoserve.quant_kernels import linear_fp8, linear_w4, linear_w8, quantize_fp8_activations

# (M, N, K): decode in one K tile; decode with K split in 2 and 3; just past decode (a partial K tile of 64);
# a full 64-row tile; one row past it (a second, nearly empty 128-row tile); K of a single block
SHAPES = [(1, 71, 96), (2, 71, 160), (16, 33, 288), (17, 65, 160), (64, 71, 96), (129, 33, 160), (5, 16, 32)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

def random_blocks(quant_type: str, rows: int, cols: int, generator: torch.Generator) -> dict:
    "Random blocks: every quant value, scales and minimums of either sign."
    per_row = cols // 32
    scale = lambda: (torch.randn(rows, per_row, generator=generator) * 0.05).half()
    if quant_type == 'Q8_0':
        qs = torch.randint(-128, 128, (rows, per_row, 32), generator=generator, dtype=torch.int8)
        return {'d': scale(), 'qs': qs}
    qs = torch.randint(0, 256, (rows, per_row, 16), generator=generator, dtype=torch.uint8)
    return {'d': scale(), 'qs': qs} if quant_type == 'Q4_0' else {'d': scale(), 'm': scale(), 'qs': qs}

def assert_linear(out, x, w, bias=None):
    "`out` is `x @ w.T + bias` up to the weights rounded to x's dtype (one ulp), fp32 sums, and out's rounding."
    assert out.shape == (*x.shape[:-1], w.shape[0])
    x32, K = x.float().reshape(-1, w.shape[1]), w.shape[1]
    ref = x32 @ w.T + (0 if bias is None else bias.float())
    size = x32.abs() @ w.abs().T + (0 if bias is None else bias.float().abs())
    weight_rounding = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 0.0
    tol = size * (weight_rounding + (K + 2) * 2.0**-23) + torch.finfo(out.dtype).eps * ref.abs()
    err = (out.float().reshape(ref.shape) - ref).abs()
    bad = ~(err <= tol)
    assert not bad.any(), f'{bad.sum().item()} of {bad.numel()} elements off, by up to {err.max().item():.3g}'

@pytest.mark.parametrize('quant_type', ['Q4_0', 'Q4_1', 'Q8_0'])
@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_block_products(quant_type, dtype, shape):
    M, N, K = shape
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    blocks = random_blocks(quant_type, N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = dequantize(quant_type, blocks)
    for bias in (None, torch.randn(N, generator=g).to(dtype)):
        if quant_type == 'Q8_0': out = linear_w8(x, blocks['qs'], blocks['d'], bias)
        else: out = linear_w4(x, blocks['qs'], blocks['d'], blocks.get('m'), bias)
        assert out.dtype == dtype
        assert_linear(out, x, w, bias)

@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_fp8_product(dtype, shape):
    M, N, K = shape
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, W = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g)
    blocks = quantize_fp8(W)
    q, scale = quantize_fp8_activations(x)     # the activations the product quantizes to: see 07b on the interpreter
    for bias in (None, torch.randn(N, generator=g).to(dtype)):
        out = linear_fp8(x, blocks['qs'], blocks['d'], bias)
        assert out.dtype == dtype
        assert_linear(out, q.float() * scale[:, None], dequantize_fp8(blocks), bias)
    # the [N, K] and [N] forms of the fields give the same product
    flat = linear_fp8(x, blocks['qs'].reshape(N, K), blocks['d'].reshape(N))
    assert torch.equal(flat, linear_fp8(x, blocks['qs'], blocks['d']))

def test_fp8_activations():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3000, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    q, scale = quantize_fp8_activations(x)
    amax = x.abs().amax(-1)
    assert torch.equal(scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    back = q.float() * scale[:, None]
    assert torch.equal(back[4], torch.zeros(3000))
    if not INTERPRET:   # the interpreter's e4m3 conversion is its own (chapter 07b)
        q_ref = (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (back.abs().amax(-1) <= amax * (1 + 2**-23)).all()      # clamped to 448: never past the row's largest

def test_layers_fields_and_leading_shape():
    "The kernels take 07a's int4 and int8 blocks as stored, and any leading shape of x, as F.linear does."
    g = torch.Generator().manual_seed(1)
    W, x = torch.randn(40, 64, generator=g), torch.randn(3, 2, 64, generator=g).bfloat16()
    int4, int8 = quantize_int4(W), quantize_int8(W)
    assert_linear(linear_w4(x, int4['qs'], int4['d'], int4['m']), x, dequantize('int4', int4))
    assert_linear(linear_w8(x, int8['qs'], int8['d']), x, dequantize('int8', int8))
    assert linear_w4(x[:0], int4['qs'], int4['d'], int4['m']).shape == (0, 2, 40)

def test_quantize_fp8_format():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(5, 64, generator=g) * torch.logspace(-4, 2, 5)[:, None]
    blocks = quantize_fp8(W.bfloat16())
    assert blocks['d'].dtype == torch.float32 and blocks['d'].shape == (5, 1)
    assert blocks['qs'].dtype == torch.float8_e4m3fn and blocks['qs'].shape == (5, 1, 64)
    W = W.bfloat16().float()
    assert ((dequantize_fp8(blocks) - W).abs() <= W.abs() * 2**-4 + blocks['d'] * 2**-10).all()
    assert torch.equal(dequantize_fp8({k: v[1:3] for k, v in blocks.items()}), dequantize_fp8(blocks)[1:3])
    with pytest.raises(ValueError, match='inf or nan'): quantize_fp8(torch.tensor([[float('inf'), 1.0]]))

def test_wrong_fields_are_refused():
    g = torch.Generator().manual_seed(3)
    blocks, x = random_blocks('Q4_1', 8, 64, g), torch.randn(2, 64, generator=g)
    with pytest.raises(AssertionError): linear_w4(x[:, :32], blocks['qs'], blocks['d'], blocks['m'])   # K mismatch
    with pytest.raises(AssertionError): linear_w4(x, blocks['qs'], blocks['d'], blocks['m'][:4])
    with pytest.raises(AssertionError): linear_w8(x, blocks['qs'], blocks['d'])                       # 4-bit blocks
    with pytest.raises(AssertionError): linear_w4(x.long(), blocks['qs'], blocks['d'])

def test_the_check_catches_a_wrong_nibble_order():
    "The allowance of `assert_linear` is tight: weights in the wrong order within their blocks fail it."
    g = torch.Generator().manual_seed(4)
    blocks, x = random_blocks('Q4_0', 33, 96, g), torch.randn(3, 96, generator=g).bfloat16()
    swapped = (blocks['qs'] << 4) | (blocks['qs'] >> 4)
    with pytest.raises(AssertionError, match='elements off'):
        assert_linear(linear_w4(x, swapped, blocks['d']), x, dequantize('Q4_0', blocks))
