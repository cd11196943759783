"""gdp_kernels: the Triton kernels of gdp-jax, framework-neutral.

Nothing here imports jax or torch: the JAX wrappers (gdp_jax._launch) and a torch launcher call
the same `@triton.jit` functions. Every kernel orders its parameters inputs, then outputs, then
constexprs, which is how jax_triton.triton_call passes them.
"""
from . import _common  # noqa: F401
