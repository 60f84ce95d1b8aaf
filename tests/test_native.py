"""The native warm path (`tileops.native`) on the CPU: its table, and the dispatcher handing it
GEMM calls. The CPU's kernels are not tvm-ffi functions, so a small C++ kernel built here stands
in for the compiled one: c = a @ w^T through its arguments' strides, every scratch element set
to 1 (the GPU tests run the real kernels through the same path)."""

from __future__ import annotations

import threading

import pytest
import torch

import tileops
from tileops import dispatch, native
from tileops.native import INPUT, INPUT_SWAPPED, INPUT_WORDS, OUTPUT, SCRATCH, Buffer, Recipe
from tileops.ops.gemm import GEMM
from tileops.ops.host import WorkspaceAdapter
from tileops.ops.mxfp4 import MXFP4_GEMM

KERNEL = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
namespace ffi = tvm::ffi;
// c[m, n] = the first 32-bit word of row n of w, as the MXFP4 kernels read their weight.
void FirstWords(ffi::TensorView a, ffi::TensorView w, ffi::TensorView s, ffi::TensorView c) {
  TVM_FFI_ICHECK(w.dtype().code == kDLInt && w.dtype().bits == 32) << "w is not int32 words";
  const int32_t* W = static_cast<const int32_t*>(w.data_ptr());
  float* C = static_cast<float*>(c.data_ptr());
  for (int64_t m = 0; m < c.size(0); ++m)
    for (int64_t n = 0; n < c.size(1); ++n) C[m * c.size(1) + n] = W[n * w.stride(0)];
}
void Gemm(ffi::TensorView a, ffi::TensorView w, ffi::TensorView c, ffi::TensorView s) {
  const float* A = static_cast<const float*>(a.data_ptr());
  const float* W = static_cast<const float*>(w.data_ptr());
  float* C = static_cast<float*>(c.data_ptr());
  for (int64_t m = 0; m < a.size(0); ++m)
    for (int64_t n = 0; n < w.size(0); ++n) {
      float acc = 0;
      for (int64_t k = 0; k < a.size(1); ++k)
        acc += A[m * a.stride(0) + k * a.stride(1)] * W[n * w.stride(0) + k * w.stride(1)];
      C[m * c.stride(0) + n * c.stride(1)] = acc;
    }
  float* S = static_cast<float*>(s.data_ptr());
  for (int64_t i = 0; i < s.numel(); ++i) S[i] = 1;
}
"""


@pytest.fixture(scope="module")
def kernels():
    import tvm_ffi.cpp

    if native.module() is None:
        pytest.skip("the native warm path cannot be built here")
    return tvm_ffi.cpp.load_inline("tileops_test_kernels", cpp_sources=KERNEL,
                                   functions=["Gemm", "FirstWords"])


@pytest.fixture
def kernel(kernels):
    return kernels.Gemm


@pytest.fixture(autouse=True)
def empty_table():
    dispatch.reset()
    yield
    dispatch.reset()


SWAPPED = Recipe(((INPUT, 0), (INPUT_SWAPPED, 1), (OUTPUT, 0), (SCRATCH, 1)),
                 (Buffer((3, 5), torch.float32), Buffer((7,), torch.float32, returned=False)))


def test_a_registered_call_runs_natively_and_nothing_else_does(kernel):
    a, w = torch.randn(3, 8), torch.randn(5, 8)
    table = native.module()
    assert native.register(0, kernel, SWAPPED, (a, w.t(), None))
    out = table.call(0, a, w.t(), None)
    assert type(out) is torch.Tensor and out.shape == (3, 5)
    torch.testing.assert_close(out, a @ w.t())
    a2 = torch.randn(3, 8)  # other data, same signature
    torch.testing.assert_close(table.call(0, a2, w.t(), None), a2 @ w.t())
    # Anything the key holds, changed, misses: the Python path takes those calls.
    misses = [(1, a, w.t(), None),                         # another operator
              (0, a, w.t(), torch.float16),                # another scalar argument
              (0, a[:2], w.t(), None),                     # another shape
              (0, a, w.t().contiguous(), None),            # other strides
              (0, a.double(), w.t(), None),                # another dtype
              (0, a, w.t()),                               # fewer arguments
              (0, torch.randn(25)[1:].view(3, 8), w.t(), None)]  # data not 16-byte aligned
    for args in misses:
        assert table.call(*args) is None
    assert table.size() == 1
    native.clear()
    assert table.call(0, a, w.t(), None) is None


def test_the_table_stops_growing_at_its_bound(kernel):
    w = torch.randn(5, 8)
    registered = [native.register(0, kernel, SWAPPED, (torch.randn(3, 8), w.t(), m))
                  for m in range(4100)]  # one entry per value of the last argument
    assert registered == [True] * 4096 + [False] * 4
    assert native.module().size() == 4096


def test_several_outputs_come_back_in_order(kernel):
    a, w = torch.randn(3, 8), torch.randn(5, 8)
    both = SWAPPED._replace(args=((INPUT, 0), (INPUT_SWAPPED, 1), (OUTPUT, 0), (OUTPUT, 1)),
                            buffers=(Buffer((3, 5), torch.float32), Buffer((7,), torch.float32)))
    assert native.register(0, kernel, both, (a, w.t()))
    out, ones = native.module().call(0, a, w.t())
    torch.testing.assert_close(out, a @ w.t())
    assert torch.equal(ones, torch.ones(7))


def test_threads_call_at_once(kernel):
    a, w = torch.randn(3, 8), torch.randn(5, 8)
    assert native.register(0, kernel, SWAPPED, (a, w.t(), None))
    errors = []

    def work(seed):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
        for _ in range(200):
            if not torch.allclose(native.module().call(0, x, w.t(), None), x @ w.t(), atol=1e-5):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.fixture
def gemm_on_the_stand_in(kernel, monkeypatch):
    """tileops.gemm on the CPU with the stand-in as its compiled kernel (with one scratch buffer
    of M elements, as split-K's partials are), and a count of `prepare` calls."""
    monkeypatch.setattr(dispatch.Dispatcher, "_compile_choice",
                        lambda self, *args: WorkspaceAdapter(kernel, [((None,), torch.float32, False)]))
    prepared = []
    real = GEMM.prepare

    def counted(*args):
        prepared.append(args)
        return real(*args)

    monkeypatch.setattr(GEMM, "prepare", counted)
    return prepared


def test_gemm_hands_warm_calls_to_the_native_path(gemm_on_the_stand_in):
    prepared = gemm_on_the_stand_in
    w = torch.randn(48, 32)
    for M in (5, 5, 5, 9, 9):
        a = torch.randn(M, 32)
        torch.testing.assert_close(tileops.gemm(a, w.t()), a @ w.t())
    assert len(prepared) == 2  # the first call of each shape; the others ran natively
    assert native.module().size() == 2


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_gemm_recipe_is_its_launch(layout):
    """a, then the (N, K) weight a `w.t()` views (its dimensions swapped back) or the (K, N) b
    as it is, then c (M x N, the output dtype), then the kernel's scratch."""
    a, w = torch.randn(5, 32), torch.randn(48, 32)
    b = w.t() if layout == "nk" else w.t().contiguous()
    args = (a, b, torch.float16)
    kernel = WorkspaceAdapter(object(), [((None, 4), torch.float32, False)])
    fn, recipe = GEMM.warm_recipe(args, GEMM.prepare(*args), kernel)
    assert fn is kernel.kernel
    assert recipe.args == ((INPUT, 0), (INPUT_SWAPPED if layout == "nk" else INPUT, 1),
                           (OUTPUT, 0), (SCRATCH, 1))
    assert recipe.buffers == (Buffer((5, 48), torch.float16),
                              Buffer((5, 4), torch.float32, returned=False))


def test_zeroed_workspaces_start_at_zero_and_keep_the_python_path():
    """Stream-K's flags must read zero at every launch: the adapter zeroes them (and leaves
    the others uninitialised), and the native path, which does not initialise, is refused."""
    seen = []
    kernel = WorkspaceAdapter(lambda *args: seen.append(args),
                              [((None, 4), torch.float32, False), ((8,), torch.int32, True)])
    for _ in range(2):
        kernel(torch.randn(5, 32))
        _, partials, flags = seen[-1]
        assert partials.shape == (5, 4) and torch.equal(flags, torch.zeros(8, dtype=torch.int32))
        flags.fill_(1)  # what a launch leaves behind
    a, w = torch.randn(5, 32), torch.randn(48, 32)
    args = (a, w.t(), torch.float32)
    assert GEMM.warm_recipe(args, GEMM.prepare(*args), kernel) is None


def test_calls_prepare_copies_for_stay_on_the_python_path(gemm_on_the_stand_in):
    prepared = gemm_on_the_stand_in
    a = torch.randn(32, 5).t()  # not contiguous: prepare copies it
    b = torch.randn(48, 32).t()
    for _ in range(3):
        torch.testing.assert_close(tileops.gemm(a, b), a @ b)
    assert len(prepared) == 3 and native.module().size() == 0


def test_reset_forgets_the_native_entries(gemm_on_the_stand_in):
    prepared = gemm_on_the_stand_in
    a, b = torch.randn(4, 32), torch.randn(48, 32).t()
    tileops.gemm(a, b)
    tileops.gemm(a, b)
    dispatch.reset()  # new records may choose another kernel
    tileops.gemm(a, b)
    assert len(prepared) == 2


def test_bad_input_still_gets_the_python_path_error(gemm_on_the_stand_in):
    a, b = torch.randn(4, 32), torch.randn(48, 32).t()
    tileops.gemm(a, b)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        tileops.gemm(a, torch.randn(31, 48))
    with pytest.raises(TypeError, match="two tensors"):
        tileops.gemm(a, [1.0])


@pytest.mark.gpu
def test_gemm_warm_calls_run_natively_on_cuda(monkeypatch):
    """The real kernels through the native path: decode-sized calls of the shipped records
    (split-K scratch included), two M of one bucket, the warm call on a busy side stream."""
    if native.module() is None:
        pytest.skip("the native warm path cannot be built here")
    prepared = []
    real = GEMM.prepare
    monkeypatch.setattr(GEMM, "prepare", lambda *args: prepared.append(1) or real(*args))
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for M in (16, 9):
        a = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        outs = [tileops.gemm(a, w.t())]  # the Python path, which hands the call over
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000)  # busy: a launch elsewhere would read `a` half-written
            a.normal_()
            outs.append(tileops.gemm(a, w.t()))
        side.synchronize()
        ref = a.double() @ w.double().t()
        assert (outs[1].double() - ref).norm() / ref.norm() < 1e-2
    assert len(prepared) == 2 and native.module().size() == 2


def test_byte_rows_are_read_as_words(kernels):
    """INPUT_WORDS: an (N, K/2) uint8 MXFP4 weight reaches the kernel as (N, K/8) int32."""
    a = torch.randn(2, 64)
    w = torch.randint(0, 256, (3, 32), dtype=torch.uint8)
    s = torch.randint(0, 256, (3, 2), dtype=torch.uint8)
    recipe = Recipe(((INPUT, 0), (INPUT_WORDS, 1), (INPUT, 2), (OUTPUT, 0)),
                    (Buffer((2, 3), torch.float32),))
    assert native.register(0, kernels.FirstWords, recipe, (a, w, s))
    out = native.module().call(0, a, w, s)
    assert torch.equal(out, w.view(torch.int32)[:, 0].float().expand(2, 3))


def test_mxfp4_recipe_is_its_launch():
    """a, the fp4 bytes as words, the scales, c, then the kernel's workspace; none where
    prepare copied an operand."""
    a = torch.randn(5, 64).bfloat16()
    w = torch.randint(0, 256, (48, 32), dtype=torch.uint8)
    s = torch.full((48, 2), 127, dtype=torch.uint8)
    kernel = WorkspaceAdapter(object(), [((None, 48), torch.float32, False)])
    fn, recipe = MXFP4_GEMM.warm_recipe((a, w, s), MXFP4_GEMM.prepare(a, w, s), kernel)
    assert fn is kernel.kernel
    assert recipe.args == ((INPUT, 0), (INPUT_WORDS, 1), (INPUT, 2), (OUTPUT, 0), (SCRATCH, 1))
    assert recipe.buffers == (Buffer((5, 48), torch.bfloat16),
                              Buffer((5, 48), torch.float32, returned=False))
    a_t = torch.randn(64, 5).bfloat16().t()  # copied by prepare
    assert MXFP4_GEMM.warm_recipe((a_t, w, s), MXFP4_GEMM.prepare(a_t, w, s), kernel) is None


def test_a_failing_native_call_falls_back_and_the_operator_leaves_the_path(
        gemm_on_the_stand_in, monkeypatch, caplog):
    """A recipe that does not fit its kernel (here one argument short): the call still gets
    the Python path's result, the operator keeps the Python path, and the log says so."""
    prepared = gemm_on_the_stand_in
    real = GEMM.warm_recipe

    def short(args, call, kernel):
        fn, recipe = real(args, call, kernel)
        return fn, recipe._replace(args=recipe.args[:-1])

    monkeypatch.setattr(GEMM, "warm_recipe", short)
    a, w = torch.randn(4, 32), torch.randn(48, 32)
    for _ in range(3):
        torch.testing.assert_close(tileops.gemm(a, w.t()), a @ w.t())
    assert len(prepared) == 3  # first call, the fallback of the failed native one, third call
    assert "leaves the native warm path" in caplog.text
    assert "gemm" not in dispatch.DISPATCHER._warm_ops


def test_mxfp4_refuses_grad_before_dispatch():
    a = torch.randn(2, 64, requires_grad=True)
    w = torch.randint(0, 256, (16, 32), dtype=torch.uint8)
    s = torch.full((16, 2), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no backward"):
        tileops.mxfp4_gemm(a.bfloat16(), w, s)


@pytest.mark.gpu
def test_mxfp4_warm_calls_run_natively_on_cuda(monkeypatch):
    """The OCP MXFP4 kernels through the native path (the weight's bytes as int32 words), the
    warm call equal to the Python path's on the same inputs."""
    if native.module() is None:
        pytest.skip("the native warm path cannot be built here")
    prepared = []
    real = MXFP4_GEMM.prepare
    monkeypatch.setattr(MXFP4_GEMM, "prepare", lambda *args: prepared.append(1) or real(*args))
    w_fp4, w_scale = tileops.quantize_mxfp4(torch.randn(4096, 4096, device="cuda"))
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    first = tileops.mxfp4_gemm(a, w_fp4, w_scale)  # the Python path, which hands the call over
    again = tileops.mxfp4_gemm(a, w_fp4, w_scale)
    assert len(prepared) == 1 and "mxfp4_gemm" in dispatch.DISPATCHER._warm_ops
    assert torch.equal(first, again)
