"""Small @triton.jit helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def l2norm_rows(x):
  """Normalises the last axis of a float32 block: x / sqrt(sum(x^2) + 1e-6).

  The epsilon keeps a zero row (a folded decode step's empty query) at exactly zero.
  """
  return x / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)
