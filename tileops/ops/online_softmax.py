"""The online-softmax step of the attention-shaped GPU programs (FlashAttention, MLA decode)."""

# No `from __future__ import annotations`: TileLang evaluates the macro annotations.
import tilelang.language as T

from .common import softmax_offset

# The programs that use this step compile with CUDA fast math (their kernel modules re-export
# this for `OpSpec.fast_math`): exp2 becomes one `ex2.approx` (exp2f otherwise adds range
# handling around it), and the exponentials are most of a softmax's instructions; the error
# stays far below the bf16/fp16 output's rounding.
FAST_MATH = True


@T.macro
def online_softmax(S, m, m_prev, m_safe, alpha, row_sum, l, scale):  # noqa: E741
    """One key block of FlashAttention-2's online softmax, in base 2.

    S (rows, keys) holds unscaled scores and becomes exp2(S * scale - m_safe); m is the running
    row max (of unscaled scores), m_safe what the exponents subtract (`softmax_offset`), alpha
    the factor that rescales what was accumulated before this block, l the running row sum.
    """
    T.copy(m, m_prev)
    T.reduce_max(S, m, dim=1, clear=False)
    for i in T.Parallel(S.shape[0]):
        m_safe[i] = softmax_offset(m[i], scale)
        alpha[i] = T.exp2(m_prev[i] * scale - m_safe[i])
    for i, j in T.Parallel(S.shape[0], S.shape[1]):
        S[i, j] = T.exp2(S[i, j] * scale - m_safe[i])
    T.reduce_sum(S, row_sum, dim=1)
    for i in T.Parallel(S.shape[0]):
        l[i] = l[i] * alpha[i] + row_sum[i]
