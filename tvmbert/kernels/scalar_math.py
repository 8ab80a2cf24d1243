"""float32 functions as polynomials LLVM can vectorize, where libm's ``expf``/``erff`` are scalar
calls that stop it: for the legalized kernels (passes) and our own (fma). Below the stages."""

from __future__ import annotations

# Rational approximation of erf on [-4, 4] (TVM's topi.fast_erf, after Eigen): x * P(x^2) / Q(x^2).
ERF_NUMERATOR = (-2.7261423674040941e-10, 2.7706814620387377e-08, -2.101023937939317e-06, -5.6925062381196767e-05,
                 -0.00073499063728377223, -0.0029545999132096767, -0.016096033155918121)
ERF_DENOMINATOR = (-1.4566071513399947e-05, -0.00021337404905352741, -0.001682827016338706, -0.0073733292520046234,
                   -0.014264739118516445)
# Cephes' expf: a degree-5 polynomial on [-ln2/2, ln2/2], highest power first.
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _const(value):
    from tvm import tirx

    return tirx.const(value, "float32")


def _horner(x, coefficients):
    result = _const(coefficients[0])
    for coefficient in coefficients[1:]:
        result = result * x + _const(coefficient)
    return result


def erf_float32(x):
    """4.2e-7 max abs error on [-6, 6] against float64 (a few ulp); exactly ±1 beyond ±4."""
    from tvm import tirx

    x = tirx.max(tirx.min(x, _const(4.0)), _const(-4.0))
    squared = x * x
    return x * _horner(squared, ERF_NUMERATOR) / _horner(squared, ERF_DENOMINATOR)


def gelu_float32(x):
    """GELU in its exact (erf) form: x * Phi(x)."""
    return x * (_const(0.5) + erf_float32(x * _const(0.7071067811865476)) * _const(0.5))


def exp_float32(x):
    """exp as Cephes' ``expf``: x = n ln2 + r (ln2 split in two constants), the polynomial in r,
    2^n written into the exponent bits. Within 1 ulp of the exact value on [-87, 0] (measured:
    0.99 ulp; TVM's ``fast_exp`` 4.5 ulp); 0 below -87, where the exact value is subnormal (a
    masked attention score, ~-3.4e38: a subnormal probability slows every multiply by it, and
    half-masked batches ran twice as slow: CHANGELOG.md, 2026-11-22); 88 at most."""
    from tvm import tirx

    clamped = tirx.max(tirx.min(x, _const(88.0)), _const(-87.0))
    n = tirx.floor(clamped * _const(1.44269504088896341) + _const(0.5))
    r = clamped - n * _const(0.693359375) - n * _const(-2.12194440e-4)
    power_of_two = tirx.reinterpret("float32", (n.astype("int32") + 127) << 23)
    value = (_horner(r, EXP_POLYNOMIAL) * r * r + r + _const(1.0)) * power_of_two
    return tirx.Select(x < _const(-87.0), _const(0.0), value)
